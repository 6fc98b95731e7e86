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
# runtime packages (about 3 GB to download, 5+ GB installed; the CPU-only index of
# download.pytorch.org is not reachable from the build machines), so the venv is kept between runs
# and made again only when the pins change (the stamp is a copy of the pins, as for pydeps).
#
# `make test` runs tests/python/transformers.sh when the venv exists, or always with KVC_TORCH=1
# (which then makes the venv first). Without either it is left out of the list, not failed:
# CI does not download torch for now (3 GB on every fresh machine; docs/python.md, "transformers").
VENV_TORCH := $(BUILD)/venv-torch
VENV_TORCH_STAMP := $(VENV_TORCH)/.requirements

.PHONY: python-deps
python-deps: $(VENV_TORCH_STAMP)

$(VENV_TORCH_STAMP): tests/python/torch-requirements.txt | deps
	@[ -x $(VENV_TORCH)/bin/python ] || python3 -m venv $(VENV_TORCH)
	$(VENV_TORCH)/bin/pip install --quiet --disable-pip-version-check -r $<
	@cp $< $@

ifeq ($(KVC_TORCH),1)
test: python-deps
PYTHON_TORCH_TESTS := tests/python/transformers.sh
else
PYTHON_TORCH_TESTS := $(if $(wildcard $(VENV_TORCH_STAMP)),tests/python/transformers.sh)
endif

# make bench-transformers: bench/transformers_bench.py (KvcdCache against DynamicCache on SmolLM2,
# 4K context, one thread; about 12 minutes on the 2-core VM). Results: bench/RESULTS.md.
.PHONY: bench-transformers
bench-transformers: python-deps model
	@$(MAKE) --no-print-directory all
	$(VENV_TORCH)/bin/python bench/transformers_bench.py --build $(BUILD) $(TRANSFORMERS_BENCH_ARGS)
