"""Pytest fixtures for real SGLang servers (``tests/e2e/test_sglang.py``; lab only).

The servers start once per test session: per model, one colocated reference and one PD
deployment (prefill + decode + sglang-router) per transfer backend, all booting at once
(:func:`kvhandoff.lab.sglang.rig.deployments`; boots are the bulk of the time on a
small host, and they overlap). pytest keeps one parameter of a session fixture alive at
a time, so one model's servers run at once (five SGLang servers and two routers).
Adding a name to :data:`BACKENDS` adds its rows to every test that uses
:func:`deployment`.

A test module imports the fixtures it uses. Without the SGLang venv they skip, saying
to run ``make sglang-venv`` (in CI, where ``make test`` builds it, they fail instead).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvhandoff.lab.sglang import ledger, rig
from kvhandoff.lab.sglang.client import Answer, stream
from kvhandoff.lab.sglang.env import sglang_python, venv_hint
from kvhandoff.lab.sglang.models import END_TO_END, MODELS
from kvhandoff.lab.sglang.rig import Deployment, Reference
from kvhandoff.lab.sglang.rig import deployments as start_deployments
from kvhandoff.lab.sglang.rig import reference as start_reference

__all__ = [
    "BACKENDS",
    "BOOT_ONLY",
    "CONTROL",
    "MAX_NEW_TOKENS",
    "MODEL_NAMES",
    "PROMPT_LENGTHS",
    "STATE_TYPES",
    "Run",
    "backend",
    "backends_for",
    "deployment",
    "deselect_uncovered",
    "expected_bytes",
    "model",
    "model_deployments",
    "prompts",
    "reference",
    "reference_tokens",
    "runs",
    "sglang_logs",
    "sglang_or_skip",
    "shape",
]

BACKENDS: list[str] = list(rig.BACKENDS)
"""The transfer backends every PD row runs over (:data:`kvhandoff.lab.sglang.rig.BACKENDS`:
the kvhandoff backend joins there)."""

CONTROL = ("llama", "mooncake_tcp")
"""SGLang's own backend runs one model, the rig's control (the same prompts, tokens and byte
counts as kvhandoff's rows prove the rig itself right); kvhandoff runs every model."""


def backends_for(model: str) -> list[str]:
    """The backends ``model``'s deployments run over (see :data:`CONTROL`)."""
    return [b for b in BACKENDS if b == "kvhandoff" or (model, b) == CONTROL]


def deselect_uncovered(items: list[pytest.Item]) -> tuple[list[pytest.Item], list[pytest.Item]]:
    """(kept, deselected) of ``items``: a row whose (model, backend) has no deployment
    (:func:`backends_for`) is deselected, not skipped — it is not part of the suite."""
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        model_, backend_ = params.get("model"), params.get("backend")
        uncovered = (model_ is not None and backend_ is not None
                     and backend_ not in backends_for(str(model_)))
        (dropped if uncovered else kept).append(item)
    return kept, dropped


MODEL_NAMES: list[str] = list(END_TO_END)
"""The tiny models SGLang can generate with on CPU: Llama (MHA), Mellum (SWA), DeepSeek-V2 (MLA)."""

PROMPT_LENGTHS: tuple[int, ...] = (5, 37, 300, 700, 1500)
"""Prompt tokens: shorter than Mellum's window, longer, 512+, and 1500 (two chunks of
prefill: ``--chunked-prefill-size 1024``, so the KV leaves in two sends)."""

MAX_NEW_TOKENS = 12

BOOT_ONLY: list[str] = [n for n, m in MODELS.items() if not m.forward]
"""Models SGLang boots and builds pools for on CPU but cannot run a forward pass with."""

STATE_TYPES: dict[str, tuple[str, ...]] = {
    "llama": (), "mellum": ("swa",), "deepseek_v2": (), "nemotron_h": ("mamba",),
    "deepseek_v32": ("dsa",)}
"""The state components each model's pools register with SGLang's transfer manager
(besides the KV buffers and aux)."""


def sglang_or_skip() -> Path:
    """The SGLang venv's interpreter, or skip (fail in CI) when it is missing."""
    py = sglang_python()
    if not py.exists():
        if os.environ.get("CI"):
            pytest.fail(venv_hint(py))
        pytest.skip(venv_hint(py))
    return py


def prompts() -> dict[str, tuple[int, ...]]:
    """The prompts, by name (``p<length>``): fixed random token ids (seed 0)."""
    rng = random.Random(0)
    vocab = int(MODELS["llama"].sizes["vocab_size"])
    return {f"p{n}": tuple(rng.randrange(3, vocab) for _ in range(n)) for n in PROMPT_LENGTHS}


def expected_bytes(model: str, prompt_tokens: int) -> dict[str, int]:
    """The bytes each component must carry for one request, from the model's sizes alone
    (bf16, page size 1): every prompt token's KV in each full-attention layer (MLA: the
    latent row), and in each sliding layer the last ``window - 1`` tokens (what decode's
    next token attends to besides itself). The aux row is SGLang's own and not counted."""
    cfg = MODELS[model].sizes
    n_layers = int(cfg["num_hidden_layers"])
    if "kv_lora_rank" in cfg:  # MLA: one latent row (compressed KV + rope key) per layer
        latent = int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])
        return {"kv": prompt_tokens * n_layers * latent * 2}
    per_layer = 2 * int(cfg["num_key_value_heads"]) * int(cfg["head_dim"]) * 2  # K and V
    kinds = list(cfg.get("layer_types", ["full_attention"] * n_layers))
    out = {"kv": prompt_tokens * kinds.count("full_attention") * per_layer}
    window = MODELS[model].window
    if window is not None:
        out["swa"] = min(prompt_tokens, window - 1) * kinds.count("sliding_attention") * per_layer
    return out


def shape(reg: ledger.Registration) -> tuple[object, ...]:
    """What prefill's and decode's registrations must agree on (all but the role)."""
    return (reg.page_size, reg.is_mla, reg.kv_item_lens, reg.state_types, reg.state_item_lens)


@dataclass(frozen=True, slots=True)
class Run:
    """One prompt through a deployment: decode's answer and prefill's ledger entry."""

    prompt: str
    input_ids: tuple[int, ...]
    answer: Answer
    entry: ledger.Transfer


@pytest.fixture(scope="module")
def sglang_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where every server of the session logs (kept for failures)."""
    return tmp_path_factory.mktemp("sglang-logs")


@pytest.fixture(scope="module", params=MODEL_NAMES)
def model(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def reference(model: str, sglang_logs: Path) -> Iterator[Reference]:
    """The colocated server of ``model``, started (not yet waited for)."""
    with start_reference(model, log_dir=sglang_logs, python=sglang_or_skip()) as ref:
        yield ref


@pytest.fixture(scope="module")
def model_deployments(model: str, reference: Reference, sglang_logs: Path
                      ) -> Iterator[Mapping[str, Deployment]]:
    """A PD deployment of ``model`` per backend, booting together (after the reference
    started, so all boots overlap)."""
    with start_deployments(model, backends_for(model), log_dir=sglang_logs,
                           python=sglang_or_skip()) as pds:
        yield pds


@pytest.fixture(scope="module")
def deployment(model_deployments: Mapping[str, Deployment], backend: str) -> Deployment:
    """The PD deployment of ``model`` over ``backend``."""
    return model_deployments[backend]


@pytest.fixture(scope="module")
def reference_tokens(reference: Reference) -> Mapping[str, tuple[int, ...]]:
    """The colocated server's greedy tokens for every prompt."""
    url = reference.ready().url
    return {name: stream(url, ids, max_new_tokens=MAX_NEW_TOKENS).output_ids
            for name, ids in prompts().items()}


@pytest.fixture(scope="module")
def runs(deployment: Deployment) -> list[Run]:
    """Every prompt through the deployment's router, one at a time."""
    out = []
    for name, ids in prompts().items():
        answer, entry = deployment.send(ids, max_new_tokens=MAX_NEW_TOKENS)
        out.append(Run(name, ids, answer, entry))
    return out
