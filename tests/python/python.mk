# tests/python/python.mk: the optional check of kvcd's vLLM-format KV events against vLLM's own
# classes, included by the Makefile.
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
