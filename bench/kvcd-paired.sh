#!/usr/bin/env bash
# bench/kvcd-paired.sh [BUILD]: kvc-run through kvcd (--socket, --policy full) against --local (the
# in-process cache, no kvcd), paired rounds, with an interval on the ratio (issue 29, item 4).
#
# Each round runs, for each B in BATCHES (default "1 8"), the two back to back, the order swapped
# every round (odd rounds --local first): kvc-run --json --no-stop -i "Once upon a time" -n STEPS
# (default 132) --threads 1 --batch B, greedy, so both sides decode the same tokens. Per run:
#   wall      tokens / seconds of kvc-run's JSON (the generation alone, not the model's load)
#   CPU       tokens / CPU-seconds: kvc-run's cpu_seconds (its process, every thread, ZeroMQ's
#             too, over the same span) plus, through kvcd, kvcd's CPU over the run (the sum of
#             /proc/PID/task/*/schedstat's run time, nanoseconds, read before and after)
# The ratio judged is kvcd / --local per round. Reported: each round's ratio, the median, and the
# geometric mean with a 95% interval (Student's t over the rounds' log ratios: rounds are paired
# runs made one after the other, so a load that changes between rounds cancels; what remains is
# the spread within a round). The load average is printed at the start and the end.
#
# kvcd: started here in a temporary runtime directory (--capacity 1G), stopped on exit. Skipped
# (exit 0) when the model is missing (`make model`). ROUNDS (default 10), STEPS, BATCHES.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
bin=$build/bin
model=${KVC_SMOLLM2:-$HOME/.cache/kvcd/models/SmolLM2-135M-Instruct.Q4_1.gguf}
rounds=${ROUNDS:-10}
steps=${STEPS:-132}
read -r -a batches <<<"${BATCHES:-1 8}"

[ -f "$model" ] || { echo "kvcd-paired: skipped: no model at $model (make model)"; exit 0; }
for p in "$bin/kvc-run" "$bin/kvcd"; do
        [ -x "$p" ] || { echo "bench/kvcd-paired.sh: $p is missing" >&2; exit 2; }
done
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvc-bench-paired-XXXXXX")
kvcd_pid=
cleanup() {
        if [ -n "$kvcd_pid" ]; then
                kill "$kvcd_pid" 2>/dev/null
                wait "$kvcd_pid" 2>/dev/null
        fi
        rm -rf "$tmp"
}
trap cleanup EXIT

"$bin/kvcd" --runtime-dir "$tmp/run" --capacity 1G --log-level warning 2>"$tmp/kvcd.log" &
kvcd_pid=$!
for _ in $(seq 200); do
        [ -S "$tmp/run/kvcd.sock" ] && [ -S "$tmp/run/kvcd.fd.sock" ] && break
        kill -0 "$kvcd_pid" 2>/dev/null || break
        sleep 0.05
done
[ -S "$tmp/run/kvcd.fd.sock" ] || { cat "$tmp/kvcd.log" >&2; echo "bench/kvcd-paired.sh: kvcd did not come up" >&2; exit 2; }

# the first "KEY": number of a JSON text (the batch's positions come before each sequence's)
field() { grep -o "\"$1\": *[0-9.e+-]*" | head -1 | sed 's/.*: *//'; }
# kvcd's CPU seconds so far, every thread
kvcd_cpu() { cat /proc/"$kvcd_pid"/task/*/schedstat 2>/dev/null | awk '{ s += $1 } END { printf "%.6f\n", s / 1e9 }'; }
# one run: "tokens seconds cpu_seconds" (cpu_seconds with kvcd's share when through kvcd)
one() {
        local side=$1 B=$2 j k0 k1 n
        if [ "$side" = local ]; then
                j=$(timeout 600 "$bin/kvc-run" --model "$model" --local --json --no-stop -i "Once upon a time" \
                        -n "$steps" --threads 1 --batch "$B") || return 1
                k0=0 k1=0
        else
                k0=$(kvcd_cpu)
                j=$(timeout 600 "$bin/kvc-run" --model "$model" --socket "$tmp/run" --policy full --json --no-stop \
                        -i "Once upon a time" -n "$steps" --threads 1 --batch "$B") || return 1
                k1=$(kvcd_cpu)
        fi
        n=$(field positions <<<"$j")
        [ -n "$n" ] || n=$(field steps <<<"$j")
        awk -v n="$n" -v s="$(field seconds <<<"$j")" -v c="$(field cpu_seconds <<<"$j")" -v k0="$k0" -v k1="$k1" \
                'BEGIN { printf "%d %.6f %.6f\n", n, s, c + k1 - k0 }'
}

echo "kvcd-paired: SmolLM2-135M-Instruct Q4_1, -n $steps, 1 thread, B = ${batches[*]}, $rounds rounds; $(date -u '+%Y-%m-%d %H:%M:%S UTC'); load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "binaries: $bin/kvc-run, $bin/kvcd; the source tree here: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' + local changes')"
failed=0
for r in $(seq "$rounds"); do
        for B in "${batches[@]}"; do
                order="local kvcd"
                [ $((r % 2)) = 0 ] && order="kvcd local"
                for side in $order; do
                        one "$side" "$B" >>"$tmp/$side.$B" || { echo "round $r: $side B=$B failed" >&2; failed=1; }
                done
        done
done

# rounds' ratios (wall, CPU) from the two files: "wall cpu" a line
ratios() {
        paste -d' ' "$1" "$2" | awk '{ printf "%.4f %.4f\n", ($1 / $2) / ($4 / $5), ($1 / $3) / ($4 / $6) }'
}
# COLUMN of stdin: "median geomean lo hi" (geometric mean, 95% t interval over the log ratios)
stats() { awk -v c="$1" -v fmt=plain -f bench/geomean.awk; }

echo
echo "| B | --local tokens/s (wall, median) | kvcd tokens/s | --local tokens per CPU-s | kvcd tokens per CPU-s (kvc-run + kvcd) | kvcd / --local, wall: median, geomean [95%] | per CPU-second: median, geomean [95%] | each round (wall) |"
echo "|---:|---:|---:|---:|---:|---|---|---|"
for B in "${batches[@]}"; do
        [ -s "$tmp/local.$B" ] && [ -s "$tmp/kvcd.$B" ] || continue
        ratios "$tmp/kvcd.$B" "$tmp/local.$B" >"$tmp/r.$B"
        med() { awk "{ print \$1 / \$$2 }" "$1" | sort -g | awk '{ v[NR] = $1 } END { printf "%.1f", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
        read -r wm wg wl wh <<<"$(stats 1 <"$tmp/r.$B")"
        read -r cm cg cl ch <<<"$(stats 2 <"$tmp/r.$B")"
        echo "| $B | $(med "$tmp/local.$B" 2) | $(med "$tmp/kvcd.$B" 2) | $(med "$tmp/local.$B" 3) | $(med "$tmp/kvcd.$B" 3) |" \
                "$wm, $wg [$wl, $wh] | $cm, $cg [$cl, $ch] | $(awk '{ printf "%s%.2f", (NR > 1 ? " " : ""), $1 }' "$tmp/r.$B") |"
done
echo
echo "done $(date -u +%T); load $(cut -d' ' -f1-3 /proc/loadavg)"
exit "$failed"
