# kvhandoff — two commands do everything on a fresh machine:
#   make demo   runs the main job
#   make test   runs the whole suite (lint, types, tests)
# Each creates/reuses the virtualenv in .venv and installs what it needs.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvhandoff-installed

.PHONY: demo test lint typecheck unit bench-planner venv system-deps clean

venv: $(STAMP)

# Re-install only when the package metadata changes.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $@

demo: $(STAMP)
	$(BIN)/kvhandoff demo

test: lint typecheck unit

lint: $(STAMP)
	$(BIN)/ruff check kvhandoff tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q

bench-planner: $(STAMP)
	$(BIN)/python benchmarks/planner.py

# Debian packages some optional transports need (Mooncake). Safe to re-run.
system-deps:
	@if [ -x scripts/system-deps.sh ]; then scripts/system-deps.sh; else echo "no system packages needed"; fi

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
