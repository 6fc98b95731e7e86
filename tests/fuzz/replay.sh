#!/usr/bin/env bash
# tests/fuzz/replay.sh [BUILD]: replays every checked-in fuzz corpus (tests/fuzz/corpus/TARGET)
# through BUILD/fuzz/replay-TARGET and through the libFuzzer target BUILD/fuzz/fuzz-TARGET (once
# each input, -runs=0), both built by `make tests` (tests/fuzz/fuzz.mk). Builds nothing.
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
        # the libFuzzer target itself (clang, ASan/UBSan), built by `make tests`: each input once
        fz=$build/fuzz/fuzz-$t
        if [ ! -x "$fz" ]; then
                echo "$fz is missing: make tests first"
                rc=1
        elif ! out=$("$fz" -runs=0 "tests/fuzz/corpus/$t" 2>&1); then
                echo "$t (libFuzzer): FAILED"
                printf '%s\n' "$out" | tail -n 30
                rc=1
        fi
done
exit $rc
