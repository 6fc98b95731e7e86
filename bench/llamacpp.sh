#!/usr/bin/env bash
# bench/llamacpp.sh [BUILD]: kvc-run against llama.cpp, its speed peer (issue 17, "Speed"), on
# SmolLM2-135M-Instruct Q4_1 ($KVC_SMOLLM2). `make bench-peers` runs it after `make peers` built
# llama-bench under BUILD/peers. Every figure is a ratio kvc-run / llama.cpp of runs interleaved in
# the same round (the machines are shared: absolute numbers from different times mean nothing);
# each side's figure is the median over ROUNDS (default 3); the ratio judged against the issue's
# target is the median of the rounds' ratios, and the ratio of the best rounds and those of every
# round are printed beside it to show the noise. About 5 minutes on 2 busy cores; bounded to 20.
#
#   decode    llama-bench -p 0 -n 64 -t T --repack 0 -fa 0 -r 1 (tg64, from an empty cache) against
#             kvc-run --local -i "Once upon a time" (4 tokens) -n 68 --threads T: kvc-run's
#             tokens_per_second counts the prompt's 4 positions, done in one pass, so decode is
#             measured as 64 / (seconds of -n 68 - seconds of -n 4), the -n 4 run (the prompt's pass
#             alone) made in the same round. T = 1 and 2.
#   prompt    llama-bench -p 512 -n 0 (pp512) against kvc-run -n 512 on the first 2,400 characters
#             of ../shared/data/tinystories/validation-sample.txt (more than 512 tokens; -n 512
#             stops after 512 positions, in 2 passes of 256 rows, and the last row's logits:
#             the work of pp512). Tokens/s = 512 / seconds.
#   bandwidth each side's decode tokens/s x 98.4 MB (the weights are read once per decoded token):
#             effective GB/s, against the machine's memory bandwidth.
#   RSS       kvc-run's maximum resident set (/usr/bin/time -v) against the GGUF's size plus the
#             keys and values the run holds (f32: 30 layers x 3 KV heads x 64 x 2 x 4 bytes =
#             46,080 bytes a position).
#   kvcd      kvc-run --socket DIR --policy full against --local, B = 1 and 8 sequences, 1 thread, -n
#             KVCD_STEPS (default 132) from "Once upon a time", KVCD_ROUNDS (default 5) rounds,
#             through a kvcd this script starts in a temporary runtime directory (--capacity 1G)
#             and stops on exit.
#
# The AMX crash of these Xeons (../shared/notes/peers.md) is why llama-bench runs with --repack 0.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${KVC_BENCH_BOUNDED:-}" ]; then
        KVC_BENCH_BOUNDED=1 exec timeout --kill-after=10 1200 "$0" "$@"
fi
build=${1:-build}
bin=$build/bin
lb=$build/peers/llama.cpp/bin/llama-bench
model=${KVC_SMOLLM2:-$HOME/.cache/kvcd/models/SmolLM2-135M-Instruct.Q4_1.gguf}
rounds=${ROUNDS:-3}
kvcd_rounds=${KVCD_ROUNDS:-5}
kvcd_steps=${KVCD_STEPS:-132}
text=../shared/data/tinystories/validation-sample.txt
WEIGHT_MB=98.4
KV_BYTES_PER_POS=46080

die() {
        echo "bench/llamacpp.sh: $*" >&2
        exit 2
}
[ -x "$lb" ] || die "$lb is missing: make peers BUILD=$build"
for p in "$bin/kvc-run" "$bin/kvcd" /usr/bin/time; do [ -x "$p" ] || die "$p is missing"; done
[ -f "$model" ] || die "no model at $model: make model"
[ -f "$text" ] || die "no $text"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvc-bench-peers-XXXXXX")
kvcd_pid=
cleanup() {
        if [ -n "$kvcd_pid" ]; then
                kill "$kvcd_pid" 2>/dev/null || true
                wait "$kvcd_pid" 2>/dev/null || true
        fi
        rm -rf "$tmp"
}
trap cleanup EXIT

story="Once upon a time"
long=$(head -c 2400 "$text")
field() { sed -n "s/.*\"$1\": *\([0-9.e+-]*\).*/\1/p" | head -1; }
# llama-bench ARGS...: its tokens/s (one test, -o jsonl)
llama() {
        timeout 300 "$lb" -m "$model" --repack 0 -fa 0 -r 1 -o jsonl "$@" 2>"$tmp/lb.err" | field avg_ts |
                grep . || { cat "$tmp/lb.err" >&2; die "llama-bench $* failed"; }
}
# kvc-run ARGS...: its JSON on stdout; its maximum RSS in kB appended to $tmp/rss.NAME where
# RSS=NAME is set
kvcrun() {
        timeout 300 /usr/bin/time -v "$bin/kvc-run" --model "$model" --json --no-stop "$@" 2>"$tmp/time.txt" ||
                { cat "$tmp/time.txt" >&2; die "kvc-run $* failed"; }
        if [ -n "${RSS:-}" ]; then
                sed -n 's/.*Maximum resident set size (kbytes): //p' "$tmp/time.txt" >>"$tmp/rss.$RSS"
        fi
}
seconds() { field seconds; }

echo "# kvc-run against llama.cpp (issue 17): SmolLM2-135M-Instruct Q4_1"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' (+ local changes)')"
echo "machine: nproc $(nproc), $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "llama.cpp: $(cat "$build/peers/llama.cpp.stamp" 2>/dev/null || echo '?')"
echo "model: $model ($(stat -c %s "$model") bytes); $rounds rounds"
echo

# the long prompt must hold at least 512 tokens: -n 512 then prints the prompt's text only, shorter
# than the prompt (escaped, the JSON text of 512 of its tokens is about 2,000 characters)
out=$(kvcrun --local -i "$long" -n 512 --threads 2)
t=$(sed -n 's/.*"text":"\(.*\)"}$/\1/p' <<<"$out")
[ "${#t}" -lt $((${#long} - 100)) ] || die "the prompt has fewer than 512 tokens: take more characters of $text"

for r in $(seq "$rounds"); do
        echo "round $r ($(date -u +%T), load $(cut -d' ' -f1 /proc/loadavg))"
        for T in 1 2; do
                llama -p 0 -n 64 -t "$T" >>"$tmp/lb.tg.$T"
                a=$(kvcrun --local -i "$story" -n 4 --threads "$T" | seconds)
                b=$(RSS=tg kvcrun --local -i "$story" -n 68 --threads "$T" | seconds)
                awk -v a="$a" -v b="$b" 'BEGIN { printf "%.3f\n", 64 / (b - a) }' >>"$tmp/kv.tg.$T"
                llama -p 512 -n 0 -t "$T" >>"$tmp/lb.pp.$T"
                RSS=pp kvcrun --local -i "$long" -n 512 --threads "$T" | seconds |
                        awk '{ printf "%.3f\n", 512 / $1 }' >>"$tmp/kv.pp.$T"
        done
done

echo "kvcd: $kvcd_rounds rounds of --local and --socket --policy full, -n $kvcd_steps, 1 thread ($(date -u +%T))"
"$bin/kvcd" --runtime-dir "$tmp/run" --capacity 1G --log-level warning 2>"$tmp/kvcd.log" &
kvcd_pid=$!
for _ in $(seq 200); do
        [ -S "$tmp/run/kvcd.sock" ] && [ -S "$tmp/run/kvcd.fd.sock" ] && break
        kill -0 "$kvcd_pid" 2>/dev/null || break
        sleep 0.05
done
[ -S "$tmp/run/kvcd.fd.sock" ] || { cat "$tmp/kvcd.log" >&2; die "kvcd did not come up"; }
for r in $(seq "$kvcd_rounds"); do
        for B in 1 8; do
                kvcrun --local -i "$story" -n "$kvcd_steps" --threads 1 --batch "$B" |
                        field tokens_per_second >>"$tmp/local.$B"
                kvcrun --socket "$tmp/run" --policy full -i "$story" -n "$kvcd_steps" --threads 1 --batch "$B" |
                        field tokens_per_second >>"$tmp/full.$B"
        done
done
kill "$kvcd_pid"
wait "$kvcd_pid" 2>/dev/null || true
kvcd_pid=
echo

median() { sort -g "$1" | awk '{ v[NR] = $1 } END { print NR ? v[int((NR + 1) / 2)] : "nan" }'; }
best() { sort -g "$1" | tail -1; }
# the row of one measure: NAME THREADS KVC-FILE LLAMA-FILE TARGET; the ratio judged is the median
# of the rounds' ratios (each pairs two runs made one after the other)
row() {
        local x b
        ratios "$3" "$4" | tr ' ' '\n' >"$tmp/r"
        x=$(median "$tmp/r")
        b=$(awk -v k="$(best "$3")" -v l="$(best "$4")" 'BEGIN { printf "%.2f", k / l }')
        echo "| $1 | $2 | $(printf %.1f "$(median "$4")") | $(printf %.1f "$(median "$3")") | **$x** | $b |" \
                "$(ratios "$3" "$4") | >= $5 | $(verdict "$x" '>=' "$5") |"
}
# per-round ratios A/B of two files, "x.xx x.xx ..."
ratios() { paste "$1" "$2" | awk '{ printf "%s%.2f", (NR > 1 ? " " : ""), $1 / $2 }'; }
verdict() { awk -v v="$1" -v op="$2" -v t="$3" 'BEGIN { ok = op == ">=" ? v >= t : v <= t; print ok ? "met" : "MISSED" }'; }

echo "Tokens/s: medians of the rounds. Ratios: the median of the rounds' ratios (judged against the"
echo "target), the ratio of each side's best round, and each round's."
echo
echo "| measure | threads | llama.cpp | kvc-run | kvc-run / llama.cpp | best / best | each round | target | |"
echo "|---|---:|---:|---:|---:|---:|---|---|---|"
for T in 1 2; do row "decode, tokens/s (tg64)" "$T" "$tmp/kv.tg.$T" "$tmp/lb.tg.$T" 0.8; done
for T in 1 2; do row "prompt, tokens/s (pp512)" "$T" "$tmp/kv.pp.$T" "$tmp/lb.pp.$T" 0.5; done
for T in 1 2; do
        awk -v l="$(median "$tmp/lb.tg.$T")" -v k="$(median "$tmp/kv.tg.$T")" -v mb="$WEIGHT_MB" -v t="$T" 'BEGIN {
                printf "| decode, effective GB/s (tokens/s x %s MB) | %d | %.2f | %.2f | %.2f | | | | |\n",
                        mb, t, l * mb / 1000, k * mb / 1000, k / l }'
done
gguf=$(stat -c %s "$model")
for w in "tg 68" "pp 512"; do
        set -- $w
        kb=$(sort -g "$tmp/rss.$1" | tail -1)
        awk -v kb="$kb" -v g="$gguf" -v n="$2" -v kv="$KV_BYTES_PER_POS" 'BEGIN {
                base = g + n * kv; x = kb * 1024 / base
                printf "| kvc-run max RSS, MB (-n %d), against GGUF + KV (%.1f + %.1f MB) | | | %.1f | %.2f | | | <= 1.2 | %s |\n",
                        n, g / 1e6, n * kv / 1e6, kb * 1024 / 1e6, x, (x <= 1.2 ? "met" : "MISSED") }'
done
echo
echo "| kvc-run, 1 thread, -n $kvcd_steps | batch | tokens/s (all sequences) | / --local | each round | target | |"
echo "|---|---:|---:|---:|---|---|---|"
for B in 1 8; do
        l=$(median "$tmp/local.$B") f=$(median "$tmp/full.$B")
        ratios "$tmp/full.$B" "$tmp/local.$B" | tr ' ' '\n' >"$tmp/r"
        echo "| --local (in-process cache) | $B | $l | 1.00 | | | |"
        awk -v f="$f" -v b="$B" -v x="$(median "$tmp/r")" -v rr="$(ratios "$tmp/full.$B" "$tmp/local.$B")" 'BEGIN {
                printf "| --socket, kvcd, --policy full | %s | %s | **%.2f** (%+.0f%%) | %s | >= 0.98 (at most 2%% slower) | %s |\n",
                        b, f, x, (x - 1) * 100, rr, (x >= 0.98 ? "met" : "MISSED") }'
done
awk -v a="$(median "$tmp/local.1")" -v b="$(median "$tmp/local.8")" 'BEGIN {
        printf "\nbatch: B = 8 gives %.2fx B = 1 total tokens/s with --local (target >= 4x: %s)\n", b / a, (b / a >= 4 ? "met" : "MISSED") }'
echo
echo "done ($(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg))"
