"""``kvhandoff bench busy``: a handoff's time when both processes are engines at work.

An engine's step loop is Python that seldom blocks (vLLM's engine core steps without
pause while a request waits for its KV; SGLang's scheduler polls), so kvhandoff's I/O
threads inside it wait for the GIL at every hop of a handoff, up to the interpreter's
switch interval each time (:mod:`kvhandoff.integrations.gil`). For each transport this
times submit → wait(DONE) of two handoffs, one at a time:

* ``tiny``: ~20 small segments, ~100 KB (a short prompt's pages and state);
* ``state``: 1.4 MiB in scattered 16 KiB pages (what the vLLM demo's hybrid moves for a
  512-token prompt);

in three conditions, interleaved round by round in the same run:

* ``idle``: nothing else runs in either process — the baseline;
* ``busy 5000us``: a busy Python loop (:class:`~kvhandoff.lab.testing.transport.BusyLoop`)
  in both processes at CPython's default switch interval — an engine left as it is;
* ``busy <n>us``: the same at kvhandoff's interval (``SessionConfig.switch_interval_us``),
  what an engine rank runs with.

Goal: busy at kvhandoff's interval ≤ 0.2× busy at CPython's (p50, each transport and
handoff); its ratio to idle is printed beside it, and the engine time each handoff takes
from the busy loop (its turns lost, at the pace it keeps alone), so the cost of the
shorter interval to the engine shows too.
Writes JSON (default ``benchmarks/results/busy.json``) and a PNG next to it.

    kvhandoff bench busy                 # tcp and cma
    kvhandoff bench busy --quick         # fewer samples: seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvhandoff.lab.bench.transport import (
    Remote,
    build,
    carve,
    latency,
    timed_handoff,
    verifier,
)
from kvhandoff.lab.testing.transport import BusyLoop, PlanBuilder, bump
from kvhandoff.plan.model import Plan
from kvhandoff.session.config import SessionConfig
from kvhandoff.transport import available_transports, create_transport

DEFAULT_JSON = Path("benchmarks") / "results" / "busy.json"
TRANSPORTS = ("tcp", "cma")
CPYTHON_US = 5000.0  # CPython's default switch interval
STATE_BYTES = 88 * (16 << 10)  # 1.4 MiB
GOAL = 0.2


def conditions() -> list[tuple[str, float | None]]:
    """``(label, switch interval in µs or None for idle)``, in the order they run."""
    ours = SessionConfig.from_env().switch_interval_us or CPYTHON_US
    return [("idle", None), (f"busy {CPYTHON_US:g}us", CPYTHON_US),
            (f"busy {ours:g}us", ours)]


def _plans(remote: Remote, src: np.ndarray) -> dict[str, tuple[Plan, PlanBuilder]]:
    out = {}
    for name, seed in (("tiny", 11), ("state", 12)):
        b = PlanBuilder(np.random.default_rng(seed), carve(src), bump(remote.base, remote.mirror))
        plan = (Plan(entries=tuple(b.tiny_handoff())) if name == "tiny"
                else build("same_tp_16k", b, STATE_BYTES))
        out[name] = (plan, b)
    return out


def run_transport(name: str, rounds: int, per_round: int) -> dict[str, Any]:
    """Every (handoff, condition) of transport ``name``: latency and engine time."""
    remote = Remote(name, 4 * STATE_BYTES)
    here = BusyLoop()
    samples: dict[str, dict[str, list[float]]] = {}
    lost: dict[str, dict[str, list[float]]] = {}
    out: dict[str, Any] = {}
    src = np.zeros(4 * STATE_BYTES, np.uint8)
    try:
        with create_transport(name) as sender:
            sender.register(src)
            peer = sender.connect(remote.endpoint)

            def once(plan: Plan) -> float:
                return timed_handoff(sender, peer, plan, f"{name}: handoff")

            plans = _plans(remote, src)
            for key, (plan, b) in plans.items():
                check = verifier(remote, b, plan)
                once(plan)
                if not check():
                    raise RuntimeError(f"{name}: {key}: receiver bytes differ from the oracle")
                samples[key] = {label: [] for label, _ in conditions()}
                lost[key] = {label: [] for label, us in conditions() if us is not None}
            for _ in range(rounds):
                _round(once, plans, remote, here, per_round, samples, lost)
            peer.close()
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        here.stop()
        remote.close()
    for key, by in samples.items():
        out[key] = {label: latency(xs) for label, xs in by.items() if xs}
        for label, xs in lost.get(key, {}).items():
            if xs and label in out[key]:
                out[key][label]["engine_ms_per_handoff"] = 1e3 * statistics.median(xs)
    return out


def _round(once: Callable[[Plan], float], plans: dict[str, tuple[Plan, PlanBuilder]],
           remote: Remote, here: BusyLoop, per_round: int,
           samples: dict[str, dict[str, list[float]]],
           lost: dict[str, dict[str, list[float]]]) -> None:
    """One round: every condition in turn, ``per_round`` handoffs of each plan in it."""
    for label, us in conditions():
        pace = 1.0
        if us is None:
            here.stop()
            remote.ask("calm")
        else:
            here.spin(us / 1e6)
            remote.ask(("busy", us / 1e6))
            pace = _pace(here)
        for key, (plan, _) in plans.items():
            for _ in range(3):
                once(plan)  # the loops are running, the caches warm
            t, turns = time.perf_counter(), here.turns
            samples[key][label] += [once(plan) for _ in range(per_round)]
            if us is not None:  # the engine time each handoff took from the loop
                spent = time.perf_counter() - t
                lost[key][label].append((spent - (here.turns - turns) / pace) / per_round)
    here.stop()
    remote.ask("calm")


def _pace(loop: BusyLoop, seconds: float = 0.1) -> float:
    """The loop's turns per second with no handoff running."""
    t, turns = time.perf_counter(), loop.turns
    time.sleep(seconds)
    return max(1.0, (loop.turns - turns) / (time.perf_counter() - t))


def verdicts(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Busy at kvhandoff's interval against busy at CPython's (the goal) and idle, and
    the engine time a handoff takes from the loop at each, per transport and handoff."""
    idle, default, ours = (label for label, _ in conditions())
    out = []
    for name, r in results.items():
        for key in ("tiny", "state"):
            row = r.get(key) or {}
            if not all(c in row for c in (idle, default, ours)):
                continue
            ratio = row[ours]["p50_ms"] / row[default]["p50_ms"]
            out.append({"transport": name, "handoff": key, "vs_cpython": round(ratio, 3),
                        "vs_idle": round(row[ours]["p50_ms"] / row[idle]["p50_ms"], 2),
                        "engine_ms": {c: row[c].get("engine_ms_per_handoff")
                                      for c in (default, ours)},
                        "goal": GOAL, "met": ratio <= GOAL})
    return out


def plot(results: dict[str, dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [label for label, _ in conditions()]
    rows = [(n, k) for n, r in results.items() for k in ("tiny", "state") if r.get(k)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    w = 0.8 / len(labels)
    for i, label in enumerate(labels):
        vals = [results[n][k].get(label, {}).get("p50_ms", 0.0) for n, k in rows]
        ax.bar(np.arange(len(rows)) + i * w, vals, w, label=label)
    ax.set_xticks(np.arange(len(rows)) + 0.4 - w / 2, [f"{n} {k}" for n, k in rows])
    ax.set_yscale("log")
    ax.set_ylabel("submit → done, p50 (ms, log scale)")
    ax.set_title("a handoff while both processes run a busy Python loop")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvhandoff bench busy",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    ap.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated")
    ap.add_argument("--rounds", type=int, default=5, help="rounds over the conditions")
    ap.add_argument("--samples", type=int, default=40, help="handoffs per round and condition")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 15 (seconds)")
    args = ap.parse_args(argv)
    for flag in ("rounds", "samples"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    rounds, per_round = (2, 15) if args.quick else (args.rounds, args.samples)
    have = available_transports()
    results: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for name in (t for t in args.transports.split(",") if t):
        if name not in have or not have[name].ok:
            skipped[name] = have[name].reason if name in have else "unknown transport"
            print(f"  {name:5s} skipped: {skipped[name]}", flush=True)
            continue
        results[name] = r = run_transport(name, rounds, per_round)
        if "error" in r:
            print(f"  {name:5s} {r['error']}", flush=True)
        for key in ("tiny", "state"):
            for label, lat in (r.get(key) or {}).items():
                print(f"  {name:5s} {key:5s} {label:14s} p50 {lat['p50_ms']:7.3f} ms  "
                      f"p99 {lat['p99_ms']:7.3f} ms", flush=True)
    found = verdicts(results)
    for v in found:
        lost = ", ".join(f"{c} {ms:.2f} ms" for c, ms in v["engine_ms"].items()
                         if ms is not None)
        print(f"  {v['transport']} {v['handoff']}: busy at kvhandoff's interval "
              f"{v['vs_cpython']:.3f}x busy at CPython's (goal <= {GOAL:g}x: "
              f"{'met' if v['met'] else 'NOT met'}), {v['vs_idle']:.2f}x idle; engine time "
              f"per handoff: {lost}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                          "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
              "conditions": [label for label, _ in conditions()], "rounds": rounds,
              "samples_per_round": per_round, "results": results, "verdicts": found,
              "skipped": skipped}
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    png = args.json.with_suffix(".png")
    print(f"wrote {args.json}" + (f" and {png}" if plot(results, png) else ""), flush=True)
    return 0 if results and all("error" not in r for r in results.values()) else 1
