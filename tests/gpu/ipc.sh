#!/usr/bin/env bash
# tests/gpu/ipc.sh [--fake] [BUILD]: the GPU pool check (docs/gpu.md), bounded to 5 minutes.
#
# Builds kvcd and kvc-ipc-client (`make all cuda`), starts kvcd --backend cuda in a temporary
# runtime directory, and runs client processes that map its GPU pool through libkvc:
#   1. a victim fills a session with marker KV and reports the chunks it holds;
#   2. a survivor writes KV token by token with cudaMemcpy, reads it back, and applies kvcd's
#      window plans with the CUDA compaction kernel (kvc_cuda_compact_mixed), checking every
#      token after every plan; it prints its timings (connect, first chunk map, grant, plan
#      round trip);
#   3. the victim is killed with SIGKILL; kvcd must count the death, scrub its chunks and pass its
#      audit, and a checker client must be granted one of the victim's chunks and read it back as
#      zeros;
#   4. the survivor, untouched, carries on (more tokens, more plans) and closes;
#   5. a mover holds blocks in two chunks; the capacity is lowered to one chunk, and kvcd must
#      move its blocks together (plans of block moves: libkvc copies them with cuMemcpyDtoD) and
#      take the emptied chunk back, every byte of the blocks intact.
# It prints the device, the driver version and the allocation granularity (kvcd's log), and the
# timings. Without a usable GPU (no driver, a stub driver, no device: kvcd exits 69) it says so
# and exits 0.
#
# --fake runs the same flow on a CPU: kvcd and libkvc load tests/gpu/fakecuda.c as libcuda.so.1
# (host memory behind the driver API) and the client's kernels are the emulated ones
# (`make cuda-emu`). It checks the protocol, the bookkeeping and the scrub, not a GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${KVC_IPC_BOUNDED:-}" ]; then
        KVC_IPC_BOUNDED=1 exec timeout --kill-after=10 300 "$0" "$@"
fi
fake=0
if [ "${1:-}" = --fake ]; then
        fake=1
        shift
fi
build=${1:-build}
chunk=$((2 << 20))

if [ $fake = 1 ]; then
        make --no-print-directory -j"$(nproc)" BUILD="$build" all cuda-emu >&2
        client=$build/emu/kvc-ipc-client-emu
        export LD_LIBRARY_PATH=$PWD/$build/fakecuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        label="fake driver (tests/gpu/fakecuda.c), emulated kernels"
else
        make --no-print-directory -j"$(nproc)" BUILD="$build" all cuda >&2
        client=$build/bin/kvc-ipc-client
        label="CUDA driver, CUDA kernels"
        if [ ! -x "$client" ]; then
                echo "ipc.sh: no nvcc here (CUDA=0): kvc-ipc-client is not built; nothing to check"
                exit 0
        fi
fi
bin=$build/bin
dir=$(mktemp -d "${TMPDIR:-/tmp}/kvcd-ipc-XXXXXX")
pid= vpid= spid=
cleanup() {
        for p in $vpid $spid; do kill -KILL "$p" 2>/dev/null || true; done
        if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
        rm -rf "$dir"
}
trap cleanup EXIT
fail() {
        echo "ipc.sh: FAIL: $*"
        for f in "$dir"/*.err "$dir"/kvcd.log; do
                [ -s "$f" ] && sed "s|^|  $(basename "$f"): |" "$f"
        done
        exit 1
}
ms() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }

# kvcd with the cuda backend; exit 69 means no usable GPU here
t0=$(date +%s%N)
"$bin/kvcd" --backend cuda --runtime-dir "$dir/run" --capacity 64M --chunk-bytes $chunk --log-level info \
        2>"$dir/kvcd.log" &
pid=$!
up=0
for _ in $(seq 100); do
        if ! kill -0 "$pid" 2>/dev/null; then break; fi
        if "$bin/kvcctl" --socket "$dir/run" --timeout 200 status >/dev/null 2>&1; then up=1; break; fi
done
if [ $up = 0 ]; then
        rc=0
        wait "$pid" || rc=$?
        pid=
        if [ $rc = 69 ]; then
                echo "ipc.sh: no GPU available ($label): kvcd --backend cuda says:"
                sed 's/^<[0-9]>/  /' "$dir/kvcd.log"
                echo "ipc.sh: nothing checked; the check is built and ready for a machine with a GPU"
                exit 0
        fi
        fail "kvcd did not start (exit $rc)"
fi
echo "== $label; kvcd up in $(ms "$t0") ms"
grep 'cuda backend:' "$dir/kvcd.log" | sed 's/^<[0-9]>/   kvcd: /'

mkfifo "$dir/v.in" "$dir/v.out" "$dir/s.in" "$dir/s.out"
"$client" --socket "$dir/run" --role victim --chunk-bytes $chunk <"$dir/v.in" >"$dir/v.out" 2>"$dir/victim.err" &
vpid=$!
exec 3>"$dir/v.in" 4<"$dir/v.out"
read -r -t 120 line <&4 || fail "the victim did not get ready"
case "$line" in READY\ chunks=*) ;; *) fail "the victim said: $line" ;; esac
chunks=${line#READY chunks=}
echo "== victim (pid $vpid) holds chunks $chunks, every byte of its blocks written"

"$client" --socket "$dir/run" --role survivor --chunk-bytes $chunk <"$dir/s.in" >"$dir/s.out" 2>"$dir/survivor.err" &
spid=$!
exec 5>"$dir/s.in" 6<"$dir/s.out"
while read -r -t 240 line <&6; do
        [ "$line" = "PHASE1 ok" ] && break
        echo "   $line"
done
[ "$line" = "PHASE1 ok" ] || fail "the survivor did not finish its first phase"
"$bin/kvcctl" --socket "$dir/run" status | sed 's/^/   kvcctl: /'

echo "== SIGKILL to the victim"
kill -KILL "$vpid"
wait "$vpid" 2>/dev/null || true
vpid=
exec 3>&- 4<&-
st=$("$bin/kvcctl" --socket "$dir/run" status)
echo "$st" | sed 's/^/   kvcctl: /'
echo "$st" | grep -q 'client deaths 1' || fail "kvcd did not count the victim's death"
"$bin/kvcctl" --socket "$dir/run" audit >/dev/null || fail "kvcctl audit found a mismatch after the death"
grep 'chunks scrubbed' "$dir/kvcd.log" | sed 's/^<[0-9]>/   kvcd: /'

out=$("$client" --socket "$dir/run" --role checker --chunks "$chunks" --chunk-bytes $chunk 2>"$dir/checker.err") ||
        fail "the checker: $out"
echo "   $out"

echo go >&5
while read -r -t 240 line <&6; do
        echo "   $line"
        [ "$line" = "DONE ok" ] && break
done
[ "$line" = "DONE ok" ] || fail "the survivor did not finish"
wait "$spid" || fail "the survivor exited with $?"
spid=
exec 5>&- 6<&-

echo "== a mover with blocks in two chunks; the capacity lowered to one chunk"
mkfifo "$dir/m.in" "$dir/m.out"
"$client" --socket "$dir/run" --role mover --chunk-bytes $chunk <"$dir/m.in" >"$dir/m.out" 2>"$dir/mover.err" &
spid=$!
exec 5>"$dir/m.in" 6<"$dir/m.out"
read -r -t 120 line <&6 || fail "the mover did not get ready"
case "$line" in READY\ blocks=*) ;; *) fail "the mover said: $line" ;; esac
echo "   mover: $line"
"$bin/kvcctl" --socket "$dir/run" budget set --capacity $chunk >/dev/null || fail "kvcctl budget set --capacity"
t0=$(date +%s%N)
owned=
for _ in $(seq 100); do
        echo x >&5
        read -r -t 60 line <&6 || fail "the mover did not answer"
        owned=$("$bin/kvcctl" --socket "$dir/run" --json status | sed -n 's/.*"chunks_in_use":\([0-9]*\).*/\1/p')
        [ "$line" = "EXCHANGED in=1" ] && [ "$owned" = 1 ] && break
done
[ "$owned" = 1 ] || fail "kvcd did not take the mover's second chunk back ($line, $owned chunks owned)"
echo "   blocks gathered into one chunk and the other given back in $(ms "$t0") ms"
exec 5>&-
read -r -t 120 line <&6 || fail "the mover did not check its blocks"
echo "   mover: $line"
case "$line" in MOVED\ *) ;; *) fail "the mover said: $line" ;; esac
wait "$spid" || fail "the mover exited with $?"
spid=
exec 6<&-
grep 'draining chunk' "$dir/kvcd.log" | sed 's/^<[0-9]>/   kvcd: /'
"$bin/kvcctl" --socket "$dir/run" audit >/dev/null || fail "kvcctl audit found a mismatch at the end"
kill -TERM "$pid"
wait "$pid" || fail "kvcd exited with $?"
pid=
echo "ipc.sh: ok ($label)"
