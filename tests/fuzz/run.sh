#!/usr/bin/env bash
# tests/fuzz/run.sh BUILD SECONDS TARGET...: `make fuzz`. Runs each libFuzzer binary
# BUILD/fuzz/fuzz-TARGET for SECONDS on the checked-in corpus tests/fuzz/corpus/TARGET, writing new
# inputs to the scratch corpus BUILD/fuzz/corpus/TARGET and crashes to BUILD/fuzz/artifacts/, and
# prints one line per target: executions, time, coverage (cov = edges, ft = features), corpus
# size, crashes. The full log is BUILD/fuzz/TARGET.log. Exits non-zero when any target crashed.
set -u
cd "$(dirname "$0")/../.."
build=$1 secs=$2
shift 2
rc=0
mkdir -p "$build/fuzz/artifacts"
for t in "$@"; do
        case $t in
        model) max_len=32768 ;;
        *) max_len=16384 ;;
        esac
        bin=$build/fuzz/fuzz-$t log=$build/fuzz/$t.log
        mkdir -p "$build/fuzz/corpus/$t"
        start=$(date +%s)
        "$bin" -max_total_time="$secs" -max_len="$max_len" -timeout=10 -rss_limit_mb=2048 \
                -print_final_stats=1 -artifact_prefix="$build/fuzz/artifacts/$t-" \
                "$build/fuzz/corpus/$t" "tests/fuzz/corpus/$t" >"$log" 2>&1
        status=$?
        took=$(($(date +%s) - start))
        execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
        last=$(grep -E '^#[0-9]+' "$log" | tail -1)
        cov=$(printf '%s\n' "$last" | sed -n 's/.*cov: \([0-9]*\).*/\1/p')
        ft=$(printf '%s\n' "$last" | sed -n 's/.*ft: \([0-9]*\).*/\1/p')
        corp=$(printf '%s\n' "$last" | sed -n 's/.*corp: \([0-9]*\).*/\1/p')
        crashes=$(ls "$build/fuzz/artifacts/" 2>/dev/null | grep -c "^$t-" || true)
        printf 'fuzz-%s: %s execs in %s s, cov %s ft %s, corpus %s, %s artifact(s)%s\n' "$t" "${execs:-?}" \
                "$took" "${cov:-?}" "${ft:-?}" "${corp:-?}" "$crashes" \
                "$([ $status -ne 0 ] && echo ", FAILED (exit $status): see $log")"
        if [ $status -ne 0 ]; then
                grep -E 'ERROR|SUMMARY|fuzz_[a-z]+:' "$log" | head -5
                rc=1
        fi
done
exit $rc
