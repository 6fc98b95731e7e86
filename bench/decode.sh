#!/usr/bin/env bash
# bench/decode.sh [BUILD]: SmolLM2's decode per CPU-second at 1 thread, kvc-run against llama.cpp
# in the same run (issue 29). bench/run.sh (`make bench`) runs it, so that the decode figure of
# bench/RESULTS.md is measured again by every `make bench` and a regression on every token (the
# CPUID of issue 29) shows there as well as in tests/unit/test_qtype.c.
#
# Per CPU-second, not per second: on the shared 2-core machines the wall clock mostly measures the
# other jobs. Each round, one after the other:
#   kvc-run   kvc-run --local -i "Once upon a time" (4 tokens) -n 4 + DECODE --threads 1: its
#             decode_tokens / decode_cpu_seconds (its CPU time over the one-row passes alone)
#   before    the same with each kvc-run of $KVC_RUN_BEFORE (space-separated), when set: older
#             builds, for before/after in one run
#   llama.cpp llama-bench -p 0 -n N -t 1 --repack 0 -fa 0 -r 1, N = 4 and 4 + DECODE, each under
#             /usr/bin/time: DECODE / (CPU seconds of the long run - those of the short one), the
#             same DECODE positions after the same 4 (model load and warm-up cancel out); only
#             when BUILD/peers has llama-bench (`make peers`)
# The ratio judged is the median of the rounds' ratios. Effective GB/s per CPU-second: tokens per
# CPU-second x 98.4 MB (every weight is read once a token). The floor: `bench-matmul --stream`
# (when built) reads 256 MB with one core and prints the tokens/s that bandwidth allows at 98.4 MB
# a token. ROUNDS (default 3), DECODE (default 128).
# Skipped (exit 0) when the model is missing (`make model`).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
run=$build/bin/kvc-run
lb=$build/peers/llama.cpp/bin/llama-bench
model=${KVC_SMOLLM2:-$HOME/.cache/kvcd/models/SmolLM2-135M-Instruct.Q4_1.gguf}
rounds=${ROUNDS:-3}
decode=${DECODE:-128}
read -r -a before <<<"${KVC_RUN_BEFORE:-}"
WEIGHT_MB=98.4

[ -f "$model" ] || { echo "decode: skipped: no model at $model (make model)"; exit 0; }
[ -x "$run" ] || { echo "bench/decode.sh: $run is missing" >&2; exit 2; }
have_llama=0
[ -x "$lb" ] && [ -x /usr/bin/time ] && have_llama=1
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvc-bench-decode-XXXXXX")
trap 'rm -rf "$tmp"' EXIT

field() { sed -n "s/.*\"$1\": *\([0-9.e+-]*\).*/\1/p" | head -1; }
# kvc-run BINARY: decode tokens per CPU-second
kvc() {
        local j
        j=$(timeout 300 "$1" --model "$model" --local --json --no-stop -i "Once upon a time" -n $((4 + decode)) \
                --threads 1) || return 1
        awk -v n="$(field decode_tokens <<<"$j")" -v c="$(field decode_cpu_seconds <<<"$j")" \
                'BEGIN { printf "%.2f\n", n / c }'
}
# llama-bench N: "CPU-seconds tokens/s" of a tg N run
llama() {
        timeout 300 /usr/bin/time -f "cpu %U %S" -o "$tmp/time" "$lb" -m "$model" --repack 0 -fa 0 -r 1 -t 1 -p 0 \
                -n "$1" -o jsonl >"$tmp/lb" 2>"$tmp/lb.err" || { cat "$tmp/lb.err" >&2; return 1; }
        awk '/^cpu/ { printf "%.3f ", $2 + $3 }' "$tmp/time"
        field avg_ts <"$tmp/lb"
}

echo "decode: SmolLM2-135M-Instruct Q4_1, 1 thread, $decode positions after 4, $rounds rounds; load $(cut -d' ' -f1-3 /proc/loadavg)"
failed=0
for r in $(seq "$rounds"); do
        kvc "$run" >>"$tmp/kvc" || failed=1
        for i in "${!before[@]}"; do kvc "${before[$i]}" >>"$tmp/before.$i" || failed=1; done
        if [ "$have_llama" = 1 ]; then
                a=$(llama 4) && b=$(llama $((4 + decode))) || { failed=1; continue; }
                awk -v a="${a%% *}" -v b="${b%% *}" -v n="$decode" 'BEGIN { printf "%.2f\n", n / (b - a) }' >>"$tmp/llama"
        fi
done
median() { sort -g "$1" | awk '{ v[NR] = $1 } END { print NR ? v[int((NR + 1) / 2)] : "nan" }'; }
ratios() { paste "$1" "$2" | awk '{ printf "%s%.2f", (NR > 1 ? " " : ""), $1 / $2 }'; }
med_ratio() { ratios "$1" "$2" | tr ' ' '\n' >"$tmp/r"; median "$tmp/r"; }

echo "| decode, 1 thread | tokens per CPU-second (median) | effective GB/s per CPU-second | each round | kvc-run / this (median of rounds) |"
echo "|---|---:|---:|---|---:|"
row() {
        local m
        m=$(median "$2")
        awk -v n="$1" -v m="$m" -v mb="$WEIGHT_MB" -v each="$(tr '\n' ' ' <"$2")" -v x="$3" \
                'BEGIN { printf "| %s | %.1f | %.2f | %s| %s |\n", n, m, m * mb / 1000, each, x }'
}
row "kvc-run --local ($run)" "$tmp/kvc" 1.00
for i in "${!before[@]}"; do
        row "kvc-run --local, before (${before[$i]})" "$tmp/before.$i" "$(med_ratio "$tmp/kvc" "$tmp/before.$i")"
done
if [ "$have_llama" = 1 ]; then
        row "llama.cpp llama-bench tg (CPU by difference)" "$tmp/llama" "**$(med_ratio "$tmp/kvc" "$tmp/llama")**"
else
        echo "(llama.cpp is not built under $build/peers: \`make peers\` for the peer's column)"
fi
[ -x "$build/bench/bench-matmul" ] && "$build/bench/bench-matmul" --stream "$WEIGHT_MB"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
exit "$failed"
