#!/usr/bin/env bash
# bench/peak.sh BUILD: what a session's charge peaks at, as kvcd accounts it (SessionStats.peak_bytes),
# against the full cache's, on SmolLM2 with a long prompt (issue 26: "a demotion is applied block
# by block or in bounded steps so that a session's peak charged bytes never exceed its steady bytes
# by more than one block per tier per layer"; conf+INT8's peak was 41% of the full cache while its
# average was 29%, its INT8 blocks granted before the full-precision ones were freed).
#
# The prompt is the first CHARS (default 16000, about 4,000 tokens) characters of
# ../shared/data/tinystories/validation-sample.txt, prefilled in chunks of 256 (kvc-run's default),
# then DECODE (default 16) tokens, greedy, 1 thread, through a kvcd of its own (f16 keys and values).
# Configurations: full; conf at BUDGET (default 1024); conf at BUDGET with int8=1; full with every
# token but the newest 128 at 4 bits (--tier q4) and at 2 bits (--tier q2). With BEFORE=DIR (a build
# of an older tree: DIR/bin/kvcd and DIR/bin/kvc-run) each configuration runs there too, in the same
# run, so the table has the peaks before and after side by side. Prints a markdown table: the peak
# bytes and their fraction of the full cache's peak (each build's own full run).
set -euo pipefail

build=${1:-build}
model=${KVC_SMOLLM2:-$HOME/.cache/kvcd/models/SmolLM2-135M-Instruct.Q4_1.gguf}
chars=${CHARS:-16000}
decode=${DECODE:-16}
budget=${BUDGET:-1024}
text=../shared/data/tinystories/validation-sample.txt
die() {
        echo "bench/peak.sh: $*" >&2
        exit 2
}
[ -f "$model" ] || die "no model at $model: make model"
[ -f "$text" ] || die "no $text"
builds=("$build")
[ -n "${BEFORE:-}" ] && builds=("$BEFORE" "$build")
for b in "${builds[@]}"; do
        for p in "$b/bin/kvc-run" "$b/bin/kvcd"; do [ -x "$p" ] || die "$p is missing"; done
done
prompt=$(head -c "$chars" "$text" | tr '\n' ' ')
n_prompt=$("$build/bin/kvc-run" --model "$model" --local -i "$prompt" -n 1 --json 2>/dev/null |
        sed -n 's/.*"prompt_tokens":\([0-9]*\).*/\1/p' | head -1)
[ -n "$n_prompt" ] || die "cannot count the prompt's tokens"

declare -A cfg_args=(
        [full]="--policy full"
        [conf]="--policy conf --budget $budget"
        [conf-int8]="--policy conf --budget $budget --param int8=1"
        [full-q4]="--policy full --tier q4 --tier-window 128"
        [full-q2]="--policy full --tier q2 --tier-window 128"
)
order=(full conf conf-int8 full-q4 full-q2)

tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
declare -A peak
for b in "${builds[@]}"; do
        dir=$tmp/run-$(echo "$b" | tr '/' '_')
        mkdir -p "$dir"
        "$b/bin/kvcd" --runtime-dir "$dir" --capacity 1G >"$dir/kvcd.log" 2>&1 &
        for _ in $(seq 100); do [ -S "$dir/kvcd.sock" ] && break; sleep 0.1; done
        [ -S "$dir/kvcd.sock" ] || die "kvcd of $b did not start ($dir/kvcd.log)"
        for cfg in "${order[@]}"; do
                read -ra args <<<"${cfg_args[$cfg]}"
                if ! out=$("$b/bin/kvc-run" --model "$model" --socket "$dir" --threads 1 --dtype f16 \
                        -i "$prompt" -n $((n_prompt + decode)) --no-stop --json "${args[@]}" 2>"$dir/$cfg.err" |
                        tail -1); then
                        echo "$b $cfg: failed ($(tail -1 "$dir/$cfg.err"))" >&2
                        peak[$b.$cfg]=failed
                        continue
                fi
                peak[$b.$cfg]=$(sed -n 's/.*"peak_bytes":\([0-9]*\).*/\1/p' <<<"$out" | head -1)
                echo "$b $cfg: prompt $(sed -n 's/.*"prompt_tokens":\([0-9]*\).*/\1/p' <<<"$out") tokens, peak ${peak[$b.$cfg]} bytes" >&2
        done
        kill %% 2>/dev/null || true
        wait 2>/dev/null || true
done

echo "# Peak charged bytes against the full cache's (bench/peak.sh)"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit: $(git rev-parse --short HEAD 2>/dev/null || echo -); load $(cut -d' ' -f1-3 /proc/loadavg)"
echo
printf '| configuration |'
for b in "${builds[@]}"; do printf ' %s peak | of full |' "$b"; done
echo
printf '|---|'
for _ in "${builds[@]}"; do printf -- '---|---|'; done
echo
for cfg in "${order[@]}"; do
        printf '| %s |' "$cfg"
        for b in "${builds[@]}"; do
                p=${peak[$b.$cfg]:-failed} f=${peak[$b.full]:-failed}
                if [[ $p =~ ^[0-9]+$ && $f =~ ^[0-9]+$ ]]; then
                        printf ' %s | %s |' "$p" "$(awk -v p="$p" -v f="$f" 'BEGIN { printf "%.1f%%", 100 * p / f }')"
                else
                        printf ' %s | - |' "$p"
                fi
        done
        echo
done
