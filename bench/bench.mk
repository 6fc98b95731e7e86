# bench/bench.mk: the benchmarks, included by the Makefile (after its variables).
#
#   $(BUILD)/bin/kvc-load   bench/kvc-load.c: P client processes x S sessions stepping against
#                           kvcd for T seconds; steps/s, the flush (plan) round trip p50/p99,
#                           kvcd's peak RSS, errors (must be 0). Built with `make all`.
#   make load [LOAD_ARGS="-p 16 -S 16 -t 20"]
#                           runs it against a kvcd it starts for the run (--kvcd)
#   make bench              builds the programs below and runs bench/run.sh: one table per item
#                           of issue 7, every figure a ratio against a baseline measured in the
#                           same run (bench/RESULTS.md has the results and how to read them),
#                           and bench/decode.sh: SmolLM2's decode per CPU-second against llama.cpp
#
#   $(BUILD)/bench/bench-rt         summary-to-plan round trip and throughput vs bare ZeroMQ
#   $(BUILD)/bench/bench-select     plan building: radix select vs qsort vs torch.topk
#   $(BUILD)/bench/bench-compact    plan application (compact_layer) vs memcpy
#   $(BUILD)/bench/bench-footprint  kvcd's RSS: idle, per session, steady state
#   $(BUILD)/bench/bench-attn       libkvc's attention kernel vs kvc-run --local's (item 5's why)
#   $(BUILD)/bench/bench-relocate   a chunk taken back from a client: block moves vs round trip, memcpy
#   $(BUILD)/bench/bench-matmul     the engine's q4_1 matrix-vectors product: fast path vs exact, memcpy
#   $(BUILD)/bench/bench-attn-long  decode attention at SmolLM2's shape, 1K-8K tokens: the fast kernel
#                                   (AVX2, plain) vs the references, f32 / f16 / int8 (built, not in run.sh)
#   $(BUILD)/bench/kv-dump          SmolLM2's real post-RoPE queries, keys, values and attention outputs
#                                   of a few layers over a text, recorded behind a model_cache_ops wrapper
#                                   (the input of bench/quant-study.py; built, not in run.sh)
#   make quant-study        model + pydeps + kv-dump, then bench/quant-study.py: candidate KV quantizers
#                           (4, 3, 2 bits) measured on those tensors (bench/quant-study.md; about 35
#                           minutes on 2 loaded cores). QUANT_STUDY_ARGS (--stride 8) goes to the script.
#
#   make bench-long         model, then bench/long.sh (issue 17, long context): SmolLM2's decode
#                           tokens/s after 16, 1,024, 4,096 and 8,160 tokens of prompt, 1 thread:
#                           --local, and through a kvcd it starts with --policy full, window and conf
#                           at a 1,024-token budget (BUDGET=, CONTEXTS=, DECODE= override); about
#                           25 minutes on 2 loaded cores, most of it the prompts. Not in `make bench`.
#   make peers              the speed peer, llama.cpp's llama-bench (and llama-completion), under
#                           $(BUILD)/peers (bench/peers.mk, bench/get-llamacpp.sh: the sdist of
#                           llama-cpp-python==0.3.36 from PyPI, cmake + ninja; about 10 minutes on 2
#                           cores once, then nothing to do). Bench-only: `make test` never needs it.
#   make bench-peers        peers + model, then bench/llamacpp.sh (issue 17, "Speed"): kvc-run /
#                           llama.cpp on SmolLM2, interleaved rounds: decode and prompt tokens/s at 1
#                           and 2 threads, effective GB/s, kvc-run's RSS against the GGUF, and
#                           kvc-run through kvcd (--policy full) against --local. Not part of
#                           `make bench` (bench/run.sh), which stays within its 10 minutes.

LOAD_ARGS ?= -p 16 -S 16 -t 20
BENCH_DIR := $(BUILD)/bench
BENCH_COMMON := $(call obj,bench/common.c)
POLICY_OBJ := $(filter $(BUILD)/obj/daemon/policy/%,$(DAEMON_OBJ))
BENCH_PROGRAMS := $(BENCH_DIR)/bench-rt $(BENCH_DIR)/bench-select $(BENCH_DIR)/bench-compact \
	$(BENCH_DIR)/bench-footprint $(BENCH_DIR)/bench-attn $(BENCH_DIR)/bench-relocate $(BENCH_DIR)/bench-matmul \
	$(BENCH_DIR)/bench-attn-long $(BENCH_DIR)/kv-dump

.PHONY: load bench bench-programs bench-long quant-study
all: $(BUILD)/bin/kvc-load

$(BUILD)/bin/kvc-load: $(call obj,bench/kvc-load.c) $(BENCH_COMMON) $(LIB)/libkvc.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS_ZMQ) $(LDLIBS)

load: $(BUILD)/bin/kvc-load $(BUILD)/bin/kvcd
	$(BUILD)/bin/kvc-load --kvcd $(BUILD)/bin/kvcd $(LOAD_ARGS)

$(BENCH_DIR)/bench-rt $(BENCH_DIR)/bench-footprint $(BENCH_DIR)/bench-relocate: $(BENCH_DIR)/%: $(call obj,bench/%.c) $(BENCH_COMMON) $(LIB)/libkvc.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS_ZMQ) $(LDLIBS)

$(BENCH_DIR)/bench-select: $(call obj,bench/bench-select.c) $(BENCH_COMMON) $(POLICY_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS)

$(BENCH_DIR)/bench-compact: $(call obj,bench/bench-compact.c) $(BENCH_COMMON) $(KERNEL_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS)

$(BENCH_DIR)/bench-attn $(BENCH_DIR)/bench-matmul $(BENCH_DIR)/bench-attn-long $(BENCH_DIR)/kv-dump: $(BENCH_DIR)/%: $(call obj,bench/%.c) $(BENCH_COMMON) \
	$(sort $(KERNEL_OBJ) $(MODEL_OBJ))
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS)

bench-programs: all $(BENCH_PROGRAMS)

bench: deps
	@$(MAKE) --no-print-directory bench-programs
	@bench/run.sh $(BUILD)

bench-long: all model
	@bench/long.sh $(BUILD)

QUANT_STUDY_DIR ?= $(BUILD)/quant-study
QUANT_STUDY_ARGS ?= --stride 8
quant-study: model pydeps $(BENCH_DIR)/kv-dump
	@mkdir -p $(QUANT_STUDY_DIR)
	$(BENCH_DIR)/kv-dump --model $(SMOLLM2_GGUF) --text ../shared/data/tinystories/validation-sample.txt \
		--offset 400000 --tokens 2048 --out $(QUANT_STUDY_DIR)/stories.kv
	$(BENCH_DIR)/kv-dump --model $(SMOLLM2_GGUF) --text docs/operations.md \
		--tokens 2048 --out $(QUANT_STUDY_DIR)/docs.kv
	$(VENV)/bin/python bench/quant-study.py $(QUANT_STUDY_ARGS) $(QUANT_STUDY_DIR)/stories.kv $(QUANT_STUDY_DIR)/docs.kv

include bench/peers.mk
