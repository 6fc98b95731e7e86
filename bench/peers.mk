# bench/peers.mk: the peers the benchmarks compare against, built and run, never part of kvcd.
# Included by bench/bench.mk. Bench-only: nothing of `make all` or `make test` depends on it.
#
#   make peers        llama.cpp's llama-bench, llama-completion and llama-perplexity under $(BUILD)/peers
#                     (bench/get-llamacpp.sh: the sdist of llama-cpp-python==0.3.36 from PyPI, its
#                     vendor/llama.cpp, cmake + ninja; about 10 minutes on 2 cores the first time,
#                     nothing to do after)
#   make bench-peers  peers + model + all, then bench/llamacpp.sh: kvc-run / llama.cpp ratios on
#                     SmolLM2 (decode, prompt, GB/s, RSS) and kvc-run through kvcd vs --local
#   make bench-tiers-peers  peers + model + all, then bench/tiers-peers.sh: llama.cpp's f16, q8_0,
#                     q4_0 and iq4_nl caches on kvc-eval tiers' documents and needles (issue 26;
#                     1-2 hours on 2 busy cores), into bench/quality/smollm2/tiers/peers.md
#   make bench-niah-peers  peers + model + kvpress-deps + all, then bench/niah-peers.sh: llama.cpp's
#                     cache types, transformers' QuantizedCache (quanto int4, int2) and kvpress's
#                     KVzip, SnapKV and StreamingLLM at 25/15/10% of the context, on the needles of
#                     kvc-eval --task niah --suite ladder (issue 27; LENGTHS, NEEDLES: 1024,2048,4096
#                     and 5 by default, some 100 CPU-minutes), into bench/quality/smollm2/ladder/peers.md

PEER_DEB_PACKAGES := cmake ninja-build

.PHONY: peers peer-deps bench-peers bench-tiers-peers bench-niah-peers

peer-deps: deps
	@$(call install_missing,$(PEER_DEB_PACKAGES))

peers: peer-deps
	@bench/get-llamacpp.sh $(BUILD)

bench-peers: peers model
	@$(MAKE) --no-print-directory all
	@KVC_SMOLLM2=$(SMOLLM2_GGUF) bench/llamacpp.sh $(BUILD)

bench-tiers-peers: peers model
	@$(MAKE) --no-print-directory all
	@KVC_SMOLLM2=$(SMOLLM2_GGUF) bench/tiers-peers.sh $(BUILD)

bench-niah-peers: peers model kvpress-deps
	@$(MAKE) --no-print-directory all
	@KVC_SMOLLM2=$(SMOLLM2_GGUF) bench/niah-peers.sh $(BUILD)
