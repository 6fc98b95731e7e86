#!/usr/bin/env bash
# bench/tiers-peers.sh [BUILD [OUT]]: llama.cpp's KV cache types on the exact documents and needles of
# `kvc-eval --task tiers` (issue 26, "Measure": the peers beside kvcd's tiers), on SmolLM2-135M-Instruct
# Q4_1 ($KVC_SMOLLM2). `make bench-tiers-peers` runs it after `make peers` and `make all`.
#
#   1. kvc-eval --task tiers --documents 3 --lengths 4096 --dump-tokens: the token ids of the three
#      4,096-token documents and the nine needles (3 at each of 1K, 2K, 4K) that the committed
#      tiers run scored (same seed, same order: client/eval/tiers.c).
#   2. bench/llama-tiers.c, built against BUILD/peers (llama.cpp 0c1e570, the sdist of
#      llama-cpp-python 0.3.36), scores them with one llama.cpp context per cache type (TYPES,
#      default f16,q8_0,q4_0,iq4_nl; K and V at the type, flash attention on for all), teacher-
#      forced like tiers.c: documents from position 144 on, needles by greedy exact match. One
#      process a sequence, one thread each, JOBS (default 3) at once: the machine's two cores are
#      shared, and a finished sequence's raw lines survive a cut. A sequence whose raw file
#      (BUILD/tiers-peers/raw/NAME) is complete is not run again (delete that folder to start over).
#   3. llama-tiers report: OUT/peers.md and OUT/peers.jsonl, each type against llama.cpp's own f16
#      (intervals from client/eval/stats.c, clustered by document; bootstrap over needles).
#   4. With QUANTO=1: bench/tiers_quanto.py in BUILD/venv-kvpress (`make kvpress-deps`, which pins
#      optimum-quanto): transformers' QuantizedCache, quanto backend, 4 and 2 bits, against its
#      float32 DynamicCache, on the same sequences (needles and documents in two processes), into
#      OUT/peers-quanto.md and .jsonl. It quantizes only after a forward pass: a needle's prompt is
#      prefilled in full precision, and documents go in chunks of 128 (tiers_quanto.py says why).
#
# About 1 hour of CPU (about 35,000 positions through 4 contexts); on the shared 2-core machine at
# load 5-50, 1-2 hours of wall time. OUT defaults to bench/quality/smollm2/tiers.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=${2:-bench/quality/smollm2/tiers}
model=${KVC_SMOLLM2:-$HOME/.cache/kvcd/models/SmolLM2-135M-Instruct.Q4_1.gguf}
types=${TYPES:-f16,q8_0,q4_0,iq4_nl}
peers=$build/peers
src=$peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp
lib=$peers/llama.cpp/bin
tool=$peers/llama-tiers
work=$build/tiers-peers

die() {
        echo "bench/tiers-peers.sh: $*" >&2
        exit 2
}
if ! [ -f "$lib/libllama.so" ] || ! [ -f "$src/include/llama.h" ]; then
        die "no llama.cpp under $peers: make peers"
fi
[ -x "$build/bin/kvc-eval" ] || die "$build/bin/kvc-eval is missing: make all"
[ -f "$model" ] || die "no model at $model: make model"
mkdir -p "$work/raw" "$out"

# the libraries of this build, whatever RUNPATH a copied build carries
export LD_LIBRARY_PATH=$PWD/$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if ! [ -x "$tool" ] || [ bench/llama-tiers.c -nt "$tool" ] || [ client/eval/stats.c -nt "$tool" ]; then
        cc -std=gnu11 -O2 -Wall -Wextra -Werror -Wshadow -I"$src/include" -I"$src/ggml/include" -Iclient/eval \
                bench/llama-tiers.c client/eval/stats.c -L"$lib" -lllama -lggml -lggml-base -lm \
                -Wl,-rpath,"$PWD/$lib" -o "$tool"
fi

"$build/bin/kvc-eval" --task tiers --model "$model" --documents 3 --lengths 4096 --dump-tokens \
        --out "$work/tokens" >/dev/null 2>&1 || die "kvc-eval --dump-tokens failed"
tokens=$work/tokens/tiers_tokens.txt
# one file, and one process, a sequence: documents and the longest needles first
rm -rf "$work/seq" && mkdir -p "$work/seq"
awk -v dir="$work/seq" '{ f = dir "/" ($1 == "doc" ? "doc-" $2 : "needle-" $2 "-" $3); print > f; close(f) }' "$tokens"
n_types=$(tr ',' '\n' <<<"$types" | wc -l)
jobs=${JOBS:-3}
started=$(date +%s)
for name in $(cd "$work/seq" && printf '%s\n' doc-* && printf '%s\n' needle-* | sort -t- -k2,2nr -k3,3n); do
        raw=$work/raw/$name
        if [ -f "$raw" ] && [ "$(wc -l <"$raw")" -eq "$n_types" ]; then
                echo "tiers-peers: $name: already scored ($raw)"
                continue
        fi
        rm -f "$raw"
        while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do
                wait -n || die "llama-tiers run failed (logs: $work/*.log)"
        done
        "$tool" run "$model" "$work/seq/$name" "$types" 1 "$raw" 2>"$work/$name.log" &
done
for p in $(jobs -p); do
        wait "$p" || die "llama-tiers run failed (logs: $work/*.log)"
done
seconds=$(($(date +%s) - started))

"$tool" report "$work"/raw/* "$work/report"
load=$(cut -d' ' -f1-3 /proc/loadavg)
{
        echo "# llama.cpp's KV cache types on kvc-eval tiers' documents and needles: SmolLM2-135M-Instruct Q4_1"
        echo
        echo "bench/tiers-peers.sh ($(date -u +%Y-%m-%d), ${seconds} s, load average $load at the end; llama.cpp"
        echo "0c1e570 from llama-cpp-python 0.3.36, CPU, flash attention on, 1 thread a process). The token ids are"
        echo "those of \`kvc-eval --task tiers --documents 3 --lengths 4096\` (--dump-tokens), scored as tiers.c"
        echo "scores them; each type is compared with llama.cpp's own f16 cache. Every token of the cache is at"
        echo "the type, the newest included (kvcd's tiers keep the last 128 at f16). Intervals: 95%, clustered"
        echo "by document (perplexity), bootstrap over cases (needles)."
        echo
        cat "$work/report.md"
} >"$out/peers.md"
cp "$work/report.jsonl" "$out/peers.jsonl"
cat "$out/peers.md"

[ "${QUANTO:-0}" = 1 ] || exit 0
py=$build/venv-kvpress/bin/python
if ! [ -x "$py" ] || ! "$py" -c 'import optimum.quanto' 2>/dev/null; then
        die "no optimum-quanto in $build/venv-kvpress: make kvpress-deps"
fi
mkdir -p "$work/raw-quanto"
pids=()
started=$(date +%s)
for part in needles docs; do
        raw=$work/raw-quanto/$part
        want=$(($(grep -c "^${part%s} " "$tokens") * 3))
        if [ -f "$raw" ] && [ "$(wc -l <"$raw")" -eq "$want" ]; then
                echo "tiers-peers: quanto $part: already scored ($raw)"
                continue
        fi
        rm -f "$raw"
        OMP_WAIT_POLICY=PASSIVE PYTHONDONTWRITEBYTECODE=1 nice "$py" bench/tiers_quanto.py --model "$model" \
                --tokens "$tokens" --raw "$raw" --part "$part" 2>"$work/quanto-$part.log" &
        pids+=($!)
done
for p in "${pids[@]}"; do
        wait "$p" || die "tiers_quanto.py failed (logs: $work/quanto-*.log)"
done
seconds=$(($(date +%s) - started))
"$tool" report "$work/raw-quanto/docs" "$work/raw-quanto/needles" "$work/report-quanto"
load=$(cut -d' ' -f1-3 /proc/loadavg)
{
        echo "# transformers' QuantizedCache (quanto) on kvc-eval tiers' documents and needles: SmolLM2-135M-Instruct"
        echo
        echo "bench/tiers-peers.sh with QUANTO=1 ($(date -u +%Y-%m-%d), ${seconds} s, load average $load at the end;"
        echo "$("$py" -c 'import importlib.metadata as m; print(", ".join(p + " " + m.version(p) for p in ("transformers", "torch", "optimum-quanto")))'),"
        echo "float32 weights dequantized from the Q4_1 GGUF, 1 thread a process). QuantizedCache(\"quanto\", nbits 4 or 2,"
        echo "q_group_size 64, residual_length 128, axis 0) against the float32 DynamicCache on the same token ids. It"
        echo "quantizes only what an earlier forward pass stored: a needle's prompt is one prefill in full precision"
        echo "and only the answer's tokens meet quantized keys and values; documents go in chunks of 128 tokens, each"
        echo "chunk attending to the earlier ones quantized (less up to 128 residual tokens) and to itself in full"
        echo "precision. Intervals: 95%, clustered by document (perplexity), bootstrap over cases (needles)."
        echo
        cat "$work/report-quanto.md"
} >"$out/peers-quanto.md"
cp "$work/report-quanto.jsonl" "$out/peers-quanto.jsonl"
cat "$out/peers-quanto.md"
