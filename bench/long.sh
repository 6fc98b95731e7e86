#!/usr/bin/env bash
# bench/long.sh BUILD: SmolLM2's decode speed after a long prompt (issue 17, long context), for the
# CPU attention kernel (kernels/attention.c). `make bench-long` runs it.
#
# For each context C (CONTEXTS, default "16 1024 4096 8160": 8,160 + DECODE stays within the
# model's 8,192 positions) the prompt is the first characters of
# ../shared/data/tinystories/validation-sample.txt cut to C tokens (kvc-run --json's prompt_tokens
# gives the count; the cut is refined until it is within 1%), and each configuration decodes DECODE
# (default 32) tokens after it, 1 thread: kvc-run's decode_seconds (the one-row passes after the
# prompt) and decode_cpu_seconds (kvc-run's CPU time over them: on a loaded machine the wall time
# mostly measures the other jobs; kvcd's own CPU time is not in it) give tokens/s at that context.
# Configurations (the table `cfg` below; CONFIGS= picks and orders them, default "local full window
# conf llama"), one after the other for each context, so a context's ratios come from neighbouring
# runs on a shared machine. B is BUDGET (default 1024); what each holds per layer while it decodes
# the DECODE tokens after a prompt of M > B tokens (slack: one block, 16 tokens):
#   local      --local (in-process f32 cache): M + decoded, everything
#   full       kvcd --policy full (f32 blocks of 16): M + decoded, everything
#   window     --policy window: the B newest; B to B + 16 (cut back to B at B + 16)
#   streaming  --policy streaming: 4 sinks + the newest; B to B + 16
#   h2o        --policy h2o: per KV head the B/2 newest + the best B/2 by accumulated attention;
#              B to B + 16
#   tova       --policy tova: the best B by the current query's attention; B to B + 16
#   prob       --policy prob: 4 sinks, 16 newest, a sample of the rest (Horvitz-Thompson
#              log-weights); B to B + 16
#   conf       --policy conf (gate=defer): B to B + 16 on confident steps, up to 3B/2 + 16 on
#              uncertain ones
#   conf8      conf with --param int8=1: as conf, all but the newest 8 kept tokens in INT8 blocks
#   snapkv     --policy snapkv: the prompt is cut once, when it is in, to B per layer and KV head
#              (its last 8 tokens + the best by the pooled attention of the observed queries);
#              then B + decoded (decoding is not compressed)
#   pyramid    --policy pyramid (PyramidKV): the same cut with per-layer budgets decreasing with
#              depth, B on average (B = 1024: 8 + 1981 in layer 0 down to 8 + 51 in layer 29);
#              then that + decoded
#   scope      --policy scope: the same cut as snapkv (prefill_budget B); the decoded tokens have
#              their own budget B, which DECODE < B never reaches: B + decoded
#   local-q8, local-q4, local-q3, local-q2   --local --dtype f16 --tier T (the precision ladder's
#              in-process cache): M + decoded, everything; all but the newest 128 at tier T
#   kvcd-q8, kvcd-q4, kvcd-q3, kvcd-q2   the same through kvcd: --policy full --dtype f16 --tier T
#              (a session with tier T and tier_window 128; kvcd demotes a block at a time, in links)
#   full-f16   --policy full --dtype f16: the FP16 full cache (the ladder's reference)
#   ladder     --policy ladder --dtype f16 --tiers q8,q4,q2 --budget-frac 0.25 --importance
#              surprisal (issue 27): a quarter of the full cache's bytes, the tokens ranked by their
#              surprisal at prefill, most at 4 and 2 bits
#   llama-q4   llama-bench as llama, with q4_0 keys and values and flash attention (-fa 1 -ctk q4_0
#              -ctv q4_0: a quantized V cache needs it), the peer of local-q4
#   llama      llama.cpp's llama-bench at the same depth (-d CONTEXT -p 0 -n DECODE -t 1, f16 cache,
#              flash attention off: its fastest path here; --repack 0), when BUILD/peers has it
#              (`make peers`): its rate is wall-clock only, so the table compares it with kvc-run's
#              wall rates of the same context (both on a loaded machine: indicative)
# kvc-run declares the prompt to kvcd (OpenSession.prompt_tokens = its prompt's length, BOS
# included), so snapkv, pyramid and scope cut it at the step that appends its last token (prompts
# go in chunks of 256 rows, one kvcd step each, the last 8 tokens one per step: the observation
# window sees 8 queries; before 2026-12-02 07:00 UTC it saw the last chunk's one).
# Every kvcd run has --trace 1: the table's "held" column is layer 0's tokens over the decode steps
# (least-most), measured, beside the speed (pyramid's layer 0 holds the most of its layers).
# A configuration whose kvc-run fails is reported (stderr) and shows "failed"; the others go on.
# CHUNK_BYTES (default 2M, kvcd's default) is kvcd's --chunk-bytes. (Until scope's keep-set limit
# was fixed on 2026-12-02, scope could not open a session for SmolLM2 past about 5,800 prompt
# tokens on 2M chunks: its plan buffer grew with the prompt; the committed runs used 4M.)
# DTYPE=f16 or bf16 stores kvcd's keys and values so, default f32. Context 16 is "short context":
# the prompt "Once upon a time".
# Prints two markdown tables of tokens per CPU second: by context, the configurations and ratios the
# targets name; by configuration, every one run, with its held tokens and its ratio to full. Each
# run's wall-clock rate goes to stderr beside it.
set -euo pipefail

build=${1:-build}
bin=$build/bin
model=${KVC_SMOLLM2:-$HOME/.cache/kvcd/models/SmolLM2-135M-Instruct.Q4_1.gguf}
contexts=${CONTEXTS:-16 1024 4096 8160}
decode=${DECODE:-32}
budget=${BUDGET:-1024}
configs=${CONFIGS:-local full window conf llama}
lb=$build/peers/llama.cpp/bin/llama-bench
dtype=${DTYPE:-f32}
chunk=${CHUNK_BYTES:-2M}
text=../shared/data/tinystories/validation-sample.txt

die() {
        echo "bench/long.sh: $*" >&2
        exit 2
}
for p in "$bin/kvc-run" "$bin/kvcd"; do [ -x "$p" ] || die "$p is missing: make all BUILD=$build"; done
[ -f "$model" ] || die "no model at $model: make model"
[ -f "$text" ] || die "no $text"

# configuration -> kvc-run's arguments (kvcd's get --socket, --dtype and --trace 1 before them)
declare -A cfg_args=(
        [local]="--local"
        [full]="--policy full"
        [window]="--policy window --budget $budget"
        [streaming]="--policy streaming --budget $budget"
        [h2o]="--policy h2o --budget $budget"
        [tova]="--policy tova --budget $budget"
        [prob]="--policy prob --budget $budget"
        [conf]="--policy conf --budget $budget"
        [conf8]="--policy conf --budget $budget --param int8=1"
        [snapkv]="--policy snapkv --budget $budget"
        [pyramid]="--policy pyramid --budget $budget"
        [scope]="--policy scope --budget $budget"
        [local-q8]="--local --dtype f16 --tier q8"
        [local-q4]="--local --dtype f16 --tier q4"
        [local-q3]="--local --dtype f16 --tier q3"
        [local-q2]="--local --dtype f16 --tier q2"
        [kvcd-q8]="--policy full --dtype f16 --tier q8"
        [kvcd-q4]="--policy full --dtype f16 --tier q4"
        [kvcd-q3]="--policy full --dtype f16 --tier q3"
        [kvcd-q2]="--policy full --dtype f16 --tier q2"
        [full-f16]="--policy full --dtype f16"
        [ladder]="--policy ladder --dtype f16 --tiers q8,q4,q2 --budget-frac 0.25 --importance surprisal"
)
declare -A tps wl held
for cfg in $configs; do
        [ "${cfg%-q4}" = llama ] || [ -n "${cfg_args[$cfg]:-}" ] || die "unknown configuration $cfg (known: ${!cfg_args[*]} llama llama-q4)"
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvc-bench-long-XXXXXX")
kvcd_pid=
cleanup() {
        if [ -n "$kvcd_pid" ]; then
                kill "$kvcd_pid" 2>/dev/null || true
                wait "$kvcd_pid" 2>/dev/null || true
        fi
        rm -rf "$tmp"
}
trap cleanup EXIT

field() { sed -n "s/.*\"$1\": *\([0-9.e+-]*\).*/\1/p" | head -1; }
kvcrun_try() { timeout 3600 "$bin/kvc-run" --model "$model" --json --no-stop --threads 1 "$@" 2>"$tmp/err"; }
# kvc-run's arguments, the prompt given as its length
printable() {
        local a prev= out=
        for a in "$@"; do
                [ "$prev" = -i ] && a="<${#a} characters>"
                out+=" $a" prev=$a
        done
        echo "${out# }"
}
kvcrun() { kvcrun_try "$@" || { cat "$tmp/err" >&2; die "kvc-run $(printable "$@") failed"; }; }
# prompt_of C: writes a prompt of C tokens (within 1%) to $tmp/prompt.C, its token count to stdout
prompt_of() {
        local c=$1 chars=$(($1 * 4)) n=0
        if [ "$c" -le 16 ]; then
                printf 'Once upon a time' >"$tmp/prompt.$c"
        else
                for _ in 1 2 3 4; do
                        head -c "$chars" "$text" >"$tmp/prompt.$c"
                        n=$(kvcrun --local -i "$(cat "$tmp/prompt.$c")" -n 1 | field prompt_tokens)
                        [ $((n * 100)) -ge $((c * 99)) ] && [ "$n" -le "$c" ] && break
                        chars=$((chars * c / n - 4))
                done
        fi
        kvcrun --local -i "$(cat "$tmp/prompt.$c")" -n 1 | field prompt_tokens
}

"$bin/kvcd" --runtime-dir "$tmp/run" --capacity 2G --chunk-bytes "$chunk" --log-level warning 2>"$tmp/kvcd.log" &
kvcd_pid=$!
for _ in $(seq 400); do
        [ -S "$tmp/run/kvcd.sock" ] && [ -S "$tmp/run/kvcd.fd.sock" ] && break
        kill -0 "$kvcd_pid" 2>/dev/null || break
        sleep 0.05 # waiting for a process we started to bind, bounded
done
[ -S "$tmp/run/kvcd.fd.sock" ] || { cat "$tmp/kvcd.log" >&2; die "kvcd did not come up"; }

echo "# SmolLM2 decode at long context (bench/long.sh), 1 thread, $decode tokens after the prompt, kvcd's cache $dtype"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' (+ local changes)')"
echo "machine: nproc $(nproc), $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), load average at the start $(cut -d' ' -f1-3 /proc/loadavg)"
echo
for c in $contexts; do
        n=$(prompt_of "$c")
        p=$(cat "$tmp/prompt.$c")
        steps=$((n + decode))
        echo "context $c: $n prompt tokens ($(date -u +%T), load $(cut -d' ' -f1 /proc/loadavg))" >&2
        for cfg in $configs; do
                if [ "${cfg%-q4}" = llama ]; then
                        [ -x "$lb" ] || { echo "  $cfg: $lb is missing (make peers): skipped" >&2; continue; }
                        d=$((c <= 16 ? 0 : n))
                        kv=(-fa 0)
                        [ "$cfg" = llama-q4 ] && kv=(-fa 1 -ctk q4_0 -ctv q4_0)
                        wl[$c.$cfg]=$(LD_LIBRARY_PATH=$(dirname "$lb") timeout 1800 "$lb" -m "$model" --repack 0 \
                                "${kv[@]}" -r 1 -t 1 -p 0 -n "$decode" -d "$d" -o jsonl 2>"$tmp/lb.err" |
                                field avg_ts | awk '{ printf "%.1f", $1 }') || true
                        [ -n "${wl[$c.$cfg]}" ] || { cat "$tmp/lb.err" >&2; die "llama-bench -d $d failed"; }
                        echo "  $cfg: ${wl[$c.$cfg]} per wall second at depth $d ($(date -u +%T))" >&2
                        continue
                fi
                read -ra args <<<"${cfg_args[$cfg]}"
                [ "${cfg%%-*}" = local ] || args=(--socket "$tmp/run" --dtype "$dtype" --trace 1 "${args[@]}")
                if ! out=$(kvcrun_try "${args[@]}" -i "$p" -n "$steps"); then
                        grep -v '^step ' "$tmp/err" >&2 || true
                        echo "  $cfg: kvc-run $(printable "${args[@]}" -i "$p" -n "$steps") failed ($(date -u +%T))" >&2
                        tps[$c.$cfg]=failed wl[$c.$cfg]=failed held[$c.$cfg]=-
                        continue
                fi
                t=$(field decode_tokens <<<"$out")
                s=$(field decode_seconds <<<"$out")
                u=$(field decode_cpu_seconds <<<"$out")
                tps[$c.$cfg]=$(awk -v t="$t" -v s="$u" 'BEGIN { printf "%.1f", t / s }')
                wall=$(awk -v t="$t" -v s="$s" 'BEGIN { printf "%.1f", t / s }')
                wl[$c.$cfg]=$wall
                # layer 0's tokens at the decode steps (--trace lines "step P  cache T tokens/layer")
                held[$c.$cfg]=$(awk -v n="$n" '$1 == "step" && $2 > n { t = $4 + 0
                        lo = (lo == "" || t < lo) ? t : lo; hi = t > hi ? t : hi }
                        END { print lo == "" ? "-" : (lo == hi ? lo : lo "-" hi) }' "$tmp/err")
                [ "${cfg%%-*}" = local ] && held[$c.$cfg]="$((n + 1))-$steps"
                echo "  $cfg: ${tps[$c.$cfg]} tokens per CPU second, $wall per wall second, layer 0 holds" \
                        "${held[$c.$cfg]} tokens ($(date -u +%T))" >&2
        done
done
echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "tokens per CPU second of kvc-run (- where a configuration was not run):"
echo "| context (tokens) | --local, full cache | kvcd full | kvcd window $budget | kvcd conf $budget | kvcd conf $budget, int8 | window / full | conf / full | short-context window / window | short / conf |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
first=${contexts%% *} # the short-context ratios need a short first context (16): "-" otherwise
[ "$first" -le 16 ] || first=none
for c in $contexts; do
        awk -v c="$c" -v l="${tps[$c.local]:--}" -v f="${tps[$c.full]:--}" -v w="${tps[$c.window]:--}" \
                -v k="${tps[$c.conf]:--}" -v k8="${tps[$c.conf8]:--}" -v sw="${tps[$first.window]:--}" \
                -v sk="${tps[$first.conf]:--}" '
                function ratio(a, b) { return (a !~ /^[0-9.]+$/ || b !~ /^[0-9.]+$/ || b + 0 == 0) ? "-" : sprintf("%.2f", a / b) }
                BEGIN { printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", c, l, f, w, k, k8,
                        ratio(w, f), ratio(k, f), ratio(sw, w), ratio(sk, k) }'
done
echo
echo "every configuration run, tokens per CPU second of kvc-run, layer 0's tokens while decoding (held), and the ratio to kvcd full:"
hdr="| configuration | kvc-run arguments |" sep="|---|---|"
for c in $contexts; do
        hdr+=" held at $c | tokens/CPU-s at $c | / full at $c |"
        sep+="---:|---:|---:|"
done
echo "$hdr"
echo "$sep"
for cfg in $configs; do
        [ "${cfg%-q4}" = llama ] && continue
        row="| $cfg | \`${cfg_args[$cfg]}\` |"
        for c in $contexts; do
                row+=" ${held[$c.$cfg]:--} | ${tps[$c.$cfg]:--} |"
                row+=$(awk -v a="${tps[$c.$cfg]:--}" -v b="${tps[$c.full]:--}" \
                        'BEGIN { print (a !~ /^[0-9.]+$/ || b !~ /^[0-9.]+$/ || b + 0 == 0) ? " - |" : sprintf(" %.2f |", a / b) }')
        done
        echo "$row"
done
if [[ " $configs " == *" llama "* ]]; then
        echo
        echo "wall-clock tokens/s in the same run (llama.cpp has no CPU-time figure; - where not run):"
        echo "| context (tokens) | llama.cpp, full f16 cache | kvc-run --local | kvcd full | kvcd window $budget | kvcd conf $budget | window / llama.cpp | conf / llama.cpp |"
        echo "|---:|---:|---:|---:|---:|---:|---:|---:|"
        for c in $contexts; do
                awk -v c="$c" -v a="${wl[$c.llama]:--}" -v l="${wl[$c.local]:--}" -v f="${wl[$c.full]:--}" \
                        -v w="${wl[$c.window]:--}" -v k="${wl[$c.conf]:--}" '
                        function ratio(x, y) { return (x !~ /^[0-9.]+$/ || y !~ /^[0-9.]+$/ || y + 0 == 0) ? "-" : sprintf("%.2f", x / y) }
                        BEGIN { printf "| %s | %s | %s | %s | %s | %s | %s | %s |\n", c, a, l, f, w, k, ratio(w, a), ratio(k, a) }'
        done
fi
if [[ " $configs " == *" llama-q4 "* ]]; then
        echo
        echo "the precision ladder's q4 against llama.cpp's q4_0 cache (flash attention), wall-clock tokens/s in the same run:"
        echo "| context (tokens) | llama.cpp q4_0 + FA | kvc-run --local --tier q4 | kvc-run --local (f32) | ladder q4 / llama.cpp q4_0 |"
        echo "|---:|---:|---:|---:|---:|"
        for c in $contexts; do
                awk -v c="$c" -v a="${wl[$c.llama-q4]:--}" -v q="${wl[$c.local-q4]:--}" -v l="${wl[$c.local]:--}" '
                        function ratio(x, y) { return (x !~ /^[0-9.]+$/ || y !~ /^[0-9.]+$/ || y + 0 == 0) ? "-" : sprintf("%.2f", x / y) }
                        BEGIN { printf "| %s | %s | %s | %s | %s |\n", c, a, q, l, ratio(q, a) }'
        done
fi
