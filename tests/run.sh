#!/usr/bin/env bash
# tests/run.sh BUILD TEST...: runs each test program from the project root, prints its output,
# and ends with one summary line: "N passed, M failed" (tests, not programs). A cmocka program
# counts its tests; a script (*.sh, given BUILD as its argument) counts as one test that passes
# when it exits 0. Exits non-zero when anything failed or a program crashed.
#
# A program's output is printed when it ends (some take minutes), so a line announces each one
# first, with its place in the run and the time so far (issue 30: a newcomer took the silence of
# `make test` for a hang). It goes to stderr, which nothing parses; the summary stays the last line.
set -u
build=$1
shift
export KVC_BUILD=$build
passed=0 failed=0 crashed=0
failures=() # what failed, named again at the end (the output above it is long)
i=0
for t in "$@"; do
        name=$(basename "$t")
        i=$((i + 1))
        printf '== %d/%d %s (%d:%02d so far)\n' "$i" "$#" "$name" $((SECONDS / 60)) $((SECONDS % 60)) >&2
        case "$t" in
        *.sh)
                out=$("$t" "$build" 2>&1)
                rc=$?
                printf '%s\n' "$out" | sed "s/^/[$name] /"
                if [ "$rc" -eq 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); failures+=("$name"); fi
                continue
                ;;
        esac
        out=$("$t" 2>&1)
        rc=$?
        printf '%s\n' "$out" | sed "s/^/[$name] /"
        # a program may run several groups, each with its own summary: all of them count
        p=$(printf '%s\n' "$out" | sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' | awk '{ s += $1 } END { if (NR) print s }')
        f=$(printf '%s\n' "$out" | sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' | awk '{ s += $1 } END { if (NR) print s }')
        passed=$((passed + ${p:-0}))
        failed=$((failed + ${f:-0}))
        while read -r t; do
                [ -n "$t" ] && failures+=("$name: $t")
        done < <(printf '%s\n' "$out" | sed -n 's/^\[  FAILED  \] \([a-z_0-9]*\)$/\1/p')
        if [ "$rc" -ne 0 ] && [ -z "$f" ]; then
                echo "[$name] exited with status $rc before reporting"
                crashed=$((crashed + 1))
                failures+=("$name: exited with status $rc before reporting")
        fi
done
echo
printf '== %d programs in %d:%02d\n' "$#" $((SECONDS / 60)) $((SECONDS % 60)) >&2
for f in "${failures[@]}"; do echo "FAILED: $f"; done
echo "$passed passed, $((failed + crashed)) failed"
[ $((failed + crashed)) -eq 0 ]
