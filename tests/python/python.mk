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
# make kvpress-deps: $(BUILD)/venv-kvpress, the same with the release kvpress 0.5.5 pins
# (transformers 5.2.0, kvpress itself: tests/python/kvpress-requirements.txt), for
# bench/kvpress_bench.py and for the KvcdCache tests under transformers 5.2.
#
# Both put their wheels into $(PY_WHEEL_DIR) first (pip wheel: downloaded, or built from an sdist
# such as kvpress's fire 0.6.0; a wheel already there is taken from there, not fetched again)
# and install from it alone (--no-index), so torch and the CUDA packages are fetched once for both
# venvs and every build tree: pip's own HTTP cache keeps nothing on these machines (measured:
# ~/.cache/pip stayed at 2 MB after a 3 GB install).
#
# `make test` makes venv-torch and runs tests/python/transformers.sh under it (measured here from an
# empty cache: 192 s for the whole venv, 3 GB at about 29 MB/s; docs/python.md, "CI"), and under
# venv-kvpress when that exists or with KVC_KVPRESS=1 (which then makes it first). KVC_TORCH=0
# leaves the torch tests out of `make test` (a machine without the 3 GB); they are then not run,
# not failed.
PY_WHEEL_DIR ?= $(XDG_CACHE_HOME)/kvcd/wheels
VENV_TORCH := $(BUILD)/venv-torch
VENV_TORCH_STAMP := $(VENV_TORCH)/.requirements
VENV_KVPRESS := $(BUILD)/venv-kvpress
VENV_KVPRESS_STAMP := $(VENV_KVPRESS)/.requirements

# $(call py_venv,VENV,REQUIREMENTS): makes VENV from the pins through the wheel directory
py_venv = [ -x $(1)/bin/python ] || python3 -m venv $(1); \
	mkdir -p $(PY_WHEEL_DIR) && \
	$(1)/bin/pip wheel --quiet --disable-pip-version-check -r $(2) -w $(PY_WHEEL_DIR) --find-links $(PY_WHEEL_DIR) && \
	$(1)/bin/pip install --quiet --disable-pip-version-check --no-index --find-links $(PY_WHEEL_DIR) -r $(2) && \
	cp $(2) $(1)/.requirements

.PHONY: python-deps kvpress-deps
python-deps: $(VENV_TORCH_STAMP)
kvpress-deps: $(VENV_KVPRESS_STAMP)

$(VENV_TORCH_STAMP): tests/python/torch-requirements.txt | deps
	@$(call py_venv,$(VENV_TORCH),$<)

$(VENV_KVPRESS_STAMP): tests/python/kvpress-requirements.txt | deps
	@$(call py_venv,$(VENV_KVPRESS),$<)

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
