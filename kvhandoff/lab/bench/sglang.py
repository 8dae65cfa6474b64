"""``kvhandoff bench sglang``: the kvhandoff backend against SGLang's own Mooncake backend
(``mooncake_tcp``), on real SGLang servers, same prompts, same run.

Both PD deployments of one tiny model (``--model``; prefill + decode + sglang-router each,
:func:`kvhandoff.lab.sglang.rig.deployments`) boot together and stay up; every trial sends
the same fresh prompt through each of them in turn (the order alternates, so neither
backend always goes first on a loaded host), one request at a time. Per prompt length:

* **transfer**: the SGLang lab's ``lab ms`` (:mod:`kvhandoff.lab.sglang.ledger`), the same
  clock for both backends, in prefill's scheduler: the request's last chunk handed to the
  sender → the scheduler's poll that saw Success. It includes the backend's own
  per-request work and the scheduler's polling cadence, not decode's side;
* **TTFT**: the client's clock through the router, request sent → first streamed token
  (prefill, the transfer, decode's first step);
* **memcpy**: one ``numpy.copyto`` of as many bytes as kvhandoff moved for that prompt,
  in this process: what the bytes cost on this machine with no protocol at all.

Medians of ``--repeat`` trials (each a different prompt). Goals (issue #27, kvhandoff /
Mooncake): transfer ≤ 0.5× for prompts of 512+ tokens, TTFT ≤ 1.0× at every length.
Each request's tokens must be the same over both backends (greedy decoding of the
same prompt); a difference or a failed request is exit status 1. Writes JSON (default
``benchmarks/results/sglang.json``) and a PNG beside it. The host is shared: read
medians and ratios, and run it more than once.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvhandoff.lab.servers import print_progress
from kvhandoff.lab.sglang import census
from kvhandoff.lab.sglang.demo import trial_prompts
from kvhandoff.lab.sglang.models import END_TO_END, MODELS
from kvhandoff.lab.sglang.rig import Deployment, deployments

DEFAULT_JSON = Path("benchmarks") / "results" / "sglang.json"
OURS, THEIRS = "kvhandoff", "mooncake_tcp"
DEFAULT_TOKENS = (64, 256, 512, 1024, 1500)
REPEAT = 5
MAX_NEW_TOKENS = 4
TRANSFER_GOAL, TTFT_GOAL, BIG = 0.5, 1.0, 512


_AUTO_USING = re.compile(r"transport auto: using (\w+)")


def transport_in_force(pd: Deployment) -> str:
    """The kvhandoff transport the deployment's requests moved over: ``auto``'s choice
    as its servers logged it (once per distinct choice), else the configured name (the
    census of prefill's scheduler)."""
    picked = sorted({m.group(1) for srv in (pd.prefill, pd.decode)
                     for m in _AUTO_USING.finditer(srv.log_path.read_text(errors="replace"))})
    name = census.read(pd.prefill.url).transport or "?"
    return f"{name} -> {', '.join(picked)}" if picked else name


def memcpy_ms(nbytes: int, runs: int = 7) -> float:
    """The median time of one ``numpy.copyto`` of ``nbytes`` (both buffers touched first)."""
    src, dst = np.ones(max(nbytes, 1), np.uint8), np.zeros(max(nbytes, 1), np.uint8)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _trial(pd: Deployment, prompt: Sequence[int], max_new_tokens: int) -> dict[str, Any]:
    answer, entry = pd.send(prompt, max_new_tokens=max_new_tokens)
    moved = entry.own_components or entry.components
    return {"tokens": list(answer.output_ids), "ttft_ms": 1e3 * answer.ttft_s,
            "transfer_ms": None if entry.lab_latency_s is None else 1e3 * entry.lab_latency_s,
            "sglang_ms": None if entry.latency_s is None else 1e3 * entry.latency_s,
            "bytes": sum(moved.values())}


def run_lengths(pds: Mapping[str, Deployment], lengths: Sequence[int], *, repeat: int,
                max_new_tokens: int, vocab: int) -> list[dict[str, Any]]:
    """Every length's trials over both deployments, alternating which goes first."""
    rows = []
    for n in lengths:
        trials: dict[str, list[dict[str, Any]]] = {b: [] for b in pds}
        for r, prompt in enumerate(trial_prompts(n, repeat, vocab)):
            for b in (list(pds) if r % 2 == 0 else list(pds)[::-1]):
                trials[b].append(_trial(pds[b], prompt, max_new_tokens))
        same = all(a["tokens"] == b["tokens"]
                   for a, b in zip(*(trials[b] for b in pds), strict=True))
        nbytes = trials[OURS][0]["bytes"]
        rows.append({"prompt_tokens": n, "same_tokens": same, "trials": trials,
                     "memcpy_ms": memcpy_ms(nbytes), "kvhandoff_bytes": nbytes})
        print(f"  {n:5d} tokens: {summary(rows[-1])}", flush=True)
    return rows


def _median(xs: Sequence[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return statistics.median(known) if known else None


def medians(row: Mapping[str, Any], key: str) -> dict[str, float | None]:
    """Per backend, the median of ``key`` over the row's trials, and kvhandoff / Mooncake."""
    out = {b: _median([t[key] for t in ts]) for b, ts in row["trials"].items()}
    ours, theirs = out.get(OURS), out.get(THEIRS)
    out["ratio"] = ours / theirs if ours is not None and theirs else None
    return out


def summary(row: Mapping[str, Any]) -> str:
    x, t = medians(row, "transfer_ms"), medians(row, "ttft_ms")
    return (f"transfer {x[OURS] or 0:.2f} vs {x[THEIRS] or 0:.2f} ms "
            f"({x['ratio'] or 0:.2f}x; memcpy {row['memcpy_ms']:.3f} ms); "
            f"TTFT {t[OURS] or 0:.1f} vs {t[THEIRS] or 0:.1f} ms ({t['ratio'] or 0:.2f}x)"
            f"{'' if row['same_tokens'] else '; TOKENS DIFFER'}")


def goals(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The two goals, each with its worst ratio over the lengths it covers."""
    big = [medians(r, "transfer_ms")["ratio"] for r in rows if r["prompt_tokens"] >= BIG]
    ttft = [medians(r, "ttft_ms")["ratio"] for r in rows]
    out = []
    for what, ratios, goal in (
            (f"transfer, prompts of {BIG}+ tokens (goal <= {TRANSFER_GOAL}x)", big,
             TRANSFER_GOAL),
            (f"TTFT, every prompt length (goal <= {TTFT_GOAL}x)", ttft, TTFT_GOAL)):
        known = [x for x in ratios if x is not None]
        worst = max(known) if known and len(known) == len(ratios) else None
        out.append({"what": what, "worst_ratio": worst, "ratios": ratios,
                    "met": worst is not None and worst <= goal})
    return out


def plot(path: Path, rows: Sequence[Mapping[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(rows)))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "transfer_ms", "transfer, lab ms (median)"),
                           (axes[1], "ttft_ms", "TTFT ms (median)")):
        for off, name in ((-0.2, OURS), (0.2, THEIRS)):
            ax.bar([i + off for i in x], [medians(r, key)[name] or 0 for r in rows],
                   width=0.4, label=name)
        if key == "transfer_ms":
            ax.plot(x, [r["memcpy_ms"] for r in rows], "k.--", label="memcpy, same bytes")
        ax.set_xticks(x, [str(r["prompt_tokens"]) for r in rows])
        ax.set_xlabel("prompt tokens")
        ax.set_title(label)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvhandoff bench sglang", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama", choices=END_TO_END, help="tiny model")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS),
                    help=f"prompt lengths (default {' '.join(map(str, DEFAULT_TOKENS))})")
    ap.add_argument("--repeat", type=int, default=REPEAT,
                    help=f"trials per length, each a new prompt (default {REPEAT})")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    ap.add_argument("--work-dir", type=Path, help="server logs (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 lengths, 3 trials")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.repeat = [64, 512], 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    vocab = int(MODELS[args.model].sizes["vocab_size"])
    with tempfile.TemporaryDirectory(prefix="kvhandoff-bench-sglang-") as tmp:
        logs = args.work_dir or Path(tmp)
        with deployments(args.model, (OURS, THEIRS), log_dir=logs,
                         progress=print_progress(f"{args.model} servers")) as pds:
            for pd in pds.values():  # the first requests pay for lazy set-up: not measured
                for n in (16, max(args.tokens)):  # (reversed: no trial shares its prefix)
                    warm = trial_prompts(n, 1, vocab)[0][::-1]
                    pd.send(warm, max_new_tokens=args.max_new_tokens)
            transport = transport_in_force(pds[OURS])
            print(f"kvhandoff transport in force: {transport} (KVHANDOFF_TRANSPORT)",
                  flush=True)
            rows = run_lengths(pds, args.tokens, repeat=args.repeat,
                               max_new_tokens=args.max_new_tokens, vocab=vocab)
    met = goals(rows)
    print(f"\nkvhandoff ({transport}) / SGLang's Mooncake backend ({THEIRS}), medians of "
          f"{args.repeat} trials, same servers and prompts:")
    for r in rows:
        print(f"  {r['prompt_tokens']:5d} tokens: {summary(r)}")
    for g in met:
        print(f"  {g['what']}: worst {g['worst_ratio'] or 0:.2f}x "
              f"[{'met' if g['met'] else 'NOT met'}]")
    setup = {"model": args.model, "transport": transport, "repeat": args.repeat,
             "max_new_tokens": args.max_new_tokens, "backends": [OURS, THEIRS]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"setup": setup, "rows": rows, "goals": met}, indent=2))
    png = args.json.with_suffix(".png")
    plot(png, rows, f"kvhandoff ({transport}) vs SGLang mooncake_tcp, {args.model}, "
                    f"medians of {args.repeat}")
    print(f"wrote {args.json} and {png}")
    return 0 if all(r["same_tokens"] for r in rows) else 1
