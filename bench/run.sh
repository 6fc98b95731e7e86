#!/usr/bin/env bash
# bench/run.sh [BUILD]: every benchmark of issue 7, one table per item, each with its ratio
# against a baseline measured in the same run (the machines are shared and noisy: no absolute
# time is judged). `make bench` builds the programs and runs this; about 2 minutes on 2 cores,
# bounded to 10. bench/RESULTS.md has the results and how they were read.
#
#   1. bench-rt         summary-to-plan round trip and throughput vs a bare ZeroMQ round trip
#   2. bench-select     selection (radix) vs qsort vs torch.topk (python3-torch; installed with
#                       apt-get when missing and this runs as root; else "skipped: no torch")
#   3. bench-compact    compaction vs memcpy of the same bytes
#   4. bench-footprint  kvcd's RSS: idle, per session, steady state
#   5. kvc-run          tokens/s through kvcd vs kvc-run --local, interleaved runs (below); and
#      bench-attn       why: libkvc's attention kernel vs kvc-run --local's
#   6. the GPU checks   tests/gpu/run.sh and tests/gpu/ipc.sh when a GPU is visible
#   and bench-relocate  a chunk taken back from a client (issue 3): block moves vs a round trip
#                       and memcpy
#   and bench/decode.sh SmolLM2's decode per CPU-second at 1 thread against llama.cpp (issue 29;
#                       the peer's column only where `make peers` built it, skipped without the model)
#
# Programs that serve (kvcd, the echo server) run on one CPU and clients on another when there
# are two. E2E_REPS sets the kvc-run repetitions (default 9).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${KVC_BENCH_BOUNDED:-}" ]; then
        KVC_BENCH_BOUNDED=1 exec timeout --kill-after=10 600 "$0" "$@"
fi
build=${1:-build}
bin=$build/bin
bb=$build/bench
reps=${E2E_REPS:-9}
failed=0

for p in "$bin/kvcd" "$bin/kvc-run" "$bb/bench-rt" "$bb/bench-select" "$bb/bench-compact" "$bb/bench-footprint" \
        "$bb/bench-attn" "$bb/bench-relocate"; do
        [ -x "$p" ] || { echo "bench/run.sh: $p is missing: make bench-programs BUILD=$build" >&2; exit 2; }
done

cpus=($(taskset -pc $$ 2>/dev/null | sed 's/.*: //' | tr ',' '\n' | while IFS=- read a b; do seq "$a" "${b:-$a}"; done))
if [ "${#cpus[@]}" -ge 2 ]; then
        client_cpu=${cpus[0]} server_cpu=${cpus[1]}
        pin_client=(taskset -c "$client_cpu") pin_server=(taskset -c "$server_cpu")
else
        client_cpu=- server_cpu=- pin_client=() pin_server=()
fi

echo "# kvcd benchmarks"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' (+ local changes)')"
echo "machine: nproc $(nproc), $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "cpus: clients on $client_cpu, servers (kvcd, the echo server) on $server_cpu"
echo

section() {
        echo
        echo "---- $1 ($(date -u +%T))"
}

run() {
        "$@" || { echo "bench/run.sh: FAILED: $*" >&2; failed=1; }
}

# ---- 1 ----
section "item 1: round trip and throughput"
run "$bb/bench-rt" --kvcd "$bin/kvcd" --blocks 10

# ---- 2 ----
section "item 2: plan building"
py=/usr/bin/python3
[ -x "$py" ] || py=$(command -v python3 || echo python3)
if ! "$py" -c 'import torch' >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
                echo "python3-torch is missing: installing it with apt-get (log in \$TMPDIR/kvc-bench-apt.log)"
                log=${TMPDIR:-/tmp}/kvc-bench-apt.log
                { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-torch ||
                        { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
                          DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-torch; }
                } >"$log" 2>&1 || echo "apt-get could not install python3-torch: the torch column is skipped"
                py=/usr/bin/python3
        else
                echo "python3-torch is missing and this is not root: the torch column is skipped"
        fi
fi
run "${pin_client[@]}" "$bb/bench-select" --python "$py" --torch-script bench/topk.py

# ---- 3 ----
section "item 3: plan application"
run "${pin_client[@]}" "$bb/bench-compact"

# ---- 4 ----
section "item 4: footprint"
run "$bb/bench-footprint" --kvcd "$bin/kvcd"

# ---- 5 ----
section "item 5: end to end with kvc-run"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvc-bench-e2e-XXXXXX")
kvcd_pid=
cleanup() {
        if [ -n "$kvcd_pid" ]; then
                kill "$kvcd_pid" 2>/dev/null
                wait "$kvcd_pid" 2>/dev/null
        fi
        rm -rf "$tmp"
}
trap cleanup EXIT
"${pin_server[@]}" "$bin/kvcd" --runtime-dir "$tmp/run" --log-level warning 2>"$tmp/kvcd.log" &
kvcd_pid=$!
for _ in $(seq 200); do
        [ -S "$tmp/run/kvcd.sock" ] && [ -S "$tmp/run/kvcd.fd.sock" ] && break
        kill -0 "$kvcd_pid" 2>/dev/null || break
        sleep 0.05
done
if ! [ -S "$tmp/run/kvcd.fd.sock" ]; then
        echo "bench/run.sh: kvcd did not come up:" >&2
        cat "$tmp/kvcd.log" >&2
        exit 1
fi
# configurations: name|kvc-run flags (the baseline, --local, is run once per repetition)
configs=(
        "full, plan-lag 0 (same work as --local)|--policy full"
        "full, plan-lag 1|--policy full --plan-lag 1"
        "window 64, plan-lag 0|--policy window --budget 64"
        "h2o 64, plan-lag 0|--policy h2o --budget 64"
)
steps=512
tps() { sed -n 's/.*"tokens_per_second":\([0-9.]*\).*/\1/p'; }
for r in $(seq "$reps"); do
        "${pin_client[@]}" "$bin/kvc-run" --local --json -n "$steps" --no-stop | tps >>"$tmp/local" || failed=1
        for i in "${!configs[@]}"; do
                flags=${configs[$i]#*|}
                "${pin_client[@]}" "$bin/kvc-run" --socket "$tmp/run" --json -n "$steps" --no-stop $flags | tps >>"$tmp/c$i" ||
                        failed=1
        done
done
median() { sort -g "$1" | awk '{v[NR] = $1} END {print NR ? v[int((NR + 1) / 2)] : "nan"}'; }
best() { sort -g "$1" | tail -1; }
base=$(median "$tmp/local")
echo "5. kvc-run, stories260K, $steps tokens from BOS, greedy; $reps interleaved runs each, median (best) tokens/s"
echo "| cache | tokens/s | best | us/token | / --local | overhead |"
echo "|---|---:|---:|---:|---:|---:|"
awk -v m="$base" -v x="$(best "$tmp/local")" \
        'BEGIN { printf "| --local: plain in-process cache, no kvcd (baseline) | %s | %s | %.0f | 1.000 | |\n", m, x, 1e6 / m }'
for i in "${!configs[@]}"; do
        m=$(median "$tmp/c$i")
        awk -v n="${configs[$i]%%|*}" -v m="$m" -v b="$base" -v x="$(best "$tmp/c$i")" \
                'BEGIN { printf "| kvcd, %s | %s | %s | %.0f | %.3f | %.1f%% |\n", n, m, x, 1e6 / m, m / b, (b / m - 1) * 100 }'
done
awk -v m="$(median "$tmp/c0")" -v b="$base" 'BEGIN {
        o = (b / m - 1) * 100
        printf "target: overhead at most 10%% (full, plan-lag 0, against --local): %s (%.1f%%)\n",
                o <= 10 ? "HOLDS" : "DOES NOT HOLD", o }'
cleanup
kvcd_pid=
trap - EXIT
echo
run "${pin_client[@]}" "$bb/bench-attn"

# ---- issue 29 ----
section "issue 29: SmolLM2 decode per CPU-second against llama.cpp"
run "${pin_client[@]}" bench/decode.sh "$build"

# ---- issue 3 ----
section "issue 3: a chunk taken back from a client that still has blocks in it"
run "$bb/bench-relocate" --kvcd "$bin/kvcd"

# ---- 6 ----
section "item 6: GPU"
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        run tests/gpu/run.sh "$build"
        run tests/gpu/ipc.sh "$build"
else
        echo "skipped: no GPU here. Where one is lent: tests/gpu/run.sh (the kernels table against a"
        echo "device-to-device copy) and tests/gpu/ipc.sh (the cuda backend round trip)."
fi

echo
echo "done ($(date -u +%T))$([ "$failed" = 0 ] || echo ': some benchmarks FAILED, see above')"
exit "$failed"
