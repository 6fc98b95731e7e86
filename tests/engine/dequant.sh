#!/usr/bin/env bash
# tests/engine/dequant.sh BUILD: client/engine/qtype.c's dequantize against the gguf Python
# package's on the real tensors of SmolLM2-135M-Instruct and on generated q4_K and q6_K tensors
# (tests/python/check_dequant.py, with
# BUILD/tests/dequant-dump as the C side, BUILD/venv from `make pydeps`). The model is
# $KVC_SMOLLM2, which `make test` exports after `make model`; a missing model or venv is a failure,
# not a skip.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
model=${KVC_SMOLLM2:-}
if [ -z "$model" ] || [ ! -f "$model" ]; then
        echo "dequant.sh: the SmolLM2 model is missing (KVC_SMOLLM2='$model'): run make model, or make test" >&2
        exit 1
fi
for f in "$build/venv/bin/python" "$build/tests/dequant-dump"; do
        [ -x "$f" ] || { echo "dequant.sh: $f is missing: run make pydeps tests BUILD=$build" >&2; exit 1; }
done
# the K-quant tensors (q4_K, q6_K) are written at test time into the build folder (check_dequant.py)
exec "$build/venv/bin/python" tests/python/check_dequant.py "$build/tests/dequant-dump" "$model" \
        "$build/tests/kquants.gguf"
