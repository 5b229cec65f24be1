# The README's commands. Everything installs into .venv on first use. `make test` lints, then tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.expertd-installed
# Two workers (CI has 2 cores); a file's tests stay on one worker so module-scoped servers start once.
PYTEST_ARGS ?= --numprocesses=2 --dist=loadfile

.PHONY: install lint test serve bench protos clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Reinstall when the dependency list changes.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

install: $(STAMP)

# ruff (configured in pyproject.toml) over the whole tree.
lint: install
	$(BIN)/ruff check .

# Tests marked `exclusive` measure the server's timing against its own estimates, or recovery
# bounds (the failover chaos): they run after the others, alone, so that another worker's burst of
# CPU does not change the machine under them.
test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m "not exclusive"
	$(BIN)/python -m pytest -m exclusive

serve: install
	$(BIN)/expertd serve $(SERVE_ARGS)

bench: install
	@for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

# Regenerate the committed gRPC stubs with the pinned grpcio-tools.
protos: install
	$(BIN)/python -m expertd.client.protos

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
