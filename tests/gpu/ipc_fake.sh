#!/usr/bin/env bash
# tests/gpu/ipc_fake.sh [BUILD]: tests/gpu/ipc.sh --fake, for `make test` (the GPU pool check on a CPU:
# the fake driver and the emulated kernels).
exec "$(dirname "$0")/ipc.sh" --fake "$@"
