# bench/bench.mk: the load generator, included by the Makefile (after its variables).
#
#   $(BUILD)/bin/kvc-load   bench/kvc-load.c: P client processes x S sessions stepping against
#                           kvcd for T seconds; steps/s, the flush (plan) round trip p50/p99,
#                           kvcd's peak RSS, errors (must be 0). Built with `make all`.
#   make load [LOAD_ARGS="-p 16 -S 16 -t 20"]
#                           runs it against a kvcd it starts for the run (--kvcd)

LOAD_ARGS ?= -p 16 -S 16 -t 20

.PHONY: load
all: $(BUILD)/bin/kvc-load

$(BUILD)/bin/kvc-load: $(call obj,bench/kvc-load.c) $(LIB)/libkvc.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS_ZMQ) $(LDLIBS)

load: $(BUILD)/bin/kvc-load $(BUILD)/bin/kvcd
	$(BUILD)/bin/kvc-load --kvcd $(BUILD)/bin/kvcd $(LOAD_ARGS)
