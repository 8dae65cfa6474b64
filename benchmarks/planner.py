"""Planner benchmark: how long ``plan()`` takes for real model shapes, and what it emits.

For each case (model, sequence length, page size, prefill TP -> decode TP, page
allocation) it builds real-size layouts with fake addresses (nothing is
allocated), the request of one sequence, and plans every (prefill rank -> decode
rank 0) pair that decode rank 0 needs. It reports the median and p90 plan time per
pair and for all pairs together, the handshake (pairing) time, and the plan's
size: units (index entries), pieces, flattened segments, coalesced segments, bytes.

    python benchmarks/planner.py            # full run, ~1 minute
    python benchmarks/planner.py --quick    # smoke run, seconds

Writes ``--json`` (default benchmarks/results/planner.json) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvhandoff.lab import shapes
from kvhandoff.lab.shapes import LayerKind, ModelShape
from kvhandoff.layout import Layout
from kvhandoff.plan import Plan, plan
from kvhandoff.plan.compat import pair_layouts

MODELS = ("qwen3_next", "deepseek_v4", "gpt_oss")
TOKENS = (4096, 32768)
TP_PAIRS = ((1, 1), (2, 4), (4, 2), (8, 2))
DEFAULT_JSON = Path(__file__).parent / "results" / "planner.json"


@dataclass
class Case:
    model: str
    tokens: int
    page: int  # tokens per page (DeepSeek-V4: per SWA page)
    tp_src: int
    tp_dst: int
    alloc: str  # "random" or "contiguous" page ids
    kv_page: int = 0  # the KV pool's page (DeepSeek-V4: its 256-token logical page)
    src_ranks: list[int] = field(default_factory=list)  # prefill ranks decode rank 0 needs
    entries: int = 0  # tensor pairs with bytes to move
    units: int = 0
    pieces: int = 0
    segments: int = 0  # flattened (src, dst, len) triples
    coalesced: int = 0
    nbytes: int = 0
    plan_ms_median: float = 0.0  # all pairs of decode rank 0, together
    plan_ms_p90: float = 0.0
    pair_ms_median: list[float] = field(default_factory=list)  # per prefill rank
    pair_ms_p90: list[float] = field(default_factory=list)
    handshake_ms: float = 0.0  # pair_layouts, uncached, all pairs
    flatten_ms: float = 0.0
    coalesce_ms: float = 0.0

    @property
    def label(self) -> str:
        page = f"{self.kv_page}/{self.page}" if self.kv_page != self.page else str(self.page)
        return (f"{self.model} {self.tokens // 1024}K p{page} "
                f"TP{self.tp_src}->{self.tp_dst} {self.alloc[:4]}")


def page_size(shape: ModelShape, page: int) -> int:
    # a DeepSeek-V4 logical page holds whole C128 rows (256 tokens); its SWA pages are `page`
    return 256 if shape.has(LayerKind.DSV4_C4) else page


def layouts(shape: ModelShape, tokens: int, page: int, tp: int) -> list[Layout]:
    ps = page_size(shape, page)
    pages = 2 * (tokens // ps + 1) + 1
    swa = 2 * (tokens // page + 1) + 1
    return [shapes.layout_for(shape, tp_rank=r, tp_size=tp, page_size=ps, num_pages=pages,
                              num_swa_pages=swa, num_slots=16,
                              swa_page_size=min(page, 64) if shape.has(LayerKind.DSV4_C4)
                              else None)
            for r in range(tp)]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def run_case(case: Case, reps: int, warmup: int) -> Case:
    shape = shapes.get(case.model)
    case.kv_page = page_size(shape, case.page)
    src = layouts(shape, case.tokens, case.page, case.tp_src)
    dst = layouts(shape, case.tokens, case.page, case.tp_dst)[0]
    contiguous = case.alloc == "contiguous"
    reqs = [shapes.request_for(shape, s, dst, case.tokens, seed=1, contiguous=contiguous)
            for s in src]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a realistic request never trims
        plans = [plan(s, dst, r) for s, r in zip(src, reqs, strict=True)]
    needed = [i for i, p in enumerate(plans) if p]
    case.src_ranks = needed

    # handshake: pairing without the cache, every needed pair
    t_hs = []
    for _ in range(max(3, reps // 4)):
        pair_layouts.cache_clear()
        t0 = time.perf_counter()
        for i in needed:
            pair_layouts(src[i], dst)
        t_hs.append(time.perf_counter() - t0)
    case.handshake_ms = statistics.median(t_hs) * 1e3

    per_pair: dict[int, list[float]] = {i: [] for i in needed}
    totals: list[float] = []
    for rep in range(warmup + reps):
        total = 0.0
        for i in needed:
            t0 = time.perf_counter()
            plan(src[i], dst, reqs[i])
            dt = time.perf_counter() - t0
            total += dt
            if rep >= warmup:
                per_pair[i].append(dt * 1e3)
        if rep >= warmup:
            totals.append(total * 1e3)
    case.plan_ms_median = statistics.median(totals)
    case.plan_ms_p90 = pct(totals, 90)
    case.pair_ms_median = [statistics.median(per_pair[i]) for i in needed]
    case.pair_ms_p90 = [pct(per_pair[i], 90) for i in needed]

    chosen: list[Plan] = [plans[i] for i in needed]
    case.entries = sum(len(p.entries) for p in chosen)
    case.units = sum(p.num_units for p in chosen)
    case.pieces = sum(p.num_pieces for p in chosen)
    case.nbytes = sum(p.nbytes for p in chosen)
    t_f, t_c = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        flat = [p.flatten() for p in chosen]
        t_f.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        co = [p.coalesce() for p in chosen]
        t_c.append(time.perf_counter() - t0)
    case.segments = sum(len(f) for f in flat)
    case.coalesced = sum(len(c) for c in co)
    assert sum(f.nbytes for f in flat) == sum(c.nbytes for c in co) == case.nbytes
    case.flatten_ms = statistics.median(t_f) * 1e3
    case.coalesce_ms = statistics.median(t_c) * 1e3
    return case


def cases(quick: bool) -> list[Case]:
    out = []
    tokens = (4096,) if quick else TOKENS
    tps = ((1, 1), (2, 4), (8, 2)) if quick else TP_PAIRS
    allocs = ("random", "contiguous")
    for model in MODELS:
        for n in tokens:
            for a, b in tps:
                for alloc in allocs:
                    out.append(Case(model, n, 64, a, b, alloc))
    if not quick:  # page size 1: every token is its own page
        out.append(Case("qwen3_next", 32768, 1, 1, 1, "random"))
        out.append(Case("qwen3_next", 32768, 1, 1, 1, "contiguous"))
        out.append(Case("qwen3_next", 32768, 1, 2, 4, "random"))
    return out


def fmt_int(n: int) -> str:
    for unit, div in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def table(results: list[Case]) -> str:
    head = (f"{'case':<38} {'pairs':>5} {'units':>7} {'pieces':>6} {'segments':>8} "
            f"{'coalesced':>9} {'MiB':>8} {'plan med':>9} {'p90':>8} {'max pair':>9} "
            f"{'handshk':>8} {'flatten':>8}")
    rows = [head, "-" * len(head)]
    for c in results:
        rows.append(
            f"{c.label:<38} {len(c.src_ranks):>5} {fmt_int(c.units):>7} {c.pieces:>6} "
            f"{fmt_int(c.segments):>8} {fmt_int(c.coalesced):>9} {c.nbytes / 2**20:>8.1f} "
            f"{c.plan_ms_median:>7.2f}ms {c.plan_ms_p90:>6.2f}ms "
            f"{max(c.pair_ms_median):>7.2f}ms {c.handshake_ms:>6.1f}ms {c.flatten_ms:>6.1f}ms"
        )
    return "\n".join(rows)


def plot(results: list[Case], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [c.label for c in results]
    y = np.arange(len(results))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 0.28 * len(results) + 2), sharey=True)
    med = [c.plan_ms_median for c in results]
    p90 = [c.plan_ms_p90 for c in results]
    ax1.barh(y, p90, color="#c6dbef", label="p90")
    ax1.barh(y, med, color="#2171b5", label="median")
    ax1.set_xlabel("plan time for all pairs of decode rank 0 (ms)")
    ax1.set_yticks(y, labels, fontsize=7)
    ax1.invert_yaxis()
    ax1.legend(loc="upper right")
    ax1.grid(axis="x", alpha=0.3)
    ax2.barh(y - 0.2, [c.segments for c in results], height=0.4, color="#fdae6b",
             label="flattened segments")
    ax2.barh(y + 0.2, [c.coalesced for c in results], height=0.4, color="#e6550d",
             label="coalesced segments")
    ax2.set_xscale("log")
    ax2.set_xlabel("segments (log)")
    ax2.legend(loc="upper right")
    ax2.grid(axis="x", alpha=0.3)
    fig.suptitle("kvhandoff planner: real shapes, fake addresses")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few cases, few repetitions")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 30)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    reps = args.reps if args.reps is not None else (5 if args.quick else 30)
    warmup = 1 if args.quick else args.warmup

    results = []
    t0 = time.perf_counter()
    for case in cases(args.quick):
        results.append(run_case(case, reps, warmup))
        print(f"  {case.label}: {case.plan_ms_median:.2f} ms", file=sys.stderr, flush=True)
    print(table(results))

    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "python": platform.python_version(), "numpy": np.__version__,
        "machine": platform.machine(), "processor": platform.processor(),
        "reps": reps, "warmup": warmup, "quick": args.quick, "decode_rank": 0,
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    args.json.write_text(json.dumps(
        {"meta": meta, "cases": [asdict(c) | {"label": c.label} for c in results]}, indent=1))
    print(f"wrote {args.json}")
    if not args.no_plot:
        png = args.json.with_suffix(".png")
        plot(results, png)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
