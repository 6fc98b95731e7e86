#!/usr/bin/env bash
# bench/batch.sh [BUILD]: the batch's gain, B = 8 sequences against one, with --local (issue 29,
# item 5: the weights are read once a pass, so B = 8 should give at least 4x B = 1's tokens).
#
# Each round runs, for every kvc-run in BUILD/bin and $KVC_RUN_BEFORE (space-separated older
# builds, for before/after in one run), kvc-run --local --json --no-stop -i "Once upon a time" -n
# STEPS (default 132) --threads 1 with --batch 1 and --batch 8, one after the other. Per run:
# tokens (every sequence's positions) per second of kvc-run's generation, and per CPU-second (its
# cpu_seconds, the same span). The gain judged is B = 8 over B = 1 per round, per CPU-second;
# printed: each round's, the median and the geometric mean with a 95% t interval; and each
# build's tokens per CPU-second at B = 1 and 8 (medians), with a before build's ratio to this one
# per round. The load average is printed at the start and the end. ROUNDS (default 8).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
model=${KVC_SMOLLM2:-$HOME/.cache/kvcd/models/SmolLM2-135M-Instruct.Q4_1.gguf}
rounds=${ROUNDS:-8}
steps=${STEPS:-132}
read -r -a runs <<<"$build/bin/kvc-run ${KVC_RUN_BEFORE:-}"

[ -f "$model" ] || { echo "batch: skipped: no model at $model (make model)"; exit 0; }
for p in "${runs[@]}"; do [ -x "$p" ] || { echo "bench/batch.sh: $p is missing" >&2; exit 2; }; done
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvc-bench-batch-XXXXXX")
trap 'rm -rf "$tmp"' EXIT

field() { grep -o "\"$1\": *[0-9.e+-]*" | head -1 | sed 's/.*: *//'; }
# "tokens/s tokens-per-CPU-second" of one run
one() {
        local j n
        j=$(timeout 600 "$1" --model "$model" --local --json --no-stop -i "Once upon a time" -n "$steps" --threads 1 \
                --batch "$2") || return 1
        n=$(field positions <<<"$j")
        [ -n "$n" ] || n=$(field steps <<<"$j")
        awk -v n="$n" -v s="$(field seconds <<<"$j")" -v c="$(field cpu_seconds <<<"$j")" \
                'BEGIN { printf "%.2f %.2f\n", n / s, n / c }'
}

echo "batch: SmolLM2-135M-Instruct Q4_1, --local, -n $steps, 1 thread, B = 1 and 8, $rounds rounds; $(date -u '+%Y-%m-%d %H:%M:%S UTC'); load $(cut -d' ' -f1-3 /proc/loadavg)"
failed=0
for r in $(seq "$rounds"); do
        for i in "${!runs[@]}"; do
                for B in 1 8; do one "${runs[$i]}" "$B" >>"$tmp/$i.$B" || failed=1; done
        done
done

# COLUMN of stdin: "median, geomean [lo, hi]" (95% t interval over the logs)
stats() { awk -v c="$1" -v fmt=table -f bench/geomean.awk; }
each() { awk -v c="$1" '{ printf "%s%.2f", (NR > 1 ? " " : ""), $c }'; }

echo
echo "| kvc-run | B = 1 tokens per CPU-s (median) | B = 8 | B = 8 / B = 1 per CPU-second: median, geomean [95%] | each round | same, wall: median, geomean [95%] | this / the first row per CPU-second, B = 1 | B = 8 |"
echo "|---|---:|---:|---|---|---|---|---|"
for i in "${!runs[@]}"; do
        [ -s "$tmp/$i.1" ] && [ -s "$tmp/$i.8" ] || continue
        paste -d' ' "$tmp/$i.1" "$tmp/$i.8" | awk '{ printf "%.4f %.4f\n", $4 / $2, $3 / $1 }' >"$tmp/g.$i"
        med() { cut -d' ' -f2 "$1" | sort -g | awk '{ v[NR] = $1 } END { printf "%.1f", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
        vs() { paste -d' ' "$tmp/$i.$1" "$tmp/0.$1" | awk '{ print $2 / $4 }' | stats 1; }
        echo "| ${runs[$i]} | $(med "$tmp/$i.1") | $(med "$tmp/$i.8") | $(stats 1 <"$tmp/g.$i") | $(each 1 <"$tmp/g.$i") |" \
                "$(stats 2 <"$tmp/g.$i") | $(vs 1) | $(vs 8) |"
done
echo
echo "done $(date -u +%T); load $(cut -d' ' -f1-3 /proc/loadavg)"
exit "$failed"
