# tests/fuzz/fuzz.mk: the fuzz targets, included by the Makefile (after its variables).
#
# Six targets, one file each with LLVMFuzzerTestOneInput: fuzz_wire.c (wire decoding and
# validation), fuzz_plan.c (libkvc against a hostile daemon), fuzz_model.c and fuzz_tokenizer.c
# (kvc-run's llama2.c loaders), fuzz_gguf.c (the GGUF reader and llama.c's checks), fuzz_bpe.c
# (the byte-level BPE tokenizer: hostile vocabularies and merges, GGUF tokenizer keys, and
# SmolLM2's real vocabulary when the model cache has it). Each is built twice:
#
#   $(BUILD)/fuzz/replay-TARGET   $(CC) with the project's flags (and ASan/UBSan under SAN=1),
#                                 linked with replay.c: replays the checked-in corpus
#                                 tests/fuzz/corpus/TARGET in `make test` (tests/fuzz/replay.sh,
#                                 FUZZ_REPLAY_TESTS) and `make check`
#   $(BUILD)/fuzz/fuzz-TARGET     clang -fsanitize=fuzzer,address,undefined: `make fuzz`; built by
#                                 `make tests` too, and replay.sh runs the corpus through it
#                                 once (-runs=0)
#
#   make fuzz [FUZZ_SECONDS=60] [FUZZ_TARGETS="wire plan"]
#                   runs each target for FUZZ_SECONDS on its checked-in corpus; new inputs go to
#                   $(BUILD)/fuzz/corpus/TARGET (scratch), crashes to $(BUILD)/fuzz/artifacts/.
#                   Fails when a target crashed. A crash, once fixed, goes into the checked-in
#                   corpus as crash-WHAT (minimized with -minimize_crash=1).
#   make fuzz-seeds regenerates the seed-* files of the checked-in corpora (tests/fuzz/seeds.c)
#   make fuzz-deps  installs clang and libclang-rt-14-dev when missing
#
# The checked-in corpora (under 200 files, 150 KB) hold the seeds, crash reproducers, and fuzz-*
# inputs that `make fuzz` found and that reach code the seeds do not (picked greedily by edge
# coverage from a merge control file). To keep more: build/fuzz/fuzz-T -merge=1 DIR
# build/fuzz/corpus/T into an empty DIR lists what adds coverage; copy a few, not all.
#
# protobuf-c's parser lives in libprotobuf-c, which is not instrumented, so linking the system
# library leaves the fuzzers blind to the unpack path (platform notes 4.5: cov 40 against 991).
# `make fuzz` therefore fetches Debian's protobuf-c 1.4.1 source (tests/fuzz/get-protobuf-c.sh,
# checksum pinned, into $(BUILD)/fuzz/src) and compiles protobuf-c.c into the fuzzers, ahead of
# the system library; without network it falls back to the library alone and says so. The replay
# binaries link the system library, as the programs do.

FUZZ_TARGETS ?= wire plan model tokenizer gguf bpe
FUZZ_SECONDS ?= 60
FUZZ_CC ?= clang
FUZZ_TOKENIZER ?= ../shared/models/stories260K/tok512.bin
FUZZ_DIR := $(BUILD)/fuzz
FUZZ_ALL := wire plan model tokenizer gguf bpe

FUZZ_REPLAY_BINS := $(patsubst %,$(FUZZ_DIR)/replay-%,$(FUZZ_ALL))
FUZZ_REPLAY_TESTS := tests/fuzz/replay.sh
FUZZ_BINS := $(patsubst %,$(FUZZ_DIR)/fuzz-%,$(FUZZ_ALL))

.PHONY: fuzz fuzz-build fuzz-seeds fuzz-deps

# `make tests` (hence `make test` and `make check`) builds the replay binaries and every libFuzzer
# target too, so a target that stops linking fails the build (issue 28); tests/fuzz/replay.sh runs
# the corpora through both.
tests: $(FUZZ_REPLAY_BINS) $(FUZZ_BINS)

# ---- replay binaries: the project's compiler and flags ----

FUZZ_REPLAY_MAIN := $(call obj,tests/fuzz/replay.c)
$(FUZZ_DIR)/replay-wire: $(call obj,tests/fuzz/fuzz_wire.c) $(PROTO_OBJ)
$(FUZZ_DIR)/replay-plan: $(call obj,tests/fuzz/fuzz_plan.c) $(LIB)/libkvc.a
$(FUZZ_DIR)/replay-model: $(call obj,tests/fuzz/fuzz_model.c) $(MODEL_OBJ)
$(FUZZ_DIR)/replay-gguf: $(call obj,tests/fuzz/fuzz_gguf.c) $(MODEL_OBJ)
$(FUZZ_DIR)/replay-bpe: $(call obj,tests/fuzz/fuzz_bpe.c) $(MODEL_OBJ)
$(FUZZ_DIR)/replay-tokenizer: $(call obj,tests/fuzz/fuzz_tokenizer.c) $(BUILD)/obj/client/engine/tokenizer.o
$(FUZZ_DIR)/replay-%: $(FUZZ_REPLAY_MAIN)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $(filter %.o,$^) $(filter %.a,$^) -o $@ $(LDLIBS_ZMQ) $(LDLIBS)

# ---- libFuzzer binaries: clang, everything they run compiled with coverage and sanitizers ----

PROTOBUF_C_SRC ?= $(FUZZ_DIR)/src/protobuf-c-1.4.1/protobuf-c/protobuf-c.c
FUZZ_SAN := -fsanitize=address,undefined -fno-sanitize-recover=undefined
FUZZ_CFLAGS := -std=gnu11 -g -O1 -fno-omit-frame-pointer -Wall -Wextra -Wno-unused-parameter \
	-Wno-missing-field-initializers \
	$(INCLUDES) $(FUZZ_SAN) -fsanitize=fuzzer-no-link -MMD -MP
fuzz_obj = $(patsubst %.c,$(FUZZ_DIR)/obj/%.o,$(1))
FUZZ_GEN_OBJ := $(FUZZ_DIR)/obj/gen/kvc.pb-c.o
FUZZ_PROTOBUF_OBJ := $(FUZZ_DIR)/obj/protobuf-c.o
# the same sources as the Makefile's object lists, so a file added to libkvc is fuzzed too
fuzz_src_of = $(patsubst $(BUILD)/obj/%.o,%.c,$(filter-out $(GEN_OBJ),$(1)))
FUZZ_PROTO_OBJ := $(call fuzz_obj,$(call fuzz_src_of,$(PROTO_OBJ))) $(FUZZ_GEN_OBJ) $(FUZZ_PROTOBUF_OBJ)
FUZZ_LIBKVC_OBJ := $(call fuzz_obj,$(call fuzz_src_of,$(LIBKVC_OBJ))) $(FUZZ_GEN_OBJ) $(FUZZ_PROTOBUF_OBJ)

$(FUZZ_DIR)/obj/%.o: %.c | $(GEN_H) fuzz-deps
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -c $< -o $@

$(FUZZ_GEN_OBJ): $(GEN) | fuzz-deps
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -c $< -o $@

# Without network the source is a placeholder and the fuzzers use the system library, linked
# after it in any case (delete the placeholder to try again).
$(PROTOBUF_C_SRC):
	@tests/fuzz/get-protobuf-c.sh $(FUZZ_DIR)/src || { mkdir -p $(dir $@) && \
		echo "/* no protobuf-c source: the system libprotobuf-c is used (not coverage-guided) */" >$@ && \
		echo "fuzz: no protobuf-c source: linking the system libprotobuf-c (its parser is not coverage-guided)"; }

# protobuf-c 1.4.1 itself has three benign undefined behaviours the fuzzers hit in seconds, all
# known upstream and none an invalid access: a signed left shift in parse_tag_and_wiretype
# (protobuf-c issue 506, PR 794), `desc->fields + 0` on the NULL field table of an empty message,
# and memcpy(out, NULL, 0) for empty bytes (PR 794). They are not checked in its object only.
$(FUZZ_DIR)/obj/protobuf-c.o: $(PROTOBUF_C_SRC) | fuzz-deps
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fno-sanitize=shift,pointer-overflow,nonnull-attribute -w -c $< -o $@

$(FUZZ_DIR)/fuzz-wire: $(call fuzz_obj,tests/fuzz/fuzz_wire.c) $(FUZZ_PROTO_OBJ)
$(FUZZ_DIR)/fuzz-plan: $(call fuzz_obj,tests/fuzz/fuzz_plan.c) $(FUZZ_LIBKVC_OBJ)
# the engine's objects as the Makefile lists them (MODEL_OBJ: the engine and the CPU kernels its
# --local cache runs), so a kernel the engine starts to call is linked here too (issue 28: these
# two named MODEL_SRC only and stopped linking when model.c began to call attention.c)
FUZZ_MODEL_OBJ := $(call fuzz_obj,$(call fuzz_src_of,$(MODEL_OBJ)))
$(FUZZ_DIR)/fuzz-model: $(call fuzz_obj,tests/fuzz/fuzz_model.c) $(FUZZ_MODEL_OBJ)
$(FUZZ_DIR)/fuzz-gguf: $(call fuzz_obj,tests/fuzz/fuzz_gguf.c) $(FUZZ_MODEL_OBJ)
# the tokenizer and what it reads (not the whole engine: the fuzzer need not build the products)
$(FUZZ_DIR)/fuzz-bpe: $(call fuzz_obj,tests/fuzz/fuzz_bpe.c $(addprefix client/engine/,bpe.c gguf.c qtype.c unicode_tables.c))
$(FUZZ_DIR)/fuzz-tokenizer: $(call fuzz_obj,tests/fuzz/fuzz_tokenizer.c client/engine/tokenizer.c)
$(FUZZ_DIR)/fuzz-%:
	@mkdir -p $(dir $@)
	$(FUZZ_CC) -fsanitize=fuzzer $(FUZZ_SAN) $(sort $^) -o $@ -lzmq -lprotobuf-c $(LDLIBS)

fuzz-build: $(patsubst %,$(FUZZ_DIR)/fuzz-%,$(FUZZ_TARGETS))

fuzz-deps:
	@$(call install_missing,clang libclang-rt-14-dev)

fuzz: fuzz-build
	@tests/fuzz/run.sh $(BUILD) $(FUZZ_SECONDS) $(FUZZ_TARGETS)

fuzz-seeds: $(FUZZ_DIR)/kvc-fuzz-seeds
	$(FUZZ_DIR)/kvc-fuzz-seeds tests/fuzz/corpus $(FUZZ_TOKENIZER)

$(FUZZ_DIR)/kvc-fuzz-seeds: $(call obj,tests/fuzz/seeds.c) $(PROTO_OBJ) $(BUILD)/obj/kernels/block.o
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS_ZMQ) $(LDLIBS)

-include $(shell find $(FUZZ_DIR)/obj -name '*.d' 2>/dev/null)
