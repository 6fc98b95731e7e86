# tests/python/python.mk: the optional Python environments, included by the Makefile: the check of
# kvcd's vLLM-format KV events against vLLM's own classes, and the torch venv of kvcd.transformers.
#
#   make vllm-events   pip download of the vllm wheel pinned with its sha256 in
#                      tests/python/vllm-requirements.txt (no dependencies, nothing installed)
#                      into $(VLLM_WHEEL_DIR), and vllm/distributed/kv_events.py extracted from it
#                      into $(BUILD)/vllm/. tests/python/test_events_vllm.py then decodes every
#                      message with vLLM's classes too; without it that one test is skipped.
#
# Not part of `make test`: 436 MB for one 15 KB file. Nothing is downloaded at test time.

VLLM_WHEEL_DIR ?= $(XDG_CACHE_HOME)/kvcd/wheels
VLLM_KV_EVENTS := $(BUILD)/vllm/kv_events.py

.PHONY: vllm-events
vllm-events: $(VLLM_KV_EVENTS)

$(VLLM_KV_EVENTS): tests/python/vllm-requirements.txt | pydeps
	@mkdir -p $(VLLM_WHEEL_DIR) $(dir $@)
	$(VENV)/bin/pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
		--require-hashes -r $< -d $(VLLM_WHEEL_DIR)
	$(VENV)/bin/python -c 'import sys, zipfile; \
		open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read("vllm/distributed/kv_events.py"))' \
		$(VLLM_WHEEL_DIR)/vllm-0.10.2-cp38-abi3-manylinux1_x86_64.whl $@

# make python-deps: $(BUILD)/venv-torch, the environment of kvcd.transformers' tests and bench
# (torch, transformers 5.x, gguf, accelerate, numpy, pytest: tests/python/torch-requirements.txt),
# separate from $(BUILD)/venv (`make pydeps`), which stays light. PyPI's torch wheel pulls the CUDA
# runtime packages (about 3 GB to download, 5.6 GB installed; the CPU-only index of
# download.pytorch.org is not reachable from the build machines), so the venv is kept between runs
# and made again only when the pins change (the stamp is a copy of the pins, as for pydeps).
#
# make kvpress-deps: $(BUILD)/venv-kvpress, the release kvpress 0.5.5 pins (transformers 5.2.0,
# kvpress itself: tests/python/kvpress-requirements.txt), for bench/kvpress_bench.py and the
# KvcdCache tests under transformers 5.2. It starts as a hard-linked copy of venv-torch's
# site-packages (same torch 2.15.0: nothing of torch is downloaded or unpacked again), then pip
# installs the pins over it (transformers 5.2.0 replaces the copy's 5.24.0 in venv-kvpress only:
# pip unlinks the copy's files, venv-torch keeps its own). pip's HTTP cache keeps nothing on these
# machines (~/.cache/pip stayed at 2 MB after the 3 GB install), so this is how torch is fetched
# once for both.
#
# `make test` makes venv-torch and runs tests/python/transformers.sh under it (`make python-deps`
# from an empty cache took 192 s here; docs/python.md, "CI"); KVC_TORCH=0 leaves the torch tests
# out (then not run, not failed). The same tests under transformers 5.2
# (tests/python/transformers-5.2.sh) run when venv-kvpress exists, or with KVC_KVPRESS=1, which
# makes it first.
VENV_TORCH := $(BUILD)/venv-torch
VENV_TORCH_STAMP := $(VENV_TORCH)/.requirements
VENV_KVPRESS := $(BUILD)/venv-kvpress
VENV_KVPRESS_STAMP := $(VENV_KVPRESS)/.requirements

.PHONY: python-deps kvpress-deps
python-deps: $(VENV_TORCH_STAMP)
kvpress-deps: $(VENV_KVPRESS_STAMP)

$(VENV_TORCH_STAMP): tests/python/torch-requirements.txt | deps
	@[ -x $(VENV_TORCH)/bin/python ] || python3 -m venv $(VENV_TORCH)
	@echo "python-deps: torch and transformers into $(VENV_TORCH), quietly: about 3 GB, 3 to 13 minutes," \
		"once (make test KVC_TORCH=0 goes without)"
	$(VENV_TORCH)/bin/pip install --quiet --disable-pip-version-check -r $<
	@cp $< $@

$(VENV_KVPRESS_STAMP): tests/python/kvpress-requirements.txt $(VENV_TORCH_STAMP) | deps
	rm -rf $(VENV_KVPRESS) && python3 -m venv --without-pip $(VENV_KVPRESS)
	cp -al $(VENV_TORCH)/lib/python3*/site-packages/. $(VENV_KVPRESS)/lib/python3*/site-packages/
	$(VENV_KVPRESS)/bin/python -m pip install --quiet --disable-pip-version-check -r $<
	@cp $< $@

ifneq ($(KVC_TORCH),0)
test: python-deps
PYTHON_TORCH_TESTS := tests/python/transformers.sh
endif
ifeq ($(KVC_KVPRESS),1)
test: kvpress-deps
PYTHON_TORCH_TESTS += tests/python/transformers-5.2.sh
else
PYTHON_TORCH_TESTS += $(if $(wildcard $(VENV_KVPRESS_STAMP)),tests/python/transformers-5.2.sh)
endif

# make bench-transformers: bench/transformers_bench.py (KvcdCache against DynamicCache on SmolLM2,
# 4K context, one thread; about 12 minutes on the 2-core VM). Results: bench/RESULTS.md.
.PHONY: bench-transformers
bench-transformers: python-deps model
	@$(MAKE) --no-print-directory all
	$(VENV_TORCH)/bin/python bench/transformers_bench.py --build $(BUILD) $(TRANSFORMERS_BENCH_ARGS)

# make bench-kvpress: bench/kvpress_bench.py (kvpress 0.5.5's presses against kvcd's policies on
# niah.c's needles, SmolLM2, float32, one thread) in venv-kvpress. Results: bench/RESULTS.md,
# "kvpress". KVPRESS_BENCH_ARGS: e.g. --length 4096 --needles 6.
.PHONY: bench-kvpress
bench-kvpress: kvpress-deps model
	@$(MAKE) --no-print-directory all
	$(VENV_KVPRESS)/bin/python bench/kvpress_bench.py --build $(BUILD) $(KVPRESS_BENCH_ARGS)
