#!/usr/bin/env bash
# tests/fuzz/replay.sh [BUILD]: replays every checked-in fuzz corpus (tests/fuzz/corpus/TARGET)
# through BUILD/fuzz/replay-TARGET, built by `make tests` (tests/fuzz/fuzz.mk). Builds nothing.
# One test for tests/run.sh: exits non-zero when a binary is missing, a corpus is empty, or an
# input crashes a target; a failing target is rerun verbosely so the last line names the input.
set -u
cd "$(dirname "$0")/../.."
build=${1:-build}
rc=0
for t in wire plan model tokenizer gguf bpe; do
        bin=$build/fuzz/replay-$t
        if [ ! -x "$bin" ]; then
                echo "$bin is missing: make tests first"
                rc=1
                continue
        fi
        if out=$("$bin" "tests/fuzz/corpus/$t" 2>&1); then
                echo "$t: $out"
        else
                echo "$t: FAILED"
                REPLAY_VERBOSE=1 "$bin" "tests/fuzz/corpus/$t" 2>&1 | tail -n 30
                rc=1
        fi
done
exit $rc
