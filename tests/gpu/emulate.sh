#!/usr/bin/env bash
# tests/gpu/emulate.sh: the CUDA kernels without a GPU. Builds the kernel sources for the CPU
# against tests/gpu/emu (`make cuda-emu`: a host thread per CUDA thread, no CUDA toolkit needed)
# and runs kvc-gpucheck's matrix of small cases against the CPU references. Slow (threads stand in
# for lanes) and blind to timing and to the GPU memory model; tests/gpu/run.sh on a GPU is the real
# check. Usage: tests/gpu/emulate.sh [BUILD]  (default build/)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
make --no-print-directory -j"$(nproc)" BUILD="$build" cuda-emu >&2
exec timeout --kill-after=10 1200 "$build"/emu/kvc-gpucheck-emu --quick
