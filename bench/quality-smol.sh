#!/usr/bin/env bash
# bench/quality-smol.sh [BUILD] [OUT] [-- kvc-eval options...]: the real-model suite (docs/quality.md).
# Starts kvcd in a temporary runtime directory, runs kvc-eval's needle-in-a-haystack task on
# SmolLM2-135M-Instruct ($SMOLLM2, or $KVC_SMOLLM2), and draws the Pareto plot (exact match
# against the bytes kvcd charges, one line per policy, per haystack length) and the heat maps
# (length by depth) with gnuplot. OUT defaults to a new build/quality-smol/DATE directory: the
# committed bench/quality/ is written only when named (make quality-smol QUALITY_SMOL_OUT=bench/quality).
# kvc-eval writes its files as .partial and renames them at the end, so an interrupted run leaves
# OUT's old results as they were. QUALITY_TASK=longdoc, longgen or mechanism runs that task instead
# of the needle task (make quality-longdoc, quality-longgen, quality-mechanism; no plots).
set -euo pipefail
build=${1:-build}
out=${2:-build/quality-smol/$(date -u +%Y%m%d-%H%M%S)}
shift $(( $# < 2 ? $# : 2 ))
[ "${1:-}" = "--" ] && shift
model=${SMOLLM2:-${KVC_SMOLLM2:-$HOME/.cache/kvcd/models/SmolLM2-135M-Instruct.Q4_1.gguf}}
dir=$(mktemp -d "${TMPDIR:-/tmp}/kvcd-quality-smol-XXXXXX")
pid=
cleanup() {
        if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
        rm -rf "$dir"
}
trap cleanup EXIT
mkdir -p "$out"
"$build/bin/kvcd" --runtime-dir "$dir/run" --capacity 4G --log-level warning 2>"$dir/kvcd.log" &
pid=$!
# kvcctl needs the admin socket to exist; a bench script may poll for it (10 s at most)
for _ in $(seq 200); do [ -S "$dir/run/kvcd.admin.sock" ] && break; sleep 0.05; done
"$build/bin/kvcctl" --socket "$dir/run" --timeout 10000 status >/dev/null
task=${QUALITY_TASK:-niah}
start=$(date +%s)
"$build/bin/kvc-eval" --socket "$dir/run" --task "$task" --model "$model" --out "$out" "$@" >"$dir/$task.out"
echo "kvc-eval $task: $(( $(date +%s) - start )) s" >&2
"$build/bin/kvcctl" --socket "$dir/run" audit >&2
if [ "$task" = niah ]; then bench/quality-smol-plot.sh "$out"; fi
