# kvhandoff — two commands do everything on a fresh machine:
#   make demo   runs the main job
#   make test   runs the whole suite (lint, types, tests)
# Each creates/reuses the virtualenv in .venv and installs what it needs.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvhandoff-installed

.PHONY: demo test lint typecheck unit bench-planner bench-session bench-transport venv system-deps engines clean

venv: $(STAMP)

# Re-install only when the package metadata changes. The transfer engines (Mooncake,
# NIXL) are part of the default set-up so the test suite runs them for real; they
# import only where `make system-deps` has installed Mooncake's Debian packages, and
# their tests skip with a reason elsewhere.
# torch goes first and pinned: 2.13.0 resolves to the local CPU build, and anything that
# asks for torch later (transformers) then finds it satisfied instead of pulling CUDA.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q 'torch==2.13.0'
	$(BIN)/python -m pip install -q -e '.[dev,mooncake,engine]'
	$(BIN)/python -m pip install -q --no-deps 'nixl-cu12>=1.5,<2'
	@touch $@

engines: $(STAMP)

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

bench-session: $(STAMP)
	$(BIN)/kvhandoff bench session

bench-transport: $(STAMP)
	$(BIN)/kvhandoff bench transport

# Debian packages some optional transports need (Mooncake). Safe to re-run.
system-deps:
	scripts/system-deps.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
