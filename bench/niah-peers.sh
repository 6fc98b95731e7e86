#!/usr/bin/env bash
# bench/niah-peers.sh [BUILD [OUT]]: the peers on exactly the needles of `kvc-eval --task niah --suite
# ladder` (issue 27, "Measure"), so that exact match against bytes can be drawn for kvcd's ladder
# beside every peer, on SmolLM2-135M-Instruct ($KVC_SMOLLM2). `make bench-niah-peers` runs it after
# `make peers`, `make kvpress-deps` and `make all`.
#
#   1. kvc-eval --task niah --suite ladder --lengths LENGTHS --needles NEEDLES --dump-tokens (no kvcd):
#      the token ids of the needles the lab scores (same seed, same order: client/eval/niah.c), the
#      prompt ending with the answer's prefix, and where each question starts.
#   2. Every peer scores them teacher-forced as niah.c does (exact match: every answer token the
#      argmax after the true prefix; log p: the answer's summed log probability), one raw line a
#      needle and cache ("needle LENGTH K CACHE HIT LOGP BYTES", BYTES: what the cache holds when the
#      answer is read as a fraction of its own FP16 full cache):
#      - llama.cpp (bench/llama-tiers.c against PEERS, default BUILD/peers): cache types TYPES
#        (f16,q8_0,q4_0,iq4_nl), K and V at the type, flash attention on, one process a needle;
#      - transformers' QuantizedCache, quanto int4 and int2, beside its float32 DynamicCache
#        (bench/tiers_quanto.py in VENV, default BUILD/venv-kvpress): it quantizes only after the
#        prefill, so the question reads exact values and only the answer's tokens read quantized ones;
#      - kvpress's presses PRESSES (kvzip,snapkv,streaming_llm) at RATIOS (0.75,0.85,0.90: 25%, 15%
#        and 10% of the context kept) beside kvpress's full cache (bench/kvpress_bench.py --tokens in
#        VENV): question-agnostic, the press compresses the context (the prompt up to the question)
#        and the question, the answer's prefix and the answer go in after it, teacher-forced.
#      The work goes in units (a llama.cpp needle; the quanto or kvpress needles of one length),
#      longest first, JOBS (default 2) at once, one thread each. A unit whose raw file
#      (BUILD/niah-peers/raw/UNIT) is complete is not run again, and kvpress's resumes line by line
#      (delete that folder to start over).
#   3. llama-tiers niah-report: OUT/peers.md and OUT/peers.jsonl (one row per cache: peer, bytes
#      fraction, exact match per length with its 95% bootstrap interval over needles, log p), and
#      OUT/peers_raw.txt (every needle's line). What could not run (kvpress_bench.py's *.errors) is
#      listed in peers.md.
#
# LENGTHS defaults to 1024,2048,4096 and NEEDLES to 5 (the ladder run's). A 1,024-token needle
# costs about 150 CPU-seconds (all peers; most of it kvpress: 10 prefills, KVzip's at 4 times the
# cost, and llama.cpp's four contexts), 2,048 about twice that, 4,096 about five times: some 100
# CPU-minutes for the defaults, 40 without 4096. OUT defaults to bench/quality/smollm2/ladder.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=${2:-bench/quality/smollm2/ladder}
model=${KVC_SMOLLM2:-$HOME/.cache/kvcd/models/SmolLM2-135M-Instruct.Q4_1.gguf}
lengths=${LENGTHS:-1024,2048,4096}
needles=${NEEDLES:-5}
types=${TYPES:-f16,q8_0,q4_0,iq4_nl}
presses=${PRESSES:-kvzip,snapkv,streaming_llm}
ratios=${RATIOS:-0.75,0.85,0.90}
jobs=${JOBS:-2}
peers=${PEERS:-$build/peers}
py=${VENV:-$build/venv-kvpress}/bin/python
src=$peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp
lib=$peers/llama.cpp/bin
work=$build/niah-peers
tool=$work/llama-tiers

die() {
        echo "bench/niah-peers.sh: $*" >&2
        exit 2
}
if ! [ -f "$lib/libllama.so" ] || ! [ -f "$src/include/llama.h" ]; then
        die "no llama.cpp under $peers: make peers (or PEERS=DIR)"
fi
if ! [ -x "$py" ] || ! "$py" -c 'import kvpress, optimum.quanto' 2>/dev/null; then
        die "no kvpress and optimum-quanto in $py: make kvpress-deps (or VENV=DIR)"
fi
[ -x "$build/bin/kvc-eval" ] || die "$build/bin/kvc-eval is missing: make all"
[ -f "$model" ] || die "no model at $model: make model"
mkdir -p "$work/raw" "$out"
lib=$(cd "$lib" && pwd)

# the libraries of this llama.cpp, whatever RUNPATH a copied build carries
export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if ! [ -x "$tool" ] || [ bench/llama-tiers.c -nt "$tool" ] || [ client/eval/stats.c -nt "$tool" ]; then
        cc -std=gnu11 -O2 -Wall -Wextra -Werror -Wshadow -I"$src/include" -I"$src/ggml/include" -Iclient/eval \
                bench/llama-tiers.c client/eval/stats.c -L"$lib" -lllama -lggml -lggml-base -lm \
                -Wl,-rpath,"$lib" -o "$tool"
fi

"$build/bin/kvc-eval" --task niah --suite ladder --model "$model" --lengths "$lengths" --needles "$needles" \
        --dump-tokens --out "$work/tokens" >/dev/null 2>&1 || die "kvc-eval --dump-tokens failed"
tokens=$work/tokens/niah_tokens.txt
questions=$work/tokens/niah_questions.txt
# raw files are named by length and case: other needles (lengths, count, seed) start over
sum=$(cat "$tokens" "$questions" | md5sum)
if [ "$(cat "$work/raw/SUM" 2>/dev/null)" != "$sum" ]; then
        rm -rf "$work/raw" && mkdir -p "$work/raw"
        echo "$sum" >"$work/raw/SUM"
fi
rm -rf "$work/seq" && mkdir -p "$work/seq"
awk -v dir="$work/seq" '$1 == "needle" {
        f = dir "/needle-" $2 "-" $3; print > f; close(f)
        f = dir "/len-" $2; print >> f; close(f) }' "$tokens"

n_types=$(tr ',' '\n' <<<"$types" | wc -l)
n_press=$((1 + $(tr ',' '\n' <<<"$presses" | wc -l) * $(tr ',' '\n' <<<"$ratios" | wc -l)))
export OMP_WAIT_POLICY=PASSIVE PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 \
        TRANSFORMERS_VERBOSITY=error KVC_SMOLLM2=$model
# UNIT WANT: true when UNIT's raw file holds WANT lines (scored before)
done_already() {
        [ -f "$work/raw/$1" ] && [ "$(wc -l <"$work/raw/$1")" -eq "$2" ]
}
run_unit() {
        local unit=$1 kind=${1%%-*} rest=${1#*-}
        case $kind in
        llama) "$tool" run "$model" "$work/seq/needle-$rest" "$types" 1 "$work/raw/$unit" ;;
        quanto) "$py" bench/tiers_quanto.py --model "$model" --tokens "$work/seq/len-$rest" \
                --raw "$work/raw/$unit" --part needles ;;
        kvpress) "$py" bench/kvpress_bench.py --build "$build" --tokens "$work/seq/len-$rest" \
                --questions "$questions" --raw "$work/raw/$unit" --presses "$presses" --ratios "$ratios" ;;
        esac
}
# longest first: kvpress's, then quanto's, then llama.cpp's needles, each by length down
units=()
for l in $(tr ',' '\n' <<<"$lengths" | sort -nr); do
        k=$(wc -l <"$work/seq/len-$l")
        done_already "kvpress-$l" $((k * n_press)) || units+=("kvpress-$l")
done
for l in $(tr ',' '\n' <<<"$lengths" | sort -nr); do
        k=$(wc -l <"$work/seq/len-$l")
        done_already "quanto-$l" $((k * 3)) || units+=("quanto-$l")
        for ((i = 0; i < k; i++)); do
                if ! done_already "llama-$l-$i" "$n_types"; then
                        rm -f "$work/raw/llama-$l-$i"
                        units+=("llama-$l-$i")
                fi
        done
done
for u in "${units[@]}"; do # tiers_quanto.py appends: a cut unit starts over; kvpress's resumes
        case $u in
        quanto-*) rm -f "$work/raw/$u" ;;
        kvpress-*) rm -f "$work/raw/$u.errors" ;;
        esac
done
started=$(date +%s)
for u in "${units[@]}"; do
        while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do
                wait -n || die "a unit failed (logs: $work/*.log)"
        done
        echo "niah-peers: $u ($(date -u +%H:%M:%S))"
        run_unit "$u" >"$work/$u.log" 2>&1 &
done
for p in $(jobs -p); do
        wait "$p" || die "a unit failed (logs: $work/*.log)"
done
seconds=$(($(date +%s) - started))
# the CPU time of every unit of this run (user + system of the waited-for children; `times` in
# this shell, not in a command substitution's)
times >"$work/times"
cpu=$(awk 'NR == 2 { gsub(/[ms]/, " "); print int($1 * 60 + $2 + $3 * 60 + $4) }' "$work/times")

raws=("$work"/raw/llama-* "$work"/raw/quanto-* "$work"/raw/kvpress-[0-9]*[0-9])
"$tool" niah-report "${raws[@]}" "$work/report"
load=$(cut -d' ' -f1-3 /proc/loadavg)
versions=$("$py" -c 'import importlib.metadata as m
print(", ".join(p + " " + m.version(p) for p in ("transformers", "torch", "optimum-quanto", "kvpress")))')
{
        echo "# The peers on kvc-eval's niah ladder needles: SmolLM2-135M-Instruct"
        echo
        echo "bench/niah-peers.sh ($(date -u +%Y-%m-%d); lengths $lengths, $needles needles each; this run ${seconds} s"
        echo "wall and ${cpu} s of CPU for the units it ran (${#units[@]}), load average $load at the end). The token"
        echo "ids are those of \`kvc-eval --task niah --suite ladder --lengths $lengths --needles $needles\`"
        echo "(--dump-tokens, the default seed), scored as niah.c scores them: teacher-forced, exact match when"
        echo "every answer token is the argmax after the true prefix, log p the answer's summed log probability;"
        echo "95% percentile bootstrap over needles with niah.c's seeds (client/eval/stats.c)."
        echo
        echo "- llama.cpp 0c1e570 (llama-cpp-python 0.3.36), CPU, flash attention on, the Q4_1 GGUF: cache types"
        echo "  $types for K and V, every token at the type. Bytes: ggml's row size at the type over f16's."
        echo "- transformers: $versions; the GGUF dequantized to float32. QuantizedCache(\"quanto\","
        echo "  nbits 4 or 2, q_group_size 64, residual_length 128) beside the float32 DynamicCache (f32). It"
        echo "  quantizes what an earlier forward stored: the prompt (haystack, question, answer prefix) is one"
        echo "  prefill in full precision, and only the answer's tokens read quantized keys and values."
        echo "  Bytes: the packed values at their bits, each group's scale and shift at 2 bytes (FP16; this"
        echo "  float32 run keeps them at 4), the unquantized newest tokens at 2 bytes."
        echo "- kvpress: presses $presses at compression ratios $ratios (25%, 15%, 10% of the context"
        echo "  kept), question-agnostic: the context (the prompt up to the question) is prefilled under the"
        echo "  press, then the question, the answer prefix and the answer go in uncompressed at their own"
        echo "  positions (kvpress's pipeline's position_ids). SnapKV scores with the context's last 64"
        echo "  queries (no question among them); StreamingLLM keeps 4 sinks and the newest tokens; KVzip scores"
        echo "  by having the model repeat the context, ranks across layers (each layer keeps a different"
        echo "  share), and evicts by masking keys in place (the cache keeps every token: its bytes are what it"
        echo "  would hold). Bytes: the tokens each layer holds when the answer is read (the compressed context"
        echo "  and the uncompressed question), over all layers, as a fraction of the full cache's; a press holds"
        echo "  the whole context during its prefill."
        echo
        echo "Each peer's reference is its own full cache (f16, f32, kvpress-full); kvcd's ladder rows are in"
        echo "kvc-eval's niah.md of the same suite."
        echo
        cat "$work/report.md"
        errs=("$work"/raw/kvpress-*.errors)
        if [ -e "${errs[0]}" ] && [ -n "$(cat "${errs[@]}")" ]; then
                echo
                echo "## Did not run"
                echo
                cat "${errs[@]}" | awk '{ n = $1 " " $2 " " $3; $1 = $2 = $3 = ""; print "- needle " n ":" $0 }'
        fi
} >"$out/peers.md"
cp "$work/report.jsonl" "$out/peers.jsonl"
cat "${raws[@]}" | sort -k2,2n -k3,3n >"$out/peers_raw.txt"
cat "$out/peers.md"
