#!/usr/bin/env bash
# tests/python/transformers.sh BUILD [PYTEST-ARGS...]: the pytest tests of kvcd.transformers
# (client/python/tests/test_transformers*.py: SmolLM2 through KvcdCache against DynamicCache and
# the golden ids of ../shared/models/smollm2) with the venv `make python-deps` made in
# BUILD/venv-torch (or BUILD/$KVC_TORCH_VENV: transformers-5.2.sh runs them in venv-kvpress),
# against the build tree's kvcd and libkvc. Installs nothing; nothing is fetched
# (HF_HUB_OFFLINE=1). The model is $KVC_SMOLLM2 (make test exports it), else the model cache's.
# One entry in tests/run.sh's summary. A missing venv or model is a failure, not a skip: the
# Makefile lists it in `make test`, which makes venv-torch first (KVC_TORCH=0: left out).
set -eu
build=${1:-build}
[ $# -gt 0 ] && shift
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
case $build in /*) ;; *) build=$root/$build ;; esac
venv=${KVC_TORCH_VENV:-venv-torch}
py=$build/$venv/bin/python
if [ ! -x "$py" ]; then
        target=python-deps
        [ "$venv" = venv-kvpress ] && target=kvpress-deps
        echo "transformers.sh: $py missing: run make $target BUILD=$build" >&2
        exit 1
fi
export KVC_SMOLLM2=${KVC_SMOLLM2:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcd/models/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ ! -f "$KVC_SMOLLM2" ]; then
        echo "transformers.sh: $KVC_SMOLLM2 missing: run make model" >&2
        exit 1
fi
export KVC_BUILD=$build
export KVC_LIBRARY=$build/lib/libkvc.so
export KVCCTL=$build/bin/kvcctl
export PYTHONPATH=$root/client/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1
unset KVC_SOCKET
exec "$py" -m pytest -q -p no:cacheprovider client/python/tests/test_transformers.py "$@"
