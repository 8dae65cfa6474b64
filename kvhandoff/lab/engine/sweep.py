"""The family sweep: every causal-LM model type ``transformers`` ships, handed off or refused.

For each model type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (the installed
``transformers``' own list, nothing hand-picked), :func:`sweep_family` builds a tiny
random-weight model (:func:`kvhandoff.lab.engine.tiny.tiny_config`) and classifies it:

* ``not buildable`` — the tiny config or model cannot be built here, or plain
  ``transformers`` cannot run it (greedy decoding with its own cache): a missing
  package, remote code, a vision input it needs. Not kvhandoff's concern.
* ``refused`` — kvhandoff refuses it **at start-up** (:func:`kvhandoff.lab.engine.run.start`:
  describing the cache, laying out the pools, the handshake of every rank pair), with a
  :class:`~kvhandoff.errors.HandoffError` whose message names the cause.
* ``token-exact`` — the in-process engine (planner + executor in memory, TP ranks
  emulated) hands every prompt off at prefill TP 2 → decode TP 1 and 1 → 2 with the
  same greedy tokens as plain ``transformers``, decode's cache byte-equal to prefill's
  and every pool empty afterwards.
* ``failed`` — anything else: an error after the first request, wrong tokens or state,
  a leak, or a start-up error that is not a kvhandoff refusal. Always a bug.

Each family runs in this process, one after another, with ``torch`` on one thread.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from kvhandoff.errors import HandoffError
from kvhandoff.lab.engine.models import load_model, sample_prompts
from kvhandoff.lab.engine.run import Engines, colocated_greedy, serve, start
from kvhandoff.lab.engine.tiny import tiny_config

PAIRS = ((2, 1), (1, 2))
"""(prefill TP, decode TP) pairs every family is handed off at."""
PROMPT_LENS = (5, 19)  # under a page; several chunks, past the 8-token sliding window
CHUNK = 6
NEW_TOKENS = 4


class Result(enum.Enum):
    """What became of one family (the order is the table's)."""

    HANDOFF = "token-exact"
    REFUSED = "refused"
    NOT_BUILDABLE = "not buildable"
    FAILED = "failed"


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One family's line of the table."""

    family: str
    result: Result
    kinds: str  # the model's layer kinds, distinct, in layer order ("" when not described)
    reason: str  # why refused / not buildable / failed (one line); "" for a handoff
    seconds: float  # wall time spent on the family (reported, never asserted)


def families() -> list[str]:
    """Every causal-LM model type of the installed ``transformers``, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def sweep(names: Iterable[str] | None = None, progress: Callable[[Row], None] | None = None
          ) -> list[Row]:
    """:func:`sweep_family` for each of ``names`` (default :func:`families`), in order;
    ``progress`` is called with each row as it ends."""
    rows = []
    for name in families() if names is None else names:
        row = sweep_family(name)
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


def sweep_family(model_type: str) -> Row:
    """Build a tiny ``model_type`` and classify it (see the module docstring)."""
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        result, kinds, reason = _classify(model_type)
    return Row(family=model_type, result=result, kinds=kinds, reason=reason,
               seconds=time.perf_counter() - t0)


def _classify(model_type: str) -> tuple[Result, str, str]:
    try:
        model = load_model(tiny_config(model_type))
    except Exception as e:  # anything transformers raises: not buildable here
        return Result.NOT_BUILDABLE, "", _line("tiny model", e)
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    prompts = sample_prompts(PROMPT_LENS, vocab=min(vocab, 128), seed=1)
    problem = _plain_run(model, prompts[-1])
    if problem:
        return Result.NOT_BUILDABLE, "", problem
    kinds = ""
    for p, d in PAIRS:
        try:
            engines = start(model, PROMPT_LENS, prefill_tp=p, decode_tp=d, chunk=CHUNK)
        except HandoffError as e:
            return Result.REFUSED, kinds, _line(f"TP {p}→{d}", e)
        except Exception as e:  # a start-up crash is no refusal: report it
            return Result.FAILED, kinds, _line(f"TP {p}→{d} start-up (not a refusal)", e)
        kinds = layer_kinds(engines)
        problem = _handoff(engines, prompts)
        if problem:
            return Result.FAILED, kinds, f"TP {p}→{d}: {problem}"
    return Result.HANDOFF, kinds, ""


def _plain_run(model: PreTrainedModel, prompt: Sequence[int]) -> str:
    """"" when plain ``transformers`` decodes ``prompt`` greedily in chunks with its own
    cache; else why not. A model whose forward takes no cache at all passes here: that
    is kvhandoff's to refuse at start-up."""
    try:
        colocated_greedy(model, prompt, NEW_TOKENS, CHUNK)
    except HandoffError:
        return ""
    except Exception as e:  # transformers cannot run it: not buildable
        return _line("transformers cannot run it", e)
    return ""


def _handoff(engines: Engines, prompts: list[list[int]]) -> str:
    """"" when every prompt hands off exactly; else the first problem."""
    try:
        run = serve(engines, prompts, max_new_tokens=NEW_TOKENS)
    except Exception as e:  # after start-up every error is a failure
        return _line("after start-up", e)
    for r in run.requests:
        if not r.tokens_equal:
            return f"request {r.rid}: tokens {r.disaggregated} != colocated {r.colocated}"
        if not r.state_equal:
            return f"request {r.rid}: {r.state_diff}"
    leaks = {k: v for k, v in run.leaks.items() if v}
    return f"leaks {leaks}" if leaks else ""


def layer_kinds(engines: Engines) -> str:
    """The model's distinct layer kinds in layer order, e.g. ``"mamba2, mlp, attn"``."""
    return ", ".join(dict.fromkeys(k.value for k in engines.prep.arch.shape.layers))


def _line(what: str, e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{what}: {type(e).__name__}: {first}"[:300]
