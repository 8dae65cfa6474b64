"""``kvhandoff demo --layout-only``: a verified in-process handoff between two layouts.

Prefill and decode each register the pools of a hybrid model (full-attention KV,
GDN linear-attention conv + SSM state, sliding-window KV, an aux row) at their own
TP size; prefill ranks hold random bytes; the planner plans what every prefill rank
writes into every decode rank, the in-memory executor runs it, and an independent,
naive oracle (``kvhandoff.lab.testing.oracle``) checks every destination byte.
No model runs here: this is the planner and executor alone, checked byte by byte
(:mod:`kvhandoff.lab.demo` is the multi-process, real-model demo).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass

import numpy as np

from kvhandoff.lab.shapes import SHAPES, LayerKind, ModelShape, layout_for, request_for
from kvhandoff.lab.testing.oracle import expected_writes
from kvhandoff.layout import Layout
from kvhandoff.plan import Indices, Plan, plan
from kvhandoff.plan.execute import HostMemory, execute
from kvhandoff.plan.format import human_size

HYBRID = ModelShape(
    # A Qwen3-Next-style hybrid scaled to run in seconds: GDN layers with full and
    # sliding-window attention layers between them.
    name="hybrid",
    layers=(LayerKind.GDN, LayerKind.GDN, LayerKind.SWA, LayerKind.ATTN) * 2,
    kv_heads=4, head_dim=64, sliding_window=512,
    linear_k_heads=4, linear_k_dim=64, linear_v_heads=8, linear_v_dim=64, conv_kernel=4,
)
MODELS = {"hybrid": HYBRID, **SHAPES}
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PairResult:
    prefill_rank: int
    decode_rank: int
    nbytes: int
    by_component: dict[str, int]
    pieces: int
    segments: int
    coalesced: int
    plan_ms: float


@dataclass(frozen=True, slots=True)
class Summary:
    model: str
    tokens: int
    page_size: int
    prefill_tp: int
    decode_tp: int
    components: list[str]
    pairs: list[PairResult]
    verified_bytes: int
    mismatched_bytes: int

    @property
    def ok(self) -> bool:
        return self.mismatched_bytes == 0 and self.verified_bytes == sum(
            p.nbytes for p in self.pairs)


def run_layout_demo(args: argparse.Namespace) -> int:
    """``kvhandoff demo --layout-only``: one request, layouts only; 0 when every byte checks."""
    if args.list_models:
        print("\n".join(MODELS))
        return 0
    model = args.model or "hybrid"
    if model not in MODELS:
        print(f"demo --layout-only: unknown shape {model!r}; one of {', '.join(MODELS)}",
              file=sys.stderr)
        return 2
    summary = handoff(MODELS[model], prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                      tokens=args.tokens, page_size=args.page_size)
    print(render(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dataclasses.asdict(summary) | {"ok": summary.ok}, f, indent=2)
    return 0 if summary.ok else 1


def handoff(shape: ModelShape, *, prefill_tp: int, decode_tp: int, tokens: int,
            page_size: int, seed: int = 0) -> Summary:
    """Hand one request of ``tokens`` tokens from every prefill rank to every decode rank,
    and check every destination byte against the oracle."""
    rng = np.random.default_rng(seed)

    def side(tp: int, rank: int, fill: bool) -> tuple[Layout, HostMemory]:
        mem = HostMemory()

        def alloc(nbytes: int) -> int:
            if fill:
                return mem.add(rng.integers(0, 256, nbytes, dtype=np.uint8))
            return mem.add(np.zeros(nbytes, dtype=np.uint8))

        lay = layout_for(shape, tp_rank=rank, tp_size=tp, page_size=page_size,
                         num_pages=-(-tokens // page_size) + 2, num_slots=4, alloc=alloc)
        return lay, mem

    prefill = [side(prefill_tp, r, True) for r in range(prefill_tp)]
    decode = [side(decode_tp, r, False) for r in range(decode_tp)]
    pairs: list[PairResult] = []
    checked = bad = 0
    for d_lay, d_mem in decode:
        request = request_for(shape, prefill[0][0], d_lay, tokens, seed=seed)
        for s_lay, s_mem in prefill:
            p, ms = _timed_plan(s_lay, d_lay, request)
            log.debug("%s", p)
            execute(p, s_mem, d_mem)
            pairs.append(PairResult(s_lay.tp_rank, d_lay.tp_rank, p.nbytes, p.by_component(),
                                    p.num_pieces, len(p.flatten()), len(p.coalesce()), ms))
        want = expected_writes([s for s, _ in prefill], d_lay, request)
        got = d_mem.read(want.dst)
        for i, (_, s_mem) in enumerate(prefill):
            mask = want.layout == i
            bad += int(np.count_nonzero(got[mask] != s_mem.read(want.src[mask])))
        checked += len(want)
    return Summary(shape.name, tokens, page_size, prefill_tp, decode_tp,
                   [c.name for c in prefill[0][0].components], pairs, checked, bad)


def _timed_plan(src: Layout, dst: Layout, request: dict[str, Indices | None]
                ) -> tuple[Plan, float]:
    p = plan(src, dst, request)  # the first call also pairs the layouts (cached)
    times = []
    for _ in range(9):
        t0 = time.perf_counter()
        p = plan(src, dst, request)
        times.append(time.perf_counter() - t0)
    return p, float(np.median(times) * 1e3)


def render(s: Summary) -> str:
    lines = [
        f"kvhandoff demo — {s.model}: {s.tokens} tokens, page {s.page_size}, "
        f"prefill TP {s.prefill_tp} → decode TP {s.decode_tp}",
        f"components: {', '.join(s.components)}",
        f"{'P→D':>5}  {'bytes per component':<50} {'pieces':>6} {'segments':>9} "
        f"{'coalesced':>9} {'plan ms':>8}",
    ]
    for r in s.pairs:
        comps = " ".join(f"{k}={human_size(v)}" for k, v in r.by_component.items())
        lines.append(f"{r.prefill_rank:>2}→{r.decode_rank:<2}  {comps:<50} {r.pieces:>6} "
                     f"{r.segments:>9} {r.coalesced:>9} {r.plan_ms:>8.3f}")
    verdict = (f"all {s.verified_bytes} destination bytes match the oracle ✓" if s.ok
               else f"{s.mismatched_bytes} of {s.verified_bytes} bytes WRONG ✗")
    lines.append(f"moved {human_size(sum(r.nbytes for r in s.pairs))}: {verdict}")
    return "\n".join(lines)
