"""``kvhandoff demo-sglang``: real SGLang PD deployments on this CPU, per transfer backend.

For each model (``--model``; tiny random-weight checkpoints, :mod:`.models`) it starts a
colocated SGLang server (the reference) and, per transfer backend (``--backend``; the
list in :data:`~kvhandoff.lab.sglang.rig.BACKENDS`), a prefill and a decode server
behind sglang-router (:func:`~kvhandoff.lab.sglang.rig.deployment`). Every prompt length
(``--tokens``) is sent ``--repeat`` times, each time a different prompt of that length
(no trial hits an earlier one's prefix cache), streaming: once to the reference (its
answers serve every backend's row), once through the router. One row per model, backend
and length shows:

* **bytes per component**: SGLang's own accounting inside prefill's sender (KV pages ×
  per-page bytes of every KV buffer; state slots × slot bytes per state type; the aux
  row), split by component by the lab's ledger (:mod:`.ledger`); ``total`` is what
  SGLang reports (``KVTransferMetric.transfer_total_bytes``; it leaves out aux);
* **transfer**: ``sglang ms`` is the latency SGLang reports for the transfer
  (``sglang:kv_transfer_latency_ms``): the backend's own figure where it measures one
  (first enqueue → Success), else (Mooncake) the prefill scheduler's time from the last
  chunk's enqueue to the poll that saw Success. As that means different things for
  different backends, ``lab ms`` times every backend the same way, in prefill's
  scheduler: last chunk handed to the sender → the poll that saw Success. Medians;
* **TTFT**: the client's clock, request sent → first streamed token; through the router
  it includes routing, prefill, the transfer and decode's first step; ``ref`` is the same
  against the colocated server; medians;
* **exact**: whether decode's greedy tokens equal the colocated run's, in every trial.

Exit status 1 on any mismatch or failure. Logs stay in ``--work-dir`` (default: a temp
dir, removed when everything passed). Every process started is stopped on the way out,
also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvhandoff.lab.servers import print_progress, raising_on_sigterm
from kvhandoff.lab.sglang.client import Answer, stream
from kvhandoff.lab.sglang.env import sglang_python, venv_hint
from kvhandoff.lab.sglang.models import END_TO_END, MODELS
from kvhandoff.lab.sglang.rig import BACKENDS, Deployment, deployment, reference
from kvhandoff.plan.format import human_size

__all__ = ["Row", "add_arguments", "format_rows", "run_main"]

DEFAULT_MODELS = ("mellum",)
DEFAULT_TOKENS = (16, 600, 1500)
MAX_NEW_TOKENS = 16
REPEAT = 3


@dataclass(frozen=True, slots=True)
class Row:
    """One model × backend × prompt length, over ``trials`` different prompts."""

    model: str
    backend: str
    prompt_tokens: int
    components: dict[str, int]
    sglang_total_bytes: int
    transfer_ms: float | None
    lab_transfer_ms: float | None
    ttft_ms: float
    ref_ttft_ms: float
    exact: bool
    trials: int


def trial_prompts(length: int, repeat: int, vocab: int) -> list[tuple[int, ...]]:
    """``repeat`` different prompts of ``length`` tokens (fixed seeds)."""
    return [tuple(random.Random(f"{length}/{r}").randrange(3, vocab) for _ in range(length))
            for r in range(repeat)]


def _median_ms(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return 1e3 * statistics.median(known) if len(known) == len(values) and known else None


def _measure(pd: Deployment, ref: Sequence[Answer], length: int,
             prompts: Sequence[tuple[int, ...]], max_new_tokens: int) -> Row:
    """One row: ``prompts`` through ``pd``, against the reference's answers ``ref``."""
    got = [pd.send(p, max_new_tokens=max_new_tokens) for p in prompts]
    first = got[0][1]
    return Row(model=pd.model, backend=pd.backend, prompt_tokens=length,
               components=dict(first.components), sglang_total_bytes=first.sglang_total_bytes,
               transfer_ms=_median_ms([e.latency_s for _, e in got]),
               lab_transfer_ms=_median_ms([e.lab_latency_s for _, e in got]),
               ttft_ms=1e3 * statistics.median(a.ttft_s for a, _ in got),
               ref_ttft_ms=1e3 * statistics.median(a.ttft_s for a in ref),
               exact=all(a.output_ids == r.output_ids for (a, _), r in zip(got, ref, strict=True)),
               trials=len(prompts))


def run_model(model: str, backends: Sequence[str], lengths: Sequence[int], *, repeat: int,
              max_new_tokens: int, log_dir: Path) -> list[Row]:
    """Every row of one model: the reference boots alongside the first deployment."""
    vocab = int(MODELS[model].sizes["vocab_size"])
    rows = []
    # The reference answers each prompt once, for every backend's row: asked again, it
    # would serve the prompt from its prefix cache, where SGLang's CPU SWA decode (Mellum)
    # fails with an IndexError in torch_native's decode, a colocated bug of its own.
    answers: dict[int, list[Answer]] = {}
    with reference(model, log_dir=log_dir, progress=print_progress(f"{model} colocated")) as ref:
        for backend in backends:
            progress = print_progress(f"{model} {backend}")
            with deployment(model, backend, log_dir=log_dir, progress=progress) as pd:
                url = ref.ready().url
                for n in lengths:
                    prompts = trial_prompts(n, repeat, vocab)
                    if n not in answers:
                        answers[n] = [stream(url, p, max_new_tokens=max_new_tokens)
                                      for p in prompts]
                    rows.append(_measure(pd, answers[n], n, prompts, max_new_tokens))
                    print(format_rows(rows[-1:], header=False), flush=True)
    return rows


def format_rows(rows: Sequence[Row], *, header: bool = True) -> str:
    """The table: one line per row."""
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1f}"

    lines = [f"{'model':<12} {'backend':<13} {'tokens':>6}  {'bytes per component':<40} "
             f"{'total':>9} {'sglang ms':>9} {'lab ms':>7} {'TTFT ms':>8} {'ref ms':>7}  exact"] \
        if header else []
    for r in rows:
        parts = ", ".join(f"{k} {human_size(v)}" for k, v in r.components.items())
        lines.append(f"{r.model:<12} {r.backend:<13} {r.prompt_tokens:>6}  {parts:<40} "
                     f"{human_size(r.sglang_total_bytes):>9} {ms(r.transfer_ms):>9} "
                     f"{ms(r.lab_transfer_ms):>7} "
                     f"{ms(r.ttft_ms):>8} {ms(r.ref_ttft_ms):>7}  "
                     f"{'✓' if r.exact else '✗'} ({r.trials})")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", choices=[*END_TO_END, "all"],
                   help=f"a tiny model (repeat for several; 'all': {', '.join(END_TO_END)}; "
                        f"default {', '.join(DEFAULT_MODELS)})")
    p.add_argument("--backend", action="append",
                   help=f"a transfer backend (repeat for several; default "
                        f"{', '.join(BACKENDS)})")
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                   help="prompt lengths, comma separated (default 16,600,1500)")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                   help=f"greedy tokens per request (default {MAX_NEW_TOKENS})")
    p.add_argument("--repeat", type=int, default=REPEAT,
                   help=f"trials per length, each a different prompt; times are medians "
                        f"(default {REPEAT})")
    p.add_argument("--work-dir", type=Path,
                   help="where logs go (default: a temp dir, removed when all passed)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")


def run_main(args: argparse.Namespace) -> int:
    py = sglang_python()
    if not py.exists():
        print(venv_hint(py), file=sys.stderr)
        return 2
    models = list(END_TO_END) if "all" in (args.model or ()) else (args.model or DEFAULT_MODELS)
    backends = args.backend or list(BACKENDS)
    lengths = [int(t) for t in args.tokens.split(",") if t.strip()]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kvhandoff-demo-sglang-"))
    rows: list[Row] = []
    print(format_rows([]), flush=True)
    try:
        with raising_on_sigterm(lambda signum: SystemExit(128 + signum)):
            for model in models:
                rows += run_model(model, backends, lengths, repeat=args.repeat,
                                  max_new_tokens=args.max_new_tokens, log_dir=work / model)
    except Exception as e:  # a server that would not start, a request that failed
        print(f"FAILED: {type(e).__name__}: {e}\nlogs: {work}", file=sys.stderr)
        return 1
    print("\n" + format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    ok = all(r.exact for r in rows)
    print("every row token-exact" if ok else f"MISMATCH (logs: {work})")
    if ok and args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1
