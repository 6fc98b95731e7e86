#!/usr/bin/env bash
# bench/quality.sh [BUILD] [SEQUENCES]: the quality lab end to end. Starts kvcd in a temporary
# runtime directory, runs kvc-eval's full suite over the TinyStories validation sample, and
# draws the plots with gnuplot. Results: bench/quality/{results.md,results.csv,pareto.png,
# confidence_kl.png,confidence_kl.csv} (QUALITY_OUT=DIR: into DIR instead); bench/quality/README.md
# describes them.
# bench/quality.sh --plot: only the plots, from the committed results.csv and confidence_kl.csv
# (seconds instead of the lab's run); the number of stories comes from results.md.
#
# The plots: every family its own colour, marker and (past the 15 markers gnuplot draws) dash
# pattern, from fixed tables below, so no two series look alike however many there are; one
# legend, right of both panels; byte axes in KiB at powers of two, KL in powers of ten.
# QUALITY_DTYPE: how kvcd stores the keys and values (kvc-eval --dtype; default f16, what a server
# holds and what the SmolLM2 tasks use: INT8's saving is read against it).
set -euo pipefail
dtype=${QUALITY_DTYPE:-f16}
# QUALITY_OUT: where the results go (default the committed bench/quality; a scratch folder for a
# trial run, e.g. QUALITY_OUT=build/quality-try bench/quality.sh build 4)
out=${QUALITY_OUT:-bench/quality}
dir=$(mktemp -d "${TMPDIR:-/tmp}/kvcd-quality-XXXXXX")
pid=
cleanup() {
        if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
        rm -rf "$dir"
}
trap cleanup EXIT

# 24 colours that stay apart from each other on white (Kelly's and Tableau's, mixed)
colours=(1f77b4 d62728 2ca02c ff7f0e 9467bd 8c564b e377c2 7f7f7f bcbd22 17becf 000080 800000
        008080 f0a3ff 993f00 4c005c 2bce48 ffcc99 808000 ff0010 5ef1f2 00998f e0ff66 740aff)
# pngcairo's markers: + x * and open and filled square, circle, triangle, inverted triangle,
# diamond, pentagon
markers=(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)

plot() {
        local sequences=$1
        # one data block per family, sorted by bytes, for gnuplot's `index`. Columns by their name in
        # results.csv's header, never by number: the x axis is avg_charged_bytes, what kvcd charges
        # (blocks granted at full size), not the nominal avg_kv_bytes beside it.
        local cols='family avg_charged_bytes ppl name_acc kl'
        local pick='NR == 1 {
                        n = split(want, w, " ")
                        for (i = 1; i <= NF; i++) at[$i] = i
                        for (j = 1; j <= n; j++)
                                if (!(w[j] in at)) { print "results.csv: no column " w[j] >"/dev/stderr"; exit 1 }
                        next
                    }
                    { line = $(at[w[1]]); for (j = 2; j <= n; j++) line = line "," $(at[w[j]]); print line }'
        awk -F, -v want="$cols" "$pick" "$out/results.csv" >"$dir/columns.csv"
        awk -F, '$1 != "full"' "$dir/columns.csv" |
                sort -t, -k1,1 -k2,2n |
                awk -F, 'BEGIN { fam = "" } { if ($1 != fam) { if (fam != "") printf "\n\n"; fam = $1; printf "# %s\n", $1 }
                                              print $2, $3, $4, $5 }' >"$dir/curves.dat"
        local full families
        full=$(awk -F, '$1 == "full" { print $3 "," $4 "," $2 }' "$dir/columns.csv")
        families=$(awk '/^# / { printf "%s ", $2 }' "$dir/curves.dat")
        {
                echo "set terminal pngcairo size 1800,760 font ',11'"
                echo "set output '$out/pareto.png'"
                echo "set multiplot title 'stories260K through kvcd, $sequences stories: quality against the KV bytes kvcd charges a sequence (average over the steps)' font ',13'"
                echo "set logscale x 2; set grid"
                echo "set xtics ('4 KiB' 4096, '8 KiB' 8192, '16 KiB' 16384, '32 KiB' 32768, '64 KiB' 65536, '128 KiB' 131072, '256 KiB' 262144, '512 KiB' 524288, '1 MiB' 1048576); set format y '%g'"
                echo "set xlabel 'average KV bytes per sequence, as kvcd charges them (blocks granted)'"
                echo "set bmargin at screen 0.10; set tmargin at screen 0.90"
                local i=0 f
                for f in $families; do
                        echo "set style line $((i + 1)) lc rgb '#${colours[i % ${#colours[@]}]}' lw 1.6 pt ${markers[i % ${#markers[@]}]} ps 1.3 dt $((i / ${#markers[@]} + 1))"
                        i=$((i + 1))
                done
                # the left panel has no key; the right one holds the one legend, outside it
                echo "set lmargin at screen 0.05; set rmargin at screen 0.41; unset key"
                echo "set ylabel 'perplexity (teacher-forced)'"
                echo "set yrange [*:${full%%,*}*1.35]"
                printf "plot"
                i=0
                for f in $families; do printf " '%s' index %d using 1:2 with linespoints ls %d notitle," "$dir/curves.dat" $i $((i + 1)); i=$((i + 1)); done
                echo " ${full%%,*} with lines dt 2 lw 2 lc rgb 'black' notitle"
                echo "set lmargin at screen 0.47; set rmargin at screen 0.83"
                echo "set key outside right top vertical Left reverse samplen 3 spacing 1.05 font ',10' title 'policy family'"
                echo "set ylabel 'name recall (top-1 on a recurring name)'; unset yrange"
                printf "plot"
                i=0
                for f in $families; do printf " '%s' index %d using 1:3 with linespoints ls %d title '%s'," "$dir/curves.dat" $i $((i + 1)) "$f"; i=$((i + 1)); done
                local full_name
                full_name=$(echo "$full" | cut -d, -f2)
                echo " $full_name with lines dt 2 lw 2 lc rgb 'black' title 'full cache'"
                echo "unset multiplot"
                echo "set terminal pngcairo size 900,700 font ',11'"
                echo "set output '$out/confidence_kl.png'"
                echo "unset logscale; set logscale y; set key off; set lmargin; set rmargin; set tmargin; set bmargin"
                echo "set xtics autofreq; set format x '%.1f'; set format y '10^{%L}'"
                echo "set title 'per step ($sequences stories): the full cache''s confidence against the KL a 32-token window causes'"
                echo "set xlabel 'confidence c = 0.4(1-H/log V) + 0.3 sigmoid(z1-z2) + 0.3 p1'; set ylabel 'KL(full || window-32)'"
                echo "set datafile separator ','"
                echo "plot '$out/confidence_kl.csv' every ::1 using 1:(\$2 > 1e-6 ? \$2 : 1e-6) with dots lc rgb '#1f77b4'"
        } >"$dir/plot.gp"
        gnuplot "$dir/plot.gp"
}

if [ "${1:-}" = "--plot" ]; then
        sequences=$(sed -n 's/^\([0-9][0-9]*\) stories.*/\1/p' "$out/results.md" | head -1)
        plot "${sequences:-?}"
        echo "wrote $out/pareto.png, $out/confidence_kl.png" >&2
        exit 0
fi

build=${1:-build}
sequences=${2:-64}
mkdir -p "$out"
"$build/bin/kvcd" --runtime-dir "$dir/run" --capacity 1G --log-level warning 2>"$dir/kvcd.log" &
pid=$!
# kvcctl needs the admin socket to exist: poll for it (10 s at most), as quality-smol.sh does
for _ in $(seq 200); do [ -S "$dir/run/kvcd.admin.sock" ] && break; sleep 0.05; done
"$build/bin/kvcctl" --socket "$dir/run" --timeout 10000 status >/dev/null
start=$(date +%s)
# kvc-eval writes results.{md,csv,jsonl} into $out itself, as .partial files renamed at the end:
# an interrupted run leaves the committed results as they were (a redirect here would truncate them)
"$build/bin/kvc-eval" --socket "$dir/run" --sequences "$sequences" --jobs "$(nproc)" --dtype "$dtype" --out "$out" >/dev/null
echo "kvc-eval: $(( $(date +%s) - start )) s for $sequences stories" >&2
"$build/bin/kvcctl" --socket "$dir/run" audit >&2
plot "$sequences"
echo "wrote $out/results.md, $out/pareto.png, $out/confidence_kl.png" >&2
