"""``kvhandoff bench vllm``: KvhandoffConnector against vLLM's NixlConnector, same run.

For each connector in turn, a prefill and a decode vLLM server (the demo's tiny hybrid,
``--kind``, one core each) behind ``kvhandoff vllm-proxy`` (the machinery of
``kvhandoff demo-vllm``), the same prompts for both:

* **time to first token** through the pair (streaming, the first SSE chunk with a token)
  and **transfer time** per request, the same span for both — the data movement:
  kvhandoff's writes on prefill, from the transport starting to move the bytes
  (``Handle.started``: the engine's post, the first byte on the socket) until it
  acknowledged them; NIXL's READs, decode's ``vllm:nixl_xfer_time_seconds`` (NIXL's
  xferDuration: from its post to completion) — plus kvhandoff's **prepare time**
  (prefill's planning and the transport's bounds checks and descriptors, which NIXL does
  ahead of time for its block-indexed descriptor lists) and its **load
  time** (decode's indices out until the bytes and guard are verified: a control hop, the
  planning, the writes and the status back), median over ``--repeat`` trials, each
  trial with its own ``cache_salt`` so no prefix cache is reused;
* **requests/s** through the pair: ``--requests`` prompts of ``--rate-tokens`` tokens,
  ``--concurrency`` at a time.

Goals (kvhandoff / NIXL): TTFT ≤ 1.0×, transfer ≤ 1.0× for prompts of 512+ tokens,
requests/s ≥ 1.0×. Writes JSON (default ``benchmarks/results/vllm.json``) and a PNG next to
it. The machine is shared: read medians and ratios, and run it more than once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvhandoff.lab.vllm import demo
from kvhandoff.lab.vllm.tiny import MODELS, serve_dtype

DEFAULT_JSON = Path("benchmarks") / "results" / "vllm.json"
CONNECTORS = ("kvhandoff", "nixl")


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
        rows = []
        for prompt in prompts[:-1]:
            h = demo.handoff(pair, prompt, opts.max_tokens, opts.repeat)
            print(f"  {connector} {len(prompt):4d} tokens: {demo._summary(h)}", flush=True)
            rows.append({"prompt_tokens": len(prompt), "ok": h.ok, "error": h.error,
                         "ttft_ms": h.ttfts_ms, "transfer_ms": h.transfers_ms,
                         "load_ms": h.loads_ms, "prepare_ms": h.prepares_ms,
                         "bytes": sum(h.bytes_by_group.values())})
        rate = _rate(pair, prompts[-1], args.requests, args.concurrency, opts.max_tokens)
        print(f"  {connector} rate: {rate['requests_per_s']:.2f} requests/s", flush=True)
    return prompts, {"rows": rows, "rate": rate}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per prompt length, the kvhandoff / NIXL ratios of the medians, and the goals."""
    k, n = results["kvhandoff"], results["nixl"]
    per_prompt, goals = [], []
    for a, b in zip(k["rows"], n["rows"], strict=True):
        row: dict[str, Any] = {"prompt_tokens": a["prompt_tokens"]}
        for key in ("ttft_ms", "transfer_ms"):
            ma, mb = _median(a[key]), _median(b[key])
            row[key] = {"kvhandoff": ma, "nixl": mb,
                        "ratio": ma / mb if ma is not None and mb else None}
        row["kvhandoff_load_ms"] = _median(a["load_ms"])
        row["kvhandoff_prepare_ms"] = _median(a.get("prepare_ms", []))
        per_prompt.append(row)
    ttft = [r["ttft_ms"]["ratio"] for r in per_prompt if r["ttft_ms"]["ratio"] is not None]
    big = [r["transfer_ms"]["ratio"] for r in per_prompt
           if r["prompt_tokens"] >= 512 and r["transfer_ms"]["ratio"] is not None]
    rps = k["rate"]["requests_per_s"] / n["rate"]["requests_per_s"]
    for what, value, ok in (
            ("TTFT, median over prompts (goal <= 1.0x)", _median(ttft),
             bool(ttft) and max(ttft) <= 1.0),
            ("transfer time, prompts of 512+ tokens (goal <= 1.0x)", _median(big),
             bool(big) and max(big) <= 1.0),
            ("requests/s (goal >= 1.0x)", rps, rps >= 1.0)):
        goals.append({"what": what, "ratio": value, "met": ok})
    return {"per_prompt": per_prompt, "goals": goals}


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
    ap.add_argument("--transport", default="tcp", help="kvhandoff's transport (default tcp)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 prompts, 2 trials")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.repeat, args.requests = [64, 512], 2, 8
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
    print("\nkvhandoff / NixlConnector, medians of the same run:")
    for r in cmp["per_prompt"]:
        t, x = r["ttft_ms"], r["transfer_ms"]
        print(f"  {r['prompt_tokens']:4d} tokens: TTFT {t['kvhandoff']:.1f} vs {t['nixl']:.1f} ms"
              f" ({t['ratio']:.2f}x); transfer {x['kvhandoff'] or 0:.2f} vs "
              f"{x['nixl'] or 0:.2f} ms ({x['ratio'] or 0:.2f}x); kvhandoff prepare "
              f"{r['kvhandoff_prepare_ms'] or 0:.2f} ms, load {r['kvhandoff_load_ms'] or 0:.2f} ms")
    for g in cmp["goals"]:
        print(f"  {g['what']}: {g['ratio'] or 0:.2f}x [{'met' if g['met'] else 'NOT met'}]")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    setup = {"model": opts.kind, "dtype": opts.dtype, "transport": opts.transport,
             "repeat": opts.repeat, "max_tokens": opts.max_tokens}
    args.json.write_text(json.dumps({"setup": setup, "results": results, "compare": cmp},
                                    indent=2))
    plot(args.json.with_suffix(".png"), cmp)
    print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    ok = all(r["ok"] for c in results.values() for r in c["rows"])
    return 0 if ok else 1
