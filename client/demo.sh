#!/usr/bin/env bash
# client/demo.sh BUILD: the main job, end to end on the host backend. Starts kvcd in a temporary
# runtime directory, runs the reference model (stories260K) through it with the window policy,
# shows the story, how the cache size moved, and kvcd's status, then stops kvcd with SIGTERM.
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

"$bin/kvcd" --runtime-dir "$dir/run" --capacity 64M --log-level info 2>"$dir/kvcd.log" &
pid=$!
# kvcctl's connection waits for the socket to appear: this returns once kvcd answers
"$bin/kvcctl" --socket "$dir/run" --timeout 10000 status >/dev/null

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
"$bin/kvcctl" --socket "$dir/run" status
kill -TERM "$pid"
wait "$pid"
pid=
echo
echo "== kvcd's log"
sed 's/^<[0-9]>/  /' "$dir/kvcd.log"
