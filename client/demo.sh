#!/usr/bin/env bash
# client/demo.sh BUILD: the main job, end to end on the host backend. Starts kvcd in a temporary
# runtime directory; two kvc-run processes chat with SmolLM2 ($KVC_SMOLLM2) through it under the
# same system prompt (the second attaches the first's published prompt blocks), one with the full
# cache, one with CONF-KV under a budget, with kvcctl status and sessions while they run; a needle in
# a haystack through the window and through the ladder (issue 27) at the same bytes, kvcctl top
# showing the ladder's bits per value; then the tiny stories260K with the window and conf policies, how the cache size moved, and kvcd's status;
# then stops kvcd with SIGTERM.
set -euo pipefail
build=${1:-build}
bin=$build/bin
dir=$(mktemp -d "${TMPDIR:-/tmp}/kvcd-demo-XXXXXX")
pid=
cleanup() {
        if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
        rm -rf "$dir"
}
trap cleanup EXIT

model=${KVC_SMOLLM2:?the SmolLM2 GGUF (make demo runs make model and sets KVC_SMOLLM2)}
ctl() { "$bin/kvcctl" --socket "$dir/run" "$@"; }
# waits (at most 60 s) until `kvcctl --json VERB` shows FIELD at VALUE or more
wait_for() {
        local verb=$1 field=$2 value=$3
        for _ in $(seq 600); do
                ctl --json "$verb" | grep -o "\"$field\":[0-9]*" | awk -F: -v v="$value" '$2 >= v { ok = 1 } END { exit !ok }' &&
                        return 0
                sleep 0.1
        done
        echo "demo: kvcd never showed $field >= $value" >&2
        return 1
}

"$bin/kvcd" --runtime-dir "$dir/run" --capacity 512M --log-level info 2>"$dir/kvcd.log" &
pid=$!
# kvcctl says at once (exit 3) that nothing listens until kvcd has bound its socket: ask again
# until it answers (at most 10 s)
for _ in $(seq 100); do
        ctl status >/dev/null 2>&1 && break
        sleep 0.1
done
ctl status >/dev/null

echo "== SmolLM2-135M-Instruct (GGUF, Q4_1) through kvcd: two chats under the same system prompt"
echo
echo "   A: full cache, exact products: \"What is the capital of France?\""
"$bin/kvc-run" --socket "$dir/run" --model "$model" --threads 1 --share --exact \
        --chat "What is the capital of France?" -n 80 >"$dir/a.txt" 2>"$dir/a.err" &
a=$!
wait_for status shared_blocks 1 # A published its prompt's blocks: B attaches them, nothing recomputed
echo "   B: policy conf (CONF-KV), budget 64 tokens per layer: \"Write a short poem about the sea.\""
"$bin/kvc-run" --socket "$dir/run" --model "$model" --threads 1 --share --policy conf --budget 64 \
        --chat "Write a short poem about the sea." -n 160 --trace 40 >"$dir/b.txt" 2>"$dir/b.err" &
b=$!
wait_for status sessions 2 # both are running now
echo
echo "== kvcctl status and sessions while they run (the shared prompt blocks are held once)"
ctl status | sed 's/^/  /'
ctl sessions | sed 's/^/  /'
wait "$a" || { cat "$dir/a.err" >&2; exit 1; }
wait "$b" || { cat "$dir/b.err" >&2; exit 1; }
echo
echo "== A answered:"
fold -s -w 100 "$dir/a.txt" | sed 's/^/  /'
echo "== B answered (the cache size per layer every 40 steps, and what kvcd charged, below):"
fold -s -w 100 "$dir/b.txt" | sed 's/^/  /'
sed 's/^/  /' "$dir/b.err"
echo

# the precision ladder (issue 27): one haystack of TinyStories with a needle, the same prompt at
# the same bytes through the window and through the ladder
frac=${KVC_DEMO_LADDER_FRAC:-0.25}
data=${KVC_DEMO_DATA:-../shared/data/tinystories/validation-sample.txt}
awk 'BEGIN { RS = ""; ORS = "\n\n" } NR > 400 { print; n += length($0) + 2; if (n >= 5400) exit }' "$data" \
        >"$dir/hay.txt"
{
        printf 'Read the text below. Somewhere in it is a secret code.\n\n'
        # the needle after the first sentence that ends past character 2,500
        awk -v at=2500 'BEGIN { RS = "^$" } { i = at + index(substr($0, at), ". ");
                printf "%s%s%s", substr($0, 1, i), "The secret code of the blue door is 4721. ", substr($0, i + 1) }' \
                "$dir/hay.txt"
        printf '\n\nQuestion: what is the secret code of the blue door? Answer with the number only.'
} >"$dir/needle.txt"
needle() { # POLICY-ARGS...: the answer, and kvcd's accounting line
        "$bin/kvc-run" --socket "$dir/run" --model "$model" --threads 2 --dtype f16 --prefill-chunk 32 \
                --chat "$(cat "$dir/needle.txt")" -n 1430 --trace 100000 "$@" 2>"$dir/needle.err"
}
echo "== The precision ladder: a needle (\"The secret code of the blue door is 4721.\") in ~1,400 tokens"
echo "   of stories, prefilled in chunks of 32 (the policy plans before it sees the question), at"
echo "   $frac of the full FP16 cache's bytes (-n: the prompt and the answer's room; the peaks below):"
echo
answer() { grep -v '^ *$' | tail -1; } # the answer's last line
printf '   %-44s %s\n' "full cache (reference):" "$(needle | answer)"
grep '^kvcd accounting' "$dir/needle.err" | sed 's/^/     /'
printf '   %-44s %s\n' "window at $frac of the bytes:" "$(needle --policy window --budget-frac "$frac" | answer)"
grep '^kvcd accounting' "$dir/needle.err" | sed 's/^/     /'
"$bin/kvc-run" --socket "$dir/run" --model "$model" --threads 2 --dtype f16 --prefill-chunk 32 \
        --chat "$(cat "$dir/needle.txt")" -n 1430 --trace 100000 --policy ladder --tiers q8,q4,q2 \
        --importance recon --budget-frac "$frac" --stop-at 1380 >"$dir/ladder.txt" 2>"$dir/ladder.err" &
l=$!
for _ in $(seq 600); do [ "$(ps -o stat= -p "$l" 2>/dev/null | cut -c1)" = T ] && break; sleep 0.1; done
echo
echo "   kvcctl top while the ladder holds the prompt (BITS: the bits per value it holds):"
ctl top -n 1 | sed 's/^/     /'
kill -CONT "$l"
wait "$l" || { cat "$dir/ladder.err" >&2; exit 1; }
printf '   %-44s %s\n' "ladder (q8, q4, q2 by reconstruction) at $frac:" "$(answer <"$dir/ladder.txt")"
grep '^kvcd accounting' "$dir/ladder.err" | sed 's/^/     /'
echo "   (one haystack: ranked by surprisal instead, the ladder answers 421 here, a digit lost; on"
echo "   the lab's needles at 2K surprisal kept 4 of 4 and reconstruction 1 of 4 at a fifth of the"
echo "   bytes: docs/quality.md, \"The ladder at a byte budget\")"
echo

budget=64
echo "== kvc-run: stories260K, greedy, 512 positions, policy window (budget $budget tokens per layer)"
echo
"$bin/kvc-run" --socket "$dir/run" --policy window --budget $budget -n 512 --no-stop --trace 1 \
        >"$dir/story.txt" 2>"$dir/trace.txt"
fold -s -w 100 "$dir/story.txt"
echo
echo "== cache size per step: tokens per layer the client held, least..most over each 32 steps"
echo "   (the window fills to 64, grows by one block, and a plan cuts it back to 64)"
awk '/^step/ { s = $2; n = $4; row = int((s - 1) / 32);
               if (!(row in lo) || n < lo[row]) lo[row] = n; if (n > hi[row]) hi[row] = n; last = row }
     END { for (r = 0; r <= last; r++) {
               bar = ""; for (i = 0; i < hi[r] / 2; i++) bar = bar (i < lo[r] / 2 ? "#" : "+");
               printf "  steps %3d-%3d  %3d..%3d  %s\n", r * 32 + 1, r * 32 + 32, lo[r], hi[r], bar } }' "$dir/trace.txt"
grep '^kvcd accounting' "$dir/trace.txt" | sed 's/^/  /'
echo
echo "== a sampled story with policy conf (CONF-KV, gate=defer, budget 48): on uncertain steps the"
echo "   cache may grow (up to 144 tokens); confident steps cut it back to 48. Mean confidence and the"
echo "   least..most tokens per layer over each 8 steps:"
"$bin/kvc-run" --socket "$dir/run" --policy conf --budget 48 --param gate=defer --param n_low=144 \
        -t 1.0 -s 3 -n 200 --no-stop --trace 1 >/dev/null 2>"$dir/conf.txt"
awk '/^step/ { s = $2; n = $4; c = $7; row = int((s - 1) / 8); sum[row] += c; cnt[row]++;
               if (!(row in lo) || n < lo[row]) lo[row] = n; if (n > hi[row]) hi[row] = n; last = row }
     END { for (r = 0; r <= last; r++) {
               conf = sum[r] / cnt[r]; bar = ""; for (i = 0; i < hi[r] / 3; i++) bar = bar (i < lo[r] / 3 ? "#" : "+");
               printf "  steps %3d-%3d  confidence %.2f  cache %3d..%3d  %s\n", r * 8 + 1, r * 8 + 8, conf, lo[r], hi[r], bar } }' \
        "$dir/conf.txt"
echo
echo "== kvcctl status"
ctl status
kill -TERM "$pid"
wait "$pid"
pid=
echo
echo "== kvcd's log"
sed 's/^<[0-9]>/  /' "$dir/kvcd.log"
