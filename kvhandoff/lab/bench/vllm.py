"""``kvhandoff bench vllm``: KvhandoffConnector against vLLM's NixlConnector, same run.

For each connector in turn, a prefill and a decode vLLM server (the demo's tiny hybrid,
``--kind``, one core each) behind ``kvhandoff vllm-proxy`` (the machinery of
``kvhandoff demo-vllm``), the same prompts for both:

* **time to first token** through the pair (streaming, the first SSE chunk with a token)
  and **transfer time** per request, the same span for both — the data movement:
  kvhandoff's writes on prefill, from the transport starting to move the bytes
  (``Handle.started``: the engine's post, the first byte on the socket) until it
  acknowledged them; NIXL's READs, decode's ``vllm:nixl_xfer_time_seconds`` (NIXL's
  xferDuration: from its post to completion) — and, beside it, kvhandoff's **bytes
  moving** (the ``move`` phase: for cma, decode's own span from having the write to the
  last byte pulled, which, like NIXL's, leaves out the wake-ups that carry the request
  to the reader and the answer back), plus kvhandoff's **prepare time**
  (prefill's planning and the transport's bounds checks and descriptors, which NIXL does
  ahead of time for its block-indexed descriptor lists) and its **load
  time** (decode's indices out until the bytes and guard are verified: a control hop, the
  planning, the writes and the status back), median over ``--repeat`` trials, each
  trial with its own ``cache_salt`` so no prefix cache is reused;
* **requests/s** through the pair: ``--requests`` prompts of ``--rate-tokens`` tokens,
  ``--concurrency`` at a time;
* **one memcpy** of the same bytes (a handoff's bytes, copied once between two
  places of memory in this process, not cache-warm, median of :data:`MEMCPY_REPS`): the
  limit a same-host handoff is held to.

kvhandoff runs on the library's default transport (``auto``) unless ``--transport`` names
another; what ``auto`` resolved to is read from the servers' logs (the connector shows
the library's lines there) and printed as ``auto→cma``.

Goals: kvhandoff's transfer ≤ 0.8× NIXL's READ and ≤ 2× one memcpy for prompts of 512+
tokens (the worst of those prompts counts), TTFT ≤ 1.0×, requests/s ≥ 1.0×. The last
line printed is the verdict: ``transfer vs NIXL on the default transport (<name>):
<ratio>x; vs memcpy: <ratio>x``. Writes JSON (default ``benchmarks/results/vllm.json``)
and a PNG next to it. The machine is shared: read medians and ratios, and run it more
than once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvhandoff.lab.vllm import demo
from kvhandoff.lab.vllm.tiny import MODELS, serve_dtype
from kvhandoff.transport.registry import DEFAULT as DEFAULT_TRANSPORT

DEFAULT_JSON = Path("benchmarks") / "results" / "vllm.json"
CONNECTORS = ("kvhandoff", "nixl")
MEMCPY_REPS = 15
COLD_BYTES = 64 << 20
NIXL_GOAL, MEMCPY_GOAL = 0.8, 2.0
_CHOSEN = re.compile(r"transport auto: using (\w+) ")


def memcpy_ms(nbytes: int, reps: int = MEMCPY_REPS) -> float:
    """One copy of ``nbytes`` from memory to memory in this process (numpy's copy, the
    memcpy limit), milliseconds: the median of ``reps``. Each rep copies between a fresh
    pair of places in two :data:`COLD_BYTES` arenas, so the bytes come from memory, not
    from a cache the previous rep warmed (a KV cache is far larger than the caches)."""
    slots = max(2, COLD_BYTES // max(nbytes, 1))
    src = np.random.default_rng(0).integers(0, 256, slots * nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)  # both arenas faulted in before timing
    times = []
    for i in range(reps):
        k = i % slots
        a, b = src[k * nbytes:(k + 1) * nbytes], dst[k * nbytes:(k + 1) * nbytes]
        t0 = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def resolved(transport: str, logs: list[Path]) -> str:
    """``transport`` as it ran: for ``auto``, what it picked per the servers' logs
    (``auto→cma``; several picks joined by ``+``; ``auto→?`` when no log says)."""
    if transport != "auto":
        return transport
    picked = sorted({m.group(1) for p in logs if p.exists()
                     for m in _CHOSEN.finditer(p.read_text(errors="replace"))})
    return f"auto→{'+'.join(picked) or '?'}"


def _rate(pair: demo.Pair, prompt: list[int], requests: int, concurrency: int,
          max_tokens: int) -> dict[str, float]:
    """Requests/s through the proxy: ``requests`` streams, ``concurrency`` at a time."""
    def one(i: int) -> float:
        body = demo._body(pair.prefill.model_name, prompt, max_tokens,
                          cache_salt=f"kvhandoff-bench-rate-{i}")
        return demo.stream_run(pair.proxy_url, body)[0]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        ttfts = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - t0
    return {"requests": requests, "concurrency": concurrency, "seconds": wall,
            "requests_per_s": requests / wall, "ttft_ms_median": statistics.median(ttfts)}


def run_connector(connector: str, model: Path, opts: demo.Options, args: argparse.Namespace,
                  prompts: list[list[int]] | None) -> tuple[list[list[int]], dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        pair = demo.start_pair(stack, connector, model, opts)
        if prompts is None:
            prompts = demo.make_prompts(pair.prefill, [*opts.lengths, args.rate_tokens])
        demo.warm_up(pair, opts.max_tokens)
        rows: list[dict[str, Any]] = []
        for prompt in prompts[:-1]:
            h = demo.handoff(pair, prompt, opts.max_tokens, opts.repeat)
            print(f"  {connector} {len(prompt):4d} tokens: {demo._summary(h)}", flush=True)
            rows.append({"prompt_tokens": len(prompt), "ok": h.ok, "error": h.error,
                         "ttft_ms": h.ttfts_ms, "transfer_ms": h.transfers_ms,
                         "move_ms": h.moves_ms,
                         "load_ms": h.loads_ms, "prepare_ms": h.prepares_ms,
                         "bytes": sum(h.bytes_by_group.values())})
        rate = _rate(pair, prompts[-1], args.requests, args.concurrency, opts.max_tokens)
        print(f"  {connector} rate: {rate['requests_per_s']:.2f} requests/s", flush=True)
        out: dict[str, Any] = {"rows": rows, "rate": rate}
        if connector == "kvhandoff":
            out["transport"] = resolved(opts.transport,
                                        [pair.prefill.log_path, pair.decode.log_path])
            for row in rows:  # the same run, the same bytes, right after the handoffs
                row["memcpy_ms"] = memcpy_ms(row["bytes"]) if row["bytes"] else None
    return prompts, out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _versus(mine: float | None, nixl: float | None) -> dict[str, float | None]:
    """Two medians of one figure and kvhandoff's ratio to NIXL (None unless both)."""
    return {"kvhandoff": mine, "nixl": nixl,
            "ratio": mine / nixl if mine is not None and nixl else None}


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per prompt length, the kvhandoff / NIXL ratios of the medians and kvhandoff's
    transfer / one memcpy of the same bytes; the goals; and the verdict (the worst
    ratios over prompts of 512+ tokens)."""
    k, n = results["kvhandoff"], results["nixl"]
    per_prompt, goals = [], []
    for a, b in zip(k["rows"], n["rows"], strict=True):
        row: dict[str, Any] = {"prompt_tokens": a["prompt_tokens"]}
        for key in ("ttft_ms", "transfer_ms"):
            row[key] = _versus(_median(a[key]), _median(b[key]))
        # NIXL's READ is its own move
        row["move_ms"] = _versus(_median(a.get("move_ms", [])), row["transfer_ms"]["nixl"])
        row["kvhandoff_load_ms"] = _median(a["load_ms"])
        row["kvhandoff_prepare_ms"] = _median(a.get("prepare_ms", []))
        mine, copy = row["transfer_ms"]["kvhandoff"], a.get("memcpy_ms")
        row["memcpy_ms"] = copy
        row["memcpy_ratio"] = mine / copy if mine is not None and copy else None
        per_prompt.append(row)
    big_rows = [r for r in per_prompt if r["prompt_tokens"] >= 512]
    ttft = [r["ttft_ms"]["ratio"] for r in per_prompt if r["ttft_ms"]["ratio"] is not None]
    big = [r["transfer_ms"]["ratio"] for r in big_rows if r["transfer_ms"]["ratio"] is not None]
    copies = [r["memcpy_ratio"] for r in big_rows if r["memcpy_ratio"] is not None]
    rps = k["rate"]["requests_per_s"] / n["rate"]["requests_per_s"]
    for what, value, ok in (
            ("TTFT, median over prompts (goal <= 1.0x)", _median(ttft),
             bool(ttft) and max(ttft) <= 1.0),
            (f"transfer vs NIXL, worst prompt of 512+ tokens (goal <= {NIXL_GOAL}x)",
             max(big, default=None), bool(big) and max(big) <= NIXL_GOAL),
            (f"transfer vs one memcpy, worst prompt of 512+ tokens (goal <= {MEMCPY_GOAL}x)",
             max(copies, default=None), bool(copies) and max(copies) <= MEMCPY_GOAL),
            ("requests/s (goal >= 1.0x)", rps, rps >= 1.0)):
        goals.append({"what": what, "ratio": value, "met": ok})
    moves = [r["move_ms"]["ratio"] for r in big_rows if r["move_ms"]["ratio"] is not None]
    verdict = {"transport": k.get("transport", "?"), "vs_nixl": max(big, default=None),
               "vs_memcpy": max(copies, default=None), "move_vs_nixl": max(moves, default=None)}
    return {"per_prompt": per_prompt, "goals": goals, "verdict": verdict}


def verdict_line(cmp: dict[str, Any]) -> str:
    """The bench's last line (see the module docstring)."""
    v = cmp["verdict"]
    return (f"transfer vs NIXL on the default transport ({v['transport']}): "
            f"{_ratio(v['vs_nixl'])}x; vs memcpy: {_ratio(v['vs_memcpy'])}x")


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def plot(path: Path, cmp: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = cmp["per_prompt"]
    x = list(range(len(rows)))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "ttft_ms", "time to first token (ms)"),
                           (axes[1], "transfer_ms", "transfer time (ms)")):
        for off, name in ((-0.2, "kvhandoff"), (0.2, "nixl")):
            ax.bar([i + off for i in x], [r[key][name] or 0 for r in rows], width=0.4,
                   label=name)
        ax.set_xticks(x, [str(r["prompt_tokens"]) for r in rows])
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.legend()
    fig.suptitle("KvhandoffConnector vs NixlConnector (medians, same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvhandoff bench vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 512, 900],
                    help="prompt lengths (default 64 256 512 900)")
    ap.add_argument("--repeat", type=int, default=5, help="trials per prompt (default 5)")
    ap.add_argument("--requests", type=int, default=24, help="requests for the rate")
    ap.add_argument("--concurrency", type=int, default=4, help="in flight for the rate")
    ap.add_argument("--rate-tokens", type=int, default=512, help="prompt tokens for the rate")
    ap.add_argument("--model-dir", type=Path, help="reuse a tiny checkpoint")
    ap.add_argument("--kind", default=demo.MODEL_KIND, choices=sorted(MODELS),
                    help=f"which tiny model (default {demo.MODEL_KIND})")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                    help="the servers' --dtype (default: as demo-vllm)")
    ap.add_argument("--transport", default=DEFAULT_TRANSPORT,
                    help=f"kvhandoff's transport (default {DEFAULT_TRANSPORT}, the library's)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 prompts, 3 trials")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.repeat, args.requests = [64, 512], 3, 8
    with tempfile.TemporaryDirectory(prefix="kvhandoff-bench-vllm-") as tmp:
        opts = demo.Options(model_dir=args.model_dir, lengths=list(args.tokens),
                            max_tokens=demo.MAX_TOKENS, connectors=list(CONNECTORS),
                            start_timeout=demo.START_TIMEOUT_S, work_dir=Path(tmp),
                            repeat=args.repeat, kind=args.kind,
                            dtype=args.dtype or serve_dtype(args.kind),
                            transport=args.transport)
        model = demo.build_model(opts)
        results: dict[str, dict[str, Any]] = {}
        prompts = None
        for connector in CONNECTORS:
            prompts, results[connector] = run_connector(connector, model, opts, args, prompts)
    cmp = compare(results)
    report(cmp)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    setup = {"model": opts.kind, "dtype": opts.dtype, "transport": opts.transport,
             "resolved": cmp["verdict"]["transport"], "repeat": opts.repeat,
             "max_tokens": opts.max_tokens}
    args.json.write_text(json.dumps({"setup": setup, "results": results, "compare": cmp},
                                    indent=2))
    plot(args.json.with_suffix(".png"), cmp)
    print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    print(verdict_line(cmp))
    ok = all(r["ok"] for c in results.values() for r in c["rows"])
    return 0 if ok else 1


def report(cmp: dict[str, Any]) -> None:
    """The table of medians and the goals (the verdict line comes last, after it)."""
    print(f"\nkvhandoff ({cmp['verdict']['transport']}) / NixlConnector, medians of the same "
          f"run:")
    for r in cmp["per_prompt"]:
        t, x = r["ttft_ms"], r["transfer_ms"]
        print(f"  {r['prompt_tokens']:4d} tokens: TTFT {t['kvhandoff']:.1f} vs {t['nixl']:.1f} ms"
              f" ({t['ratio']:.2f}x); transfer {x['kvhandoff'] or 0:.2f} vs "
              f"{x['nixl'] or 0:.2f} ms ({x['ratio'] or 0:.2f}x; bytes moving "
              f"{r['move_ms']['kvhandoff'] or 0:.2f} ms, {r['move_ms']['ratio'] or 0:.2f}x); "
              f"one memcpy "
              f"{r['memcpy_ms'] or 0:.3f} ms ({r['memcpy_ratio'] or 0:.2f}x); kvhandoff "
              f"prepare {r['kvhandoff_prepare_ms'] or 0:.2f} ms, load "
              f"{r['kvhandoff_load_ms'] or 0:.2f} ms")
    for g in cmp["goals"]:
        print(f"  {g['what']}: {_ratio(g['ratio'])}x [{'met' if g['met'] else 'NOT met'}]")
    print(f"  bytes moving vs NIXL's READ, timed where they move, worst prompt of 512+ "
          f"tokens (not a goal: the transfer is): {_ratio(cmp['verdict']['move_vs_nixl'])}x")
