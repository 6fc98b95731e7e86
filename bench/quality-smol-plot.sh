#!/usr/bin/env bash
# bench/quality-smol-plot.sh DIR: the needle task's plots from DIR/niah.csv and DIR/niah_needles.csv
# (kvc-eval --task niah): DIR/niah_pareto.png (exact match against the bytes kvcd charges, as a
# share of the full cache's, one line per policy and marker per haystack length; the sample size
# in the title) and DIR/niah_heatmap.png (exact match by length and depth for the full cache, the
# window, H2O and CONF-KV at the smallest budget).
set -euo pipefail
out=$1
tmp=$(mktemp -d "${TMPDIR:-/tmp}/niah-plot-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
csv=$out/niah.csv
needles=$(awk -F, 'NR == 2 { print $7 }' "$csv")
# one block per family (and length), sorted by bytes, for gnuplot's `index`
awk -F, 'NR > 1 { print $3 "," $1 "," $19 "," $8 }' "$csv" | sort -t, -k1,1 -k2,2n -k3,3g |
        awk -F, 'BEGIN { key = "" } { k = $1 " " $2; if (k != key) { if (key != "") printf "\n\n"; key = k; printf "# %s\n", k }
                                      print $3, $4 }' >"$tmp/curves.dat"
blocks=$(awk '/^# / { printf "%s:%s ", $2, $3 }' "$tmp/curves.dat")
{
        echo "set terminal pngcairo size 1100,700 font ',11'"
        echo "set output '$out/niah_pareto.png'"
        echo "set title 'SmolLM2-135M-Instruct through kvcd: needle in a haystack, $needles needles per length'"
        echo "set xlabel 'bytes kvcd charges (average over positions), share of the full cache'"
        echo "set ylabel 'exact match (greedy answer)'"
        echo "set grid; set key outside right top; set yrange [-0.05:1.05]; set xrange [0:1.05]"
        echo "set style line 1 lc rgb '#0072B2' lw 2"
        echo "set style line 2 lc rgb '#D55E00' lw 2"
        echo "set style line 3 lc rgb '#009E73' lw 2"
        echo "set style line 4 lc rgb '#CC79A7' lw 2"
        echo "set style line 5 lc rgb '#E69F00' lw 2"
        echo "set style line 6 lc rgb '#56B4E9' lw 2"
        echo "set style line 7 lc rgb '#000000' lw 2"
        printf "plot"
        i=0
        fams=()
        for b in $blocks; do
                fam=${b%%:*}
                len=${b##*:}
                idx=-1
                for j in "${!fams[@]}"; do [ "${fams[$j]}" = "$fam" ] && idx=$j; done
                if [ "$idx" = -1 ]; then fams+=("$fam"); idx=$(( ${#fams[@]} - 1 )); fi
                case $len in 1024) pt=5 ;; 2048) pt=7 ;; 4096) pt=9 ;; 8192) pt=11 ;; *) pt=13 ;; esac
                printf " '%s' index %d using 1:2 with linespoints ls %d pt %d ps 1.5 title '%s, %s tokens'," \
                        "$tmp/curves.dat" $i $(( idx % 7 + 1 )) $pt "$fam" "$len"
                i=$((i + 1))
        done
        echo " 1/0 notitle"
} >"$tmp/pareto.gp"
gnuplot "$tmp/pareto.gp"

# heat maps: rows = lengths, columns = needle depths, per configuration
per=$out/niah_needles.csv
smallest=$(awk -F, 'NR > 1 && $3 != "full" { print $5 }' "$csv" | sort -g | head -1)
pct=$(awk -v f="$smallest" 'BEGIN { printf "%.0f%%", 100 * f }')
{
        echo "set terminal pngcairo size 1200,900 font ',11'"
        echo "set output '$out/niah_heatmap.png'"
        echo "set multiplot layout 2,2 title 'exact match by haystack length and needle depth ($needles needles per length; budgets $pct of the haystack)'"
        echo "set palette defined (0 '#D55E00', 1 '#0072B2'); set cbrange [0:1]; set xlabel 'needle depth'; set ylabel 'haystack tokens'"
        echo "set datafile separator ','; set xrange [0:1]; set logscale y 2"
        for cfg in full "window-$pct" "h2o-$pct" "conf-int8-$pct"; do
                grep -q ",$cfg," "$per" || continue # a suite without this configuration
                echo "set title '$cfg'"
                echo "plot '$per' using (strcol(4) eq '$cfg' ? \$3 : 1/0):1:5 with points pt 5 ps 4 palette notitle"
        done
        echo "unset multiplot"
} >"$tmp/heat.gp"
gnuplot "$tmp/heat.gp"
echo "wrote $out/niah.md, $out/niah_pareto.png, $out/niah_heatmap.png" >&2
