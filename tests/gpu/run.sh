#!/usr/bin/env bash
# tests/gpu/run.sh: the GPU check. Builds the CUDA kernels (`make cuda`) and runs kvc-gpucheck,
# which compares every CUDA kernel with its CPU reference on fresh random inputs and prints a
# table (kernel, shape, max relative error, time, GB/s, % of a device-to-device copy measured in
# the same run): the mixed layer's kernels, the summary, and the ladder's (attention over every
# tier, compaction and demotion; docs/kernels.md). Build and run together are bounded to 5 minutes. Without a GPU it builds, says
# that there is no device, and exits 0. Usage: tests/gpu/run.sh [BUILD]  (default build/)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
exec timeout --kill-after=10 300 bash -c '
        make --no-print-directory -j"$(nproc)" BUILD="$1" cuda >&2 || exit
        "$1"/bin/kvc-gpucheck
' run.sh "$build"
