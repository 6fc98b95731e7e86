#!/usr/bin/env bash
# bench/quality.sh [BUILD] [SEQUENCES]: the quality lab end to end. Starts kvcd in a temporary
# runtime directory, runs kvc-eval's full suite over the TinyStories validation sample, and
# draws the plots with gnuplot. Results: bench/quality/{results.md,results.csv,pareto.png,
# confidence_kl.png,confidence_kl.csv}.
set -euo pipefail
build=${1:-build}
sequences=${2:-64}
out=bench/quality
dir=$(mktemp -d "${TMPDIR:-/tmp}/kvcd-quality-XXXXXX")
pid=
cleanup() {
        if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
        rm -rf "$dir"
}
trap cleanup EXIT
mkdir -p "$out"
"$build/bin/kvcd" --runtime-dir "$dir/run" --capacity 1G --log-level warning 2>"$dir/kvcd.log" &
pid=$!
"$build/bin/kvcctl" --socket "$dir/run" --timeout 10000 status >/dev/null
start=$(date +%s)
# kvc-eval writes results.{md,csv,jsonl} into $out itself, as .partial files renamed at the end:
# an interrupted run leaves the committed results as they were (a redirect here would truncate them)
"$build/bin/kvc-eval" --socket "$dir/run" --sequences "$sequences" --jobs "$(nproc)" --out "$out" >/dev/null
echo "kvc-eval: $(( $(date +%s) - start )) s for $sequences stories" >&2
"$build/bin/kvcctl" --socket "$dir/run" audit >&2

# one data block per family, sorted by bytes, for gnuplot's `index`
awk -F, 'NR > 1 && $2 != "full" { print $2 "," $12 "," $5 "," $9 "," $7 }' "$out/results.csv" | sort -t, -k1,1 -k2,2n |
        awk -F, 'BEGIN { fam = "" } { if ($1 != fam) { if (fam != "") printf "\n\n"; fam = $1; printf "# %s\n", $1 }
                                      print $2, $3, $4, $5 }' >"$dir/curves.dat"
full=$(awk -F, '$1 == "full" { print $5 "," $9 "," $12 }' "$out/results.csv")
families=$(awk '/^# / { printf "%s ", $2 }' "$dir/curves.dat")
{
        echo "set terminal pngcairo size 1600,700 font ',10'"
        echo "set output '$out/pareto.png'"
        echo "set multiplot layout 1,2 title 'stories260K through kvcd: quality against KV bytes per sequence (avg over steps)'"
        echo "set logscale x 2; set grid; set key outside right top font ',8'"
        echo "set xlabel 'average KV bytes per sequence (FP16, INT8 with scales)'"
        echo "set ylabel 'perplexity (teacher-forced)'"
        echo "set yrange [*:${full%%,*}*1.35]"
        printf "plot"
        i=0
        for f in $families; do printf " '%s' index %d using 1:2 with linespoints title '%s'," "$dir/curves.dat" $i "$f"; i=$((i + 1)); done
        echo " ${full%%,*} with lines dt 2 lc rgb 'black' title 'full cache'"
        echo "set ylabel 'name recall (top-1 on a recurring name)'; unset yrange"
        printf "plot"
        i=0
        for f in $families; do printf " '%s' index %d using 1:3 with linespoints title '%s'," "$dir/curves.dat" $i "$f"; i=$((i + 1)); done
        full_name=$(echo "$full" | cut -d, -f2)
        echo " $full_name with lines dt 2 lc rgb 'black' title 'full cache'"
        echo "unset multiplot"
        echo "set output '$out/confidence_kl.png'"
        echo "set terminal pngcairo size 900,700 font ',10'"
        echo "unset logscale; set logscale y; set key off"
        echo "set title 'per step: the full cache''s confidence against the KL a 32-token window causes'"
        echo "set xlabel 'confidence c = 0.4(1-H/log V) + 0.3 sigmoid(z1-z2) + 0.3 p1'; set ylabel 'KL(full || window-32)'"
        echo "set datafile separator ','"
        echo "plot '$out/confidence_kl.csv' every ::1 using 1:(\$2 > 1e-6 ? \$2 : 1e-6) with dots lc rgb '#3060a0'"
} >"$dir/plot.gp"
gnuplot "$dir/plot.gp"
echo "wrote $out/results.md, $out/pareto.png, $out/confidence_kl.png" >&2
