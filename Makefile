# Makefile: the one build entry of kvcd.
#
#   make            build kvcd, kvcctl, kvc-run and libkvc into build/
#   make deps       install the Debian packages the build and the tests need (only what is missing)
#   make test       deps + build + every test; ends with "N passed, M failed"
#   make check      the same tests built with AddressSanitizer and UndefinedBehaviorSanitizer
#   make demo       start kvcd in a temporary runtime directory, run kvc-run on the real model, stop
#   make quality    the quality lab: every policy on the real model, table and plots in bench/quality
#   make quality-plots  only the plots, from the committed bench/quality/results.csv (seconds)
#   make quality-smol  the real-model suite on SmolLM2 (needle in a haystack), docs/quality.md
#   make cuda       the CUDA kernels (CUDA=1; default on when nvcc is found)
#   make install    into $(DESTDIR)$(PREFIX): programs, libkvc (libkvc.so.0.2.0 with its soname link
#                   libkvc.so.0 and libkvc.so; libkvc.a), kvc.pc, kvc.h, man pages, systemd units
#
# Builds go to $(BUILD) (build/, or build/san for `make check`). No probing of the host beyond
# looking for nvcc.

BUILD ?= build
PREFIX ?= /usr/local
CC ?= gcc
NVCC ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA ?= $(if $(NVCC),1,0)

SAN_FLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
OPT ?= -O2
CFLAGS_BASE := -std=gnu11 $(OPT) -g -fPIC -ffp-contract=off -Wall -Wextra -Werror -Wshadow \
	-Wno-missing-field-initializers -Wno-format-truncation $(if $(SAN),$(SAN_FLAGS))
# client/ sees proto/, kernels/ and its own folders, never daemon/ (DESIGN: the client does not depend
# on the daemon): a client file that includes a daemon header does not build.
CLIENT_INCLUDES := -I$(BUILD)/gen -Iproto -Ikernels -Iclient/lib -Iclient/engine
INCLUDES := $(CLIENT_INCLUDES) -Idaemon
$(BUILD)/obj/client/%.o: INCLUDES := $(CLIENT_INCLUDES)
CFLAGS += $(CFLAGS_BASE) $(INCLUDES) -MMD -MP
LDFLAGS += $(if $(SAN),$(SAN_FLAGS))
LDLIBS_ZMQ := -lzmq -lprotobuf-c
LDLIBS := -lm

# prometheus: for promtool, which tests/integration/test_metrics.c runs on the metrics texts
DEB_PACKAGES := build-essential pkg-config libzmq3-dev libprotobuf-c-dev protobuf-c-compiler \
	libsystemd-dev libcmocka-dev libmicrohttpd-dev systemd prometheus

# msgpack-c (libmsgpack-dev, 4.0 on Debian 12): kvcd's vLLM-format KV events (daemon/events_vllm.c).
# Linked into kvcd and the unit tests only: libkvc and the clients do not need it.
DEB_PACKAGES += libmsgpack-dev
LDLIBS_MSGPACK := -lmsgpackc

GEN := $(BUILD)/gen/kvc.pb-c.c
GEN_H := $(BUILD)/gen/kvc.pb-c.h
PROTO_SRC := proto/wire.c proto/fdwire.c
KERNEL_SRC := kernels/block.c kernels/compact.c kernels/attention.c kernels/summary.c kernels/cpu.c \
	$(wildcard kernels/quant.c kernels/mixed.c) kernels/summarize.c kernels/cuda/driver.c \
	kernels/tier.c kernels/lloyd.c kernels/ladder.c
DAEMON_SRC := $(wildcard daemon/*.c daemon/policy/*.c)
LIBKVC_SRC := $(wildcard client/lib/*.c)
MODEL_SRC := $(wildcard client/engine/*.c)

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))
GEN_OBJ := $(BUILD)/obj/gen/kvc.pb-c.o
PROTO_OBJ := $(call obj,$(PROTO_SRC)) $(GEN_OBJ)
KERNEL_OBJ := $(call obj,$(KERNEL_SRC))
DAEMON_OBJ := $(call obj,$(DAEMON_SRC))
LIBKVC_OBJ := $(call obj,$(LIBKVC_SRC)) $(PROTO_OBJ) $(KERNEL_OBJ)
# the engine's in-process cache (--local) runs the CPU attention kernel: its objects come along
MODEL_OBJ := $(call obj,$(MODEL_SRC)) $(call obj,kernels/attention.c kernels/mixed.c kernels/block.c \
	kernels/quant.c kernels/compact.c kernels/cpu.c kernels/tier.c kernels/lloyd.c kernels/ladder.c)

BIN := $(BUILD)/bin
LIB := $(BUILD)/lib
PROGRAMS := $(BIN)/kvcd $(BIN)/kvcctl $(BIN)/kvc-run $(BIN)/kvc-eval
UNIT_TESTS := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(wildcard tests/unit/test_*.c))
INTEGRATION_TESTS := $(patsubst tests/integration/%.c,$(BUILD)/tests/%,$(wildcard tests/integration/test_*.c))
HARNESS_OBJ := $(call obj,tests/integration/harness.c tests/integration/rawpeer.c tests/integration/sdharness.c)

.PHONY: all deps test test-c check demo cuda install clean tests quality quality-deps quality-plots quality-smol quality-smol-long quality-longdoc \
	quality-longgen quality-mechanism
.SECONDARY:
.DEFAULT_GOAL := all

# libkvc's version (the daemon's, daemon/kvcd.h) and its soname's major: the build and the install
# lay out libkvc.so.$(KVC_VERSION) (the file), libkvc.so.$(KVC_SOVERSION) (the soname, which a
# program linked with -lkvc asks the loader for) and libkvc.so (the link-time name) the same way.
KVC_VERSION := $(shell sed -n 's/^\#define KVCD_VERSION *"\(.*\)"/\1/p' daemon/kvcd.h)
KVC_SOVERSION := $(firstword $(subst ., ,$(KVC_VERSION)))
LIBKVC_SO := $(LIB)/libkvc.so.$(KVC_VERSION)
LIBDIR ?= $(PREFIX)/lib

all: $(PROGRAMS) $(LIB)/libkvc.a $(LIB)/libkvc.so $(LIB)/libkvc.so.$(KVC_SOVERSION) $(LIB)/pkgconfig/kvc.pc

# $(call install_missing,PACKAGES): the Debian packages of the list that are not installed, with
# apt-get (as root; otherwise it says which and fails). deps, fuzz-deps and peer-deps use it.
install_missing = missing=""; for p in $(1); do \
		dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		if [ "$$(id -u)" != 0 ]; then echo "run as root, or: sudo apt-get install$$missing" >&2; exit 1; fi; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

deps:
	@$(call install_missing,$(DEB_PACKAGES))

$(GEN) $(GEN_H): proto/kvc.proto
	@mkdir -p $(BUILD)/gen
	protoc-c --c_out=$(BUILD)/gen -Iproto proto/kvc.proto

$(BUILD)/obj/%.o: %.c | $(GEN_H)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(GEN_OBJ): $(GEN)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Wno-unused-parameter -c $< -o $@

$(LIB)/libkvc.a: $(LIBKVC_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(LIBKVC_SO): $(LIBKVC_OBJ)
	@mkdir -p $(dir $@)
	$(CC) -shared $(LDFLAGS) -Wl,-soname,libkvc.so.$(KVC_SOVERSION) $^ -o $@ $(LDLIBS_ZMQ) $(LDLIBS)

$(LIB)/libkvc.so.$(KVC_SOVERSION): $(LIBKVC_SO)
	ln -sfn $(notdir $<) $@

$(LIB)/libkvc.so: $(LIB)/libkvc.so.$(KVC_SOVERSION)
	ln -sfn $(notdir $<) $@

# kvc.pc for the install (pkg-config --cflags --libs kvc); PREFIX and LIBDIR are those of the build
# that made it, so `make install PREFIX=...` remakes it when they change.
$(LIB)/pkgconfig/kvc.pc: client/lib/kvc.pc.in daemon/kvcd.h $(LIB)/.prefix-$(subst /,_,$(PREFIX)$(LIBDIR))
	@mkdir -p $(dir $@)
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@LIBDIR@|$(LIBDIR)|g' -e 's|@VERSION@|$(KVC_VERSION)|g' $< > $@

$(LIB)/.prefix-%:
	@mkdir -p $(dir $@)
	rm -f $(LIB)/.prefix-* && touch $@

$(BIN)/kvcd: $(DAEMON_OBJ) $(PROTO_OBJ) $(KERNEL_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS_ZMQ) -lsystemd -lmicrohttpd $(LDLIBS_MSGPACK) $(LDLIBS)

$(BIN)/kvcctl: $(call obj,client/kvcctl.c) $(LIB)/libkvc.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS_ZMQ) $(LDLIBS)

$(BIN)/kvc-run: $(call obj,client/kvc-run.c) $(MODEL_OBJ) $(LIB)/libkvc.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS_ZMQ) $(LDLIBS)

# kvc-eval's parts by concern (client/eval/: statistics, tasks)
EVAL_SRC := $(wildcard client/eval/*.c)
$(BIN)/kvc-eval: $(call obj,client/kvc-eval.c) $(call obj,$(EVAL_SRC)) $(MODEL_OBJ) $(LIB)/libkvc.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS_ZMQ) $(LDLIBS)

# Unit tests link what they test directly; integration tests drive the real binaries.
TEST_LIBS := $(LIB)/libkvc.a
# the engine (client/engine/): every object, since a GGUF model pulls in the reader, types and threads
$(BUILD)/tests/test_model $(BUILD)/tests/test_gguf $(BUILD)/tests/test_bpe $(BUILD)/tests/test_smollm2 \
	$(BUILD)/tests/test_laddercache $(BUILD)/tests/test_importance: $(MODEL_OBJ)
$(BUILD)/tests/test_pool $(BUILD)/tests/test_notify $(BUILD)/tests/test_replay: $(filter-out $(BUILD)/obj/daemon/main.o,$(DAEMON_OBJ))
$(BUILD)/tests/test_policy $(BUILD)/tests/test_ladder_policy: $(filter-out $(BUILD)/obj/daemon/main.o,$(DAEMON_OBJ))
$(BUILD)/tests/test_stats: $(call obj,client/eval/stats.c)
$(BUILD)/tests/test_cuda_backend: $(filter-out $(BUILD)/obj/daemon/main.o,$(DAEMON_OBJ))
$(BUILD)/tests/test_events: $(call obj,daemon/events_vllm.c daemon/events_ring.c)
$(BUILD)/tests/test_budget $(BUILD)/tests/test_gather $(BUILD)/tests/test_prefix: $(filter-out $(BUILD)/obj/daemon/main.o,$(DAEMON_OBJ)) \
	$(call obj,tests/unit/sim.c)
$(BUILD)/tests/%: $(BUILD)/obj/tests/unit/%.o $(TEST_LIBS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $(filter %.o,$^) $(TEST_LIBS) -o $@ -lcmocka -lsystemd -lmicrohttpd $(LDLIBS_ZMQ) $(LDLIBS_MSGPACK) $(LDLIBS)

$(BUILD)/tests/test_%: $(BUILD)/obj/tests/integration/test_%.o $(HARNESS_OBJ) $(TEST_LIBS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $(filter %.o,$^) $(TEST_LIBS) -o $@ -lcmocka $(LDLIBS_ZMQ) $(LDLIBS)

tests: all $(UNIT_TESTS) $(INTEGRATION_TESTS) $(if $(filter 1,$(CUDA)),cuda) cuda-emu

# The CUDA kernels run on the CPU under tests/gpu/emu as one more test program (any machine).
test: deps model
	@$(MAKE) --no-print-directory tests
	@tests/run.sh $(BUILD) $(UNIT_TESTS) $(INTEGRATION_TESTS) tests/engine/dequant.sh tests/gpu/emulate.sh tests/gpu/ipc_fake.sh tests/systemd/verify.sh tests/systemd/man.sh tests/python/run.sh tests/systemd/deploy.sh tests/python/binding.sh $(PYTHON_TORCH_TESTS) \
		$(FUZZ_REPLAY_TESTS)

# make test-c: the C programs of `make test` alone (unit, integration, the fuzz corpora replayed):
# no Python environment and no torch; 4 minutes of `make test`'s 13 or more (README).
test-c: deps model
	@$(MAKE) --no-print-directory tests
	@tests/run.sh $(BUILD) $(UNIT_TESTS) $(INTEGRATION_TESTS) $(FUZZ_REPLAY_TESTS)

check: deps
	@$(MAKE) --no-print-directory BUILD=build/san SAN=1 OPT=-O1 tests
	@ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
		tests/run.sh build/san $(patsubst $(BUILD)/%,build/san/%,$(UNIT_TESTS) $(INTEGRATION_TESTS)) \
		$(FUZZ_REPLAY_TESTS)

demo: deps model
	@$(MAKE) --no-print-directory all
	@client/demo.sh $(BUILD)

quality-deps: deps
	@dpkg -s gnuplot-nox >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gnuplot-nox >/dev/null; }

QUALITY_SEQUENCES ?= 64
quality: quality-deps
	@$(MAKE) --no-print-directory all
	@bench/quality.sh $(BUILD) $(QUALITY_SEQUENCES)

quality-plots: quality-deps
	@bench/quality.sh --plot
# the real-model suite (docs/quality.md): the needle task on SmolLM2; 4 needles a length should fit
# an hour on 2 idle cores (the committed 5-needle run took 100 minutes on 2 shared ones).
# QUALITY_SMOL_OUT=bench/quality/smollm2 writes the committed results (default: a new build/quality-smol/DATE).
QUALITY_SMOL_ARGS ?= --lengths 1024,2048,4096 --needles 4 --fractions 0.25,0.5
QUALITY_SMOL_OUT ?=
quality-smol: quality-deps model
	@$(MAKE) --no-print-directory all
	@SMOLLM2=$(SMOLLM2_GGUF) bench/quality-smol.sh $(BUILD) "$(QUALITY_SMOL_OUT)" -- $(QUALITY_SMOL_ARGS)
quality-smol-long: quality-deps model
	@$(MAKE) --no-print-directory all
	@SMOLLM2=$(SMOLLM2_GGUF) bench/quality-smol.sh $(BUILD) "$(QUALITY_SMOL_OUT)" -- \
		--lengths 1024,2048,4096,8000 --needles 10 --fractions 0.25,0.5
# long generation (SCOPE's setting) and the mechanism (confidence vs attention against what a window
# costs) on SmolLM2, at the sizes bench/quality/smollm2/ was measured at (about 15 CPU-minutes each).
QUALITY_LONGGEN_ARGS ?= --lengths 256 --prompts 4 --gen-tokens 768 --fractions 0.35,0.5 --threads 1
QUALITY_MECHANISM_ARGS ?= --lengths 2048 --documents 5 --fractions 0.0625,0.25 --threads 1
# long documents: perplexity, KL and the gap-closed, gate and correction targets at 4K
QUALITY_LONGDOC_ARGS ?= --lengths 4096 --documents 4 --fractions 0.25,0.5
quality-longgen: model
	@$(MAKE) --no-print-directory all
	@QUALITY_TASK=longgen SMOLLM2=$(SMOLLM2_GGUF) bench/quality-smol.sh $(BUILD) "$(QUALITY_SMOL_OUT)" -- \
		$(QUALITY_LONGGEN_ARGS)
quality-mechanism: model
	@$(MAKE) --no-print-directory all
	@QUALITY_TASK=mechanism SMOLLM2=$(SMOLLM2_GGUF) bench/quality-smol.sh $(BUILD) "$(QUALITY_SMOL_OUT)" -- \
		$(QUALITY_MECHANISM_ARGS)
quality-longdoc: model
	@$(MAKE) --no-print-directory all
	@QUALITY_TASK=longdoc SMOLLM2=$(SMOLLM2_GGUF) bench/quality-smol.sh $(BUILD) "$(QUALITY_SMOL_OUT)" -- \
		$(QUALITY_LONGDOC_ARGS)

include kernels/cuda.mk
include tests/fuzz/fuzz.mk
include bench/bench.mk
include client/engine/engine.mk
include tests/python/python.mk
ifneq ($(CUDA),1)
cuda:
	@echo "CUDA=0: nvcc not found, the CUDA kernels are not built"
endif

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(LIBDIR)/pkgconfig $(DESTDIR)$(PREFIX)/include
	install -m 0755 $(PROGRAMS) $(BUILD)/bin/kvc-load $(DESTDIR)$(PREFIX)/bin/
	install -m 0644 $(LIB)/libkvc.a $(DESTDIR)$(LIBDIR)/
	install -m 0755 $(LIBKVC_SO) $(DESTDIR)$(LIBDIR)/
	ln -sfn libkvc.so.$(KVC_VERSION) $(DESTDIR)$(LIBDIR)/libkvc.so.$(KVC_SOVERSION)
	ln -sfn libkvc.so.$(KVC_SOVERSION) $(DESTDIR)$(LIBDIR)/libkvc.so
	install -m 0644 $(LIB)/pkgconfig/kvc.pc $(DESTDIR)$(LIBDIR)/pkgconfig/
	install -D -m 0644 -t $(DESTDIR)$(PREFIX)/share/man/man1 man/kvcctl.1 man/kvc-run.1 man/kvc-eval.1 \
		man/kvc-load.1
	install -D -m 0644 -t $(DESTDIR)$(PREFIX)/share/man/man8 man/kvcd.8
	install -m 0644 client/lib/kvc.h $(DESTDIR)$(PREFIX)/include/
	install -d $(DESTDIR)$(PREFIX)/lib/systemd/system $(DESTDIR)$(PREFIX)/lib/sysusers.d
	sed 's|/usr/local/bin/kvcd|$(PREFIX)/bin/kvcd|' systemd/kvcd.service > $(DESTDIR)$(PREFIX)/lib/systemd/system/kvcd.service
	install -m 0644 systemd/kvcd.socket systemd/kvcd-admin.socket $(DESTDIR)$(PREFIX)/lib/systemd/system/
	install -m 0644 systemd/kvcd.sysusers $(DESTDIR)$(PREFIX)/lib/sysusers.d/kvcd.conf
	install -D -m 0644 systemd/kvcd.tmpfiles $(DESTDIR)$(PREFIX)/lib/tmpfiles.d/kvcd.conf

clean:
	rm -rf build

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
