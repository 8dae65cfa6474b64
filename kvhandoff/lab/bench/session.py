"""Session benchmark: whole handoffs between a prefill and a decode process, loopback tcp.

Both sides run in spawned processes with a real bootstrap server and real control
sockets (the same code path as serving). Measured, with the machine's own reference
taken in the same run:

Runs over loopback tcp by default (``--transport`` picks another).

* **latency** — a tiny request (1 KV page in each of 8 attention layers and one Mamba
  slot, plus the aux row), one at a time. *handoff*: from prefill's last ``send`` (its
  decode indices already in) to decode's ``SUCCESS``; *round trip*: from decode creating
  the ``Receiver`` to ``SUCCESS`` (indices to prefill, write, status back). p50 / p90 /
  p99. Goal: handoff p50 ≤ 0.6 ms. Reference: one raw tcp transport write of the same plan
  (built beforehand); *session overhead* = handoff p50 − raw write p50 in the same run:
  what the session adds (planning, the status message, decode's checks and wake-up).
* **metrics overhead** — the same tiny handoffs with the agents' Prometheus metrics on
  and off (``SessionConfig.metrics``), in alternating blocks: the ratio of the p50s.
  Goal: ≤ 1.02×.
* **throughput** — 64, 256 and 1,024 such requests at once, repeated: handoffs/s, next
  to the raw tcp transport's requests/s for the same plans (submitted together, waited
  together), rounds alternating between the two; the ratio of the medians and how the
  rate scales with the number of requests in flight (the plot's middle panel). Goal at
  64: ≥ 0.8× raw (``--rounds``: how many rounds at 64, default 5 with ``--quick``, else
  30; 256 and 1,024 run as many requests in fewer rounds, at least 3). Each side builds
  its requests' index lists before the clock starts, as the raw side builds its plans:
  an engine already holds them. Each side opens a round's requests inside
  ``Agent.batched_writes()``, as an engine step does (the vLLM connector's ``start``):
  on prefill the writes of requests whose indices are already in go out together
  instead of one submit each; on decode the indices go out as one message per
  prefill rank instead of one per request.
* **big** — one hybrid request of ~64 MiB (16 layers: 12 GDN with their SSM/conv state,
  4 attention layers of KV) in one chunk: session handoff time next to the bare
  transport time for the same plan, alternating (each session handoff is followed by a
  raw write, so both see the same interference); the ratio is the median of the pairs'
  ratios. Goal: ≤ 1.1×.
* **auth overhead** (``--auth``) — the tiny handoffs and the big one with the deployment
  secret (every control message signed and checked, :mod:`kvhandoff.session.control.auth`;
  plus whatever the transport authenticates with it) and without, in alternating
  blocks of the same run: the ratios of the p50s. Goals: tiny ≤ 1.05×, big ≤ 1.01×.
  ``--auth-only`` runs just this comparison.

    kvhandoff bench session [--json PATH] [--quick] [--transport NAME] [--control-status]
                            [--auth | --auth-only | --throughput-only] [--rounds N]

``--throughput-only`` runs just the concurrent rounds; with many (``--rounds 300``) it
gives the steady-state rate, which a 5-round ``--quick`` median only samples.

On tcp a chunk's status reaches decode in band, with the writes
(:mod:`kvhandoff.session.rank.notices`); ``--control-status`` sends it over the control
socket instead, as on transports without notices.

Both processes freeze the heap start-up left (``gc.freeze()``) before measuring, as
vLLM's engine core does once it is up; the raw baseline shares that heap.

Writes JSON (default ``benchmarks/results/session.json``) and a PNG next to it. Measures
only; the test suite asserts correctness.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab import shapes
from kvhandoff.lab.shapes import LayerKind
from kvhandoff.layout import Layout
from kvhandoff.plan import Plan, plan
from kvhandoff.protocol import layout_from_msg, layout_to_msg
from kvhandoff.session import (
    Agent,
    DecodeAgent,
    PrefillAgent,
    Receiver,
    Sender,
    SessionConfig,
    Status,
)
from kvhandoff.transport import Peer, TransferState, Transport, create_transport

DEFAULT_JSON = Path("benchmarks") / "results" / "session.json"
TIMEOUT = 120.0
CONCURRENT = 64  # the headline point (``throughput``)
CONCURRENCY = (CONCURRENT, 256, 1024)  # the scaling curve (``scaling``)


def tiny_shape() -> shapes.ModelShape:
    """8 attention layers (1 KV page each per request) and one GDN layer (one Mamba slot)."""
    base = shapes.tiny(shapes.get("qwen3_next"))
    return dataclasses.replace(base, name="bench_tiny",
                               layers=(LayerKind.ATTN,) * 8 + (LayerKind.GDN,))


def big_shape() -> shapes.ModelShape:
    """A Qwen3-Next-like hybrid: 12 GDN + 4 attention layers; ~12 MiB of state per request
    and 4 KiB of KV per token."""
    return dataclasses.replace(
        shapes.get("qwen3_next"), name="bench_hybrid",
        layers=(LayerKind.GDN, LayerKind.GDN, LayerKind.GDN, LayerKind.ATTN) * 4,
        kv_heads=2, head_dim=128, linear_k_heads=16, linear_k_dim=128, linear_v_heads=16,
        linear_v_dim=128)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    shape: str  # "tiny" or "big"
    page: int
    tokens: int
    pages: int
    slots: int


def _shape(name: str) -> shapes.ModelShape:
    return tiny_shape() if name == "tiny" else big_shape()


def _layout(case: Case, seed: int) -> tuple[Layout, list[np.ndarray]]:
    bufs: list[np.ndarray] = []

    def alloc(n: int) -> int:
        b = np.random.default_rng([seed, len(bufs)]).integers(0, 256, n, dtype=np.uint8)
        bufs.append(b)
        return int(b.ctypes.data)

    lay = shapes.layout_for(_shape(case.shape), tp_rank=0, tp_size=1, page_size=case.page,
                            num_pages=case.pages, num_slots=case.slots, alloc=alloc)
    return lay, bufs


def _request(case: Case, src: Layout, dst: Layout, i: int) -> dict[str, Any]:
    """Request ``i``: its own pages (block i) and slot ``i + 1`` on both sides."""
    req = shapes.request_for(_shape(case.shape), src, dst, case.tokens, contiguous=True,
                             src_slot=i + 1, dst_slot=i + 1)
    per = -(-case.tokens // case.page)
    out: dict[str, Any] = {}
    for name, idx in req.items():
        if name == "kv" and idx is not None:
            idx = type(idx)(idx.src + i * per, idx.dst + i * per)
        out[name] = idx
    return out


P50_GOAL_MS = 0.6  # a tiny handoff's p50
STEADY_ROUNDS = 30  # fewer rounds at 64 concurrent sample the rate, warm-up and all

UNMETERED = "-unmetered"  # a phase name's suffix: its agents count nothing in the metrics
AUTHED = "-auth"  # a phase name's suffix: its agents hold the deployment secret


def _kind(phase: str) -> str:
    """``latency``, ``throughput`` or ``big``, whatever the phase's suffix."""
    return phase.split("-", 1)[0]


def _config(instance: str, transport: str, in_band: bool = True, secret_file: str = ""
            ) -> SessionConfig:
    """An agent's settings: the authenticated phases (``AUTHED``) hold the bench's secret,
    the others none (``insecure``: the unauthenticated baseline they are compared with)."""
    authed = instance.endswith(AUTHED) and bool(secret_file)
    return SessionConfig.from_env({}, instance=instance, transport=transport,
                                  in_band_status=in_band,
                                  secret_file=secret_file if authed else "",
                                  insecure=not authed,
                                  metrics=not instance.endswith(UNMETERED),
                                  transfer_timeout=TIMEOUT,
                                  waiting_timeout=TIMEOUT, indices_timeout=TIMEOUT,
                                  bootstrap_timeout=30.0, heartbeat_interval=1.0,
                                  heartbeat_timeout=30.0)


# ---------------------------------------------------------------------------------------
# The two processes


def _prefill(conn: Connection, url: str, transport: str, secret_file: str) -> None:
    for _ in range(100):
        cmd = conn.recv()
        if cmd[0] == "exit":
            return
        _, phase, case, n, rounds, dst_msg = cmd
        src, bufs = _layout(case, 1)
        dst = layout_from_msg(dst_msg)
        with Agent.prefill(src, bootstrap_url=url,
                           config=_config(f"bench-{phase}", transport,
                                          secret_file=secret_file)) as agent, \
                create_transport(transport) as raw:
            raw.register(src)
            conn.send(("ready",))
            peer = raw.connect(conn.recv())  # decode's raw receiver
            count = n if _kind(phase) == "throughput" else 1
            plans = [plan(src, dst, _request(case, src, dst, i)) for i in range(count)]
            for _ in range(3):  # warm the raw connection up
                _raw_once(raw, peer, plans)
            with _static_heap():
                if _kind(phase) == "throughput":
                    _prefill_rounds(conn, agent, raw, peer, plans, case, src, dst, n, rounds)
                else:
                    conn.send(_prefill_one_by_one(agent, raw, peer, plans, case, src, dst, n,
                                                  interleave=_kind(phase) == "big"))
            peer.close()
            conn.recv()  # decode is done: close
        del bufs


@contextlib.contextmanager
def _static_heap() -> Iterator[None]:
    """Measure as a serving engine runs: with what start-up allocated frozen out of the
    garbage collector (vLLM's engine core calls ``gc.freeze()`` once it is up), so that
    the oldest generation's collections do not walk it. The session and the raw baseline
    run in the same processes, under the same heap."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _send_all(s: Sender, req: dict[str, Any], src: Layout) -> None:
    state = {c.name: req[c.name].src for c in src.components if c.name not in ("kv", "aux")}
    s.send(req["kv"].src, state_indices=state, last=True)


def _raw_once(t: Transport, peer: Peer, plans: list[Plan]) -> float:
    """The bare transport moving the same plans, all submitted, then all waited for."""
    t0 = time.perf_counter()
    hs = [t.submit(peer, p) for p in plans]
    for h in hs:
        if t.wait(h, TIMEOUT) is not TransferState.DONE:
            raise RuntimeError(f"raw transfer failed: {h.error}")
        h.release()
    return time.perf_counter() - t0


def _prefill_one_by_one(agent: PrefillAgent, raw: Transport, peer: Peer, plans: list[Plan],
                        case: Case, src: Layout, dst: Layout, n: int, *, interleave: bool
                        ) -> tuple[list[float], list[float]]:
    """Per request: wait for decode's indices, then stamp t0 and send the last chunk.
    Raw writes of the same plan either follow each request (``interleave``: both see the
    same interference) or run after the loop."""
    t0s, raws = [], []
    for i in range(n):
        req = _request(case, src, dst, i % (case.slots - 1))
        s = Sender(agent, i)
        s.init(len(req["kv"].src), int(req["aux"].src[0]))
        s.wait_bootstrapped(TIMEOUT)
        t0s.append(time.perf_counter())
        _send_all(s, req, src)
        s.wait(TIMEOUT)
        if interleave:
            raws.append(_raw_once(raw, peer, plans))
    if not interleave:
        raws = [_raw_once(raw, peer, plans) for _ in range(min(n, 200))]
    return t0s, raws


def _prefill_rounds(conn: Connection, agent: PrefillAgent, raw: Transport, peer: Peer,
                    plans: list[Plan], case: Case, src: Layout, dst: Layout, n: int,
                    rounds: int) -> None:
    """Each round on the parent's signal: n requests at once, then the raw n plans."""
    reqs = [_request(case, src, dst, i) for i in range(n)]  # the engine holds these
    for r in range(rounds):
        conn.recv()  # go
        senders = []
        with agent.batched_writes():  # one engine step hands them all over
            for i, req in enumerate(reqs):
                s = Sender(agent, r * n + i)
                s.init(len(req["kv"].src), int(req["aux"].src[0]))
                _send_all(s, req, src)  # queued until decode's indices arrive
                senders.append(s)
        bad = [str(s.reason) for s in senders if s.wait(TIMEOUT) is not Status.SUCCESS]
        conn.send(bad)
        conn.recv()  # raw
        conn.send(_raw_once(raw, peer, plans))


def _decode(conn: Connection, url: str, transport: str, in_band: bool, secret_file: str
            ) -> None:
    lay: Layout | None = None
    bufs: list[np.ndarray] = []  # keeps the layout's memory alive
    for _ in range(100):
        cmd = conn.recv()
        if cmd[0] == "exit":
            return
        if cmd[0] == "layout":
            lay, bufs = _layout(cmd[1], 2)
            conn.send(layout_to_msg(lay))
            continue
        _, phase, case, n, rounds = cmd
        assert lay is not None and bufs
        with Agent.decode(lay, config=_config(f"bench-{phase}", transport, in_band,
                                              secret_file)) as agent, \
                create_transport(transport) as raw:  # the raw baseline's receiver
            raw.register(lay)
            conn.send(raw.endpoint())
            with _static_heap():
                if _kind(phase) == "throughput":
                    # the engine holds its requests' index lists: built before the clock
                    reqs = [_request(case, lay, lay, i) for i in range(n)]
                    for r in range(rounds):
                        conn.recv()  # go
                        conn.send(_decode_round(agent, url, reqs, lay, r))
                else:
                    conn.send(_decode_one_by_one(agent, url, case, lay, n))
            conn.recv()  # prefill is done: close


def _dst_lists(req: dict[str, Any], lay: Layout) -> dict[str, Any]:
    return {c.name: req[c.name].dst for c in lay.components if c.name != "aux"}


def _decode_one_by_one(agent: DecodeAgent, url: str, case: Case, lay: Layout, n: int
                       ) -> tuple[list[float], list[float]]:
    starts, ends = [], []
    for i in range(n):
        req = _request(case, lay, lay, i % (case.slots - 1))
        t = time.perf_counter()
        r = Receiver(agent, url, i)
        r.init(_dst_lists(req, lay), int(req["aux"].dst[0]))
        if r.wait(TIMEOUT) is not Status.SUCCESS:
            raise RuntimeError(f"request {i} failed: {r.reason}")
        ends.append(time.perf_counter())
        starts.append(t)
    return starts, ends


def _decode_round(agent: DecodeAgent, url: str, reqs: list[dict[str, Any]], lay: Layout, r: int
                  ) -> float:
    n = len(reqs)
    t = time.perf_counter()
    recvs = []
    with agent.batched_writes():  # one engine step opens them all: one message per rank
        for i, req in enumerate(reqs):
            x = Receiver(agent, url, r * n + i)
            x.init(_dst_lists(req, lay), int(req["aux"].dst[0]))
            recvs.append(x)
    for x in recvs:
        if x.wait(TIMEOUT) is not Status.SUCCESS:
            raise RuntimeError(f"request {x.request_id} failed: {x.reason}")
    return time.perf_counter() - t


# ---------------------------------------------------------------------------------------
# The parent


class Pair:
    def __init__(self, url: str, transport: str, in_band: bool, secret_file: str = "") -> None:
        ctx = mp.get_context("spawn")
        self.p, pc = ctx.Pipe()
        self.d, dc = ctx.Pipe()
        self.procs = [ctx.Process(target=_prefill, args=(pc, url, transport, secret_file),
                                  daemon=True),
                      ctx.Process(target=_decode, args=(dc, url, transport, in_band,
                                                        secret_file), daemon=True)]
        for p in self.procs:
            p.start()

    def run(self, phase: str, case: Case, n: int, rounds: int = 1) -> dict[str, Any]:
        self.d.send(("layout", case))
        dst = self._recv(self.d)
        self.p.send(("run", phase, case, n, rounds, dst))
        self._recv(self.p)  # registered
        self.d.send(("run", phase, case, n, rounds))
        self.p.send(self._recv(self.d))  # the raw receiver's endpoint
        out: dict[str, Any]
        if _kind(phase) == "throughput":
            sess, raw, bad = [], [], []
            for _ in range(rounds):  # alternate: both see the same interference
                self.p.send(("go",))
                self.d.send(("go",))
                sess.append(self._recv(self.d))
                bad += self._recv(self.p)
                self.p.send(("raw",))
                raw.append(self._recv(self.p))
            out = {"decode": sess, "raw": raw, "failures": bad}
        else:
            t0s, raws = self._recv(self.p)
            out = {"prefill": t0s, "raw": raws, "decode": self._recv(self.d)}
        self.d.send(("close",))
        self.p.send(("close",))
        return out

    def _recv(self, conn: Connection) -> Any:
        if not conn.poll(TIMEOUT * 2):
            raise RuntimeError("a benchmark process did not answer in time")
        return conn.recv()  # EOFError if it died

    def close(self) -> None:
        for c in (self.p, self.d):
            c.send(("exit",))
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1e3, q)) if xs else 0.0


def _summary(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": _pct(xs, 50), "p90_ms": _pct(xs, 90), "p99_ms": _pct(xs, 99),
            "mean_ms": float(np.mean(xs) * 1e3) if xs else 0.0, "n": len(xs)}


def run(quick: bool, transport: str = "tcp", in_band: bool = True, *, auth: bool = False,
        only_auth: bool = False, only_throughput: bool = False, rounds: int | None = None
        ) -> dict[str, Any]:
    """Every measurement, or only the auth comparison (``only_auth``) or only the
    concurrent rounds (``only_throughput``); ``rounds``: at 64 concurrent (default 5 with
    ``quick``, else 30), fewer at 256 and 1,024 (at least 3)."""
    n_lat = 200 if quick else 2000
    rounds = rounds if rounds is not None else 5 if quick else 30
    most = max(CONCURRENCY)
    tiny = Case("tiny", "tiny", page=16, tokens=16, pages=most + 2, slots=most + 2)
    big = Case("big", "big", page=64, tokens=13_000, pages=208, slots=2)
    out: dict[str, Any] = {"machine": platform.platform(), "python": sys.version.split()[0],
                           "cpus": os.cpu_count(), "transport": transport, "quick": quick,
                           "in_band_status": in_band}
    # the registry takes both the authenticated and the open phases' ranks
    with BootstrapServer(insecure=True) as srv, tempfile.TemporaryDirectory() as tmp:
        secret = ""
        if auth or only_auth:
            from kvhandoff.secret import write_secret_file
            secret = write_secret_file(os.path.join(tmp, "secret"))
        pair = Pair(srv.url, transport, in_band, secret)
        try:
            if secret:
                out["auth_overhead"] = _auth_overhead(pair, tiny, big, n_lat // 2,
                                                      8 if quick else 40)
            if only_auth:
                return out
            if only_throughput:
                _scaling(out, pair, tiny, rounds)
                return out
            lat = pair.run("latency", tiny, n_lat)
            t0s, (starts, ends) = lat["prefill"], lat["decode"]
            skip = min(50, n_lat // 10)  # warm-up
            handoff = [e - t for t, e in zip(t0s, ends, strict=True)][skip:]
            round_trip = [e - s for s, e in zip(starts, ends, strict=True)][skip:]
            raw_lat = _summary(lat["raw"])
            hand = _summary(handoff)
            out["latency"] = {"handoff": hand, "round_trip": _summary(round_trip),
                              "raw_transport_write": raw_lat,
                              "session_overhead_p50_ms": hand["p50_ms"] - raw_lat["p50_ms"],
                              "bytes": _plan_bytes(tiny)}
            out["metrics_overhead"] = _metrics_overhead(pair, tiny, n_lat // 2, skip)
            _scaling(out, pair, tiny, rounds)
            reps = 8 if quick else 40
            bg = pair.run("big", big, reps)
            t0s, (_, ends) = bg["prefill"], bg["decode"]
            times = [e - t for t, e in zip(t0s, ends, strict=True)][1:]
            raws = bg["raw"][1:]
            out["big"] = {"bytes": _plan_bytes(big), "session_ms": _summary(times),
                          "raw_transport_ms": _summary(raws),
                          "session_overhead_p50_ms": _pct(times, 50) - _pct(raws, 50),
                          # each session rep next to the raw write right after it
                          "ratio": statistics.median(a / b for a, b in zip(times, raws,
                                                                          strict=True))}
        finally:
            pair.close()
    return out


def _scaling(out: dict[str, Any], pair: Pair, case: Case, rounds: int) -> None:
    """``out["scaling"]``: every concurrency of :data:`CONCURRENCY`, ``rounds`` at the
    headline one and as many requests in all at the others (at least 3 rounds);
    ``out["throughput"]``: the headline point."""
    out["scaling"] = [_throughput(pair, case, n, max(3, rounds * CONCURRENT // n))
                      for n in CONCURRENCY]
    out["throughput"] = out["scaling"][0]


def _throughput(pair: Pair, case: Case, n: int, rounds: int) -> dict[str, Any]:
    """``n`` tiny requests at once, ``rounds`` times (the first a warm-up), each round
    followed by the raw transport moving the same ``n`` plans: both rates and their
    ratio (of the medians)."""
    thr = pair.run("throughput", case, n, rounds + 1)
    sess, raw = thr["decode"][1:], thr["raw"][1:]
    rate, raw_rate = n / statistics.median(sess), n / statistics.median(raw)
    return {"concurrent": n, "rounds": len(sess), "handoffs_per_s": rate,
            "raw_transport_requests_per_s": raw_rate, "ratio": rate / raw_rate,
            "failures": thr["failures"]}


def _auth_overhead(pair: Pair, tiny: Case, big: Case, n: int, reps: int, blocks: int = 4
                   ) -> dict[str, float]:
    """Tiny and big handoffs with the deployment secret and without, in alternating
    blocks, ABBA (both see the same interference): the p50s and their ratios, of the handoff
    (last send to SUCCESS: on tcp the status travels in band, so no control message is
    on this path unless ``--control-status``) and, for tiny, of the round trip (the
    Receiver's indices to prefill, the write, the status back)."""
    out: dict[str, float] = {}
    for name, case, count, skip in (("tiny", tiny, n // blocks, min(50, n // blocks // 4)),
                                    ("big", big, max(2, reps // blocks), 1)):
        on: dict[str, list[float]] = {"": [], "_round_trip": []}
        off: dict[str, list[float]] = {"": [], "_round_trip": []}
        for b in range(2 * blocks):
            authed = b % 4 in (0, 3)  # ABBA: neither mode always goes first
            phase = ("latency" if name == "tiny" else "big") + (AUTHED if authed else "")
            res = pair.run(phase, case, count)
            t0s, (starts, ends) = res["prefill"], res["decode"]
            into = on if authed else off
            into[""] += [e - t for t, e in zip(t0s, ends, strict=True)][skip:]
            into["_round_trip"] += [e - t for t, e in zip(starts, ends, strict=True)][skip:]
        for what in ("", "_round_trip") if name == "tiny" else ("",):
            p_on, p_off = _pct(on[what], 50), _pct(off[what], 50)
            out |= {f"{name}{what}_auth_p50_ms": p_on, f"{name}{what}_plain_p50_ms": p_off,
                    f"{name}{what}_ratio": p_on / p_off if p_off else 0.0}
        out[f"{name}_n_each"] = len(on[""])
    return out


def _metrics_overhead(pair: Pair, case: Case, n: int, skip: int, blocks: int = 4
                      ) -> dict[str, float]:
    """Tiny handoffs with the agents' metrics on and off, in alternating blocks (both see
    the same interference): the p50s and their ratio."""
    on: list[float] = []
    off: list[float] = []
    for b in range(2 * blocks):
        metered = b % 2 == 0
        lat = pair.run("latency" if metered else "latency" + UNMETERED, case, n // blocks)
        t0s, (_, ends) = lat["prefill"], lat["decode"]
        times = [e - t for t, e in zip(t0s, ends, strict=True)][min(skip, n // blocks // 4):]
        (on if metered else off).extend(times)
    p_on, p_off = _pct(on, 50), _pct(off, 50)
    return {"metrics_on_p50_ms": p_on, "metrics_off_p50_ms": p_off,
            "ratio": p_on / p_off if p_off else 0.0, "n_each": len(on)}


def _plan_bytes(case: Case) -> int:
    src, _ = _layout(case, 1)
    return plan(src, src, _request(case, src, src, 0)).nbytes


def _plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    lat = res["latency"]
    names = ["handoff", "round_trip", "raw_transport_write"]
    for q, off in (("p50_ms", -0.25), ("p99_ms", 0.25)):
        ax[0].bar([i + off for i in range(3)], [lat[n][q] for n in names], 0.45, label=q)
    ax[0].axhline(P50_GOAL_MS, color="k", ls="--", lw=0.8, label=f"{P50_GOAL_MS} ms goal")
    ax[0].set_xticks(range(3), ["handoff", "round trip", "raw write"])
    ax[0].set_ylabel("ms")
    ax[0].set_title(f"tiny request latency ({lat['bytes']} B)")
    ax[0].legend()
    pts = res["scaling"]
    ns = [p["concurrent"] for p in pts]
    ax[1].plot(ns, [p["handoffs_per_s"] for p in pts], "o-", label="kvhandoff handoffs/s")
    ax[1].plot(ns, [p["raw_transport_requests_per_s"] for p in pts], "s--",
               label="raw transport requests/s")
    for p in pts:
        ax[1].annotate(f"{p['ratio']:.2f}x", (p["concurrent"], p["handoffs_per_s"]),
                       textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
    ax[1].set_xscale("log", base=2)
    ax[1].set_xticks(ns, [str(n) for n in ns])
    ax[1].set_ylim(bottom=0)
    ax[1].set_xlabel("tiny requests in flight")
    ax[1].set_ylabel("requests/s")
    ax[1].set_title("concurrent tiny requests (same run)")
    ax[1].legend()
    big = res["big"]
    ax[2].bar(["session", "bare transport"],
              [big["session_ms"]["p50_ms"], big["raw_transport_ms"]["p50_ms"]])
    ax[2].set_ylabel("ms (p50)")
    ax[2].set_title(f"{big['bytes'] / 2**20:.0f} MiB hybrid handoff: {big['ratio']:.2f}x "
                    f"(goal <= 1.1x)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _print_scaling(res: dict[str, Any]) -> None:
    for p in res["scaling"]:
        verdict = ""
        if p is res["throughput"]:
            verdict = (f"  [{p['rounds']} rounds sample the rate; the goal (>= 0.8x) is for "
                       f"the steady state: --throughput-only --rounds 300]"
                       if p["rounds"] < STEADY_ROUNDS else
                       f"  [goal >= 0.8x: {'met' if p['ratio'] >= 0.8 else 'NOT met'}]")
        print(f"{p['concurrent']} concurrent ({p['rounds']} rounds): {p['handoffs_per_s']:.0f} "
              f"handoffs/s vs raw transport {p['raw_transport_requests_per_s']:.0f} "
              f"requests/s = {p['ratio']:.2f}x{verdict}")


def _args(argv: list[str] | None) -> argparse.Namespace:
    """The bench's flags, checked (``--rounds`` at least 1)."""
    ap = argparse.ArgumentParser(prog="kvhandoff bench session",
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (seconds)")
    ap.add_argument("--transport", default="tcp", help="transport to run over (default tcp)")
    ap.add_argument("--control-status", action="store_true",
                    help="send chunk statuses over the control socket even where the "
                         "transport could carry them in band (to measure the difference)")
    ap.add_argument("--auth", action="store_true",
                    help="also compare handoffs with the deployment secret and without")
    ap.add_argument("--auth-only", action="store_true",
                    help="run only the comparison with and without the deployment secret")
    ap.add_argument("--throughput-only", action="store_true",
                    help="run only the concurrent rounds (with --rounds: a steady state)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds of 64 concurrent requests (default 5 with --quick, else 30); "
                         "256 and 1,024 run as many requests in fewer rounds")
    args = ap.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    res = run(args.quick, args.transport, in_band=not args.control_status, auth=args.auth,
              only_auth=args.auth_only, only_throughput=args.throughput_only,
              rounds=args.rounds)
    if "auth_overhead" in res:
        ao = res["auth_overhead"]
        for name, goal in (("tiny", 1.05), ("tiny_round_trip", 1.05), ("big", 1.01)):
            r = ao[f"{name}_ratio"]
            print(f"auth on vs off, {name} handoff (alternating blocks, same run): p50 "
                  f"{ao[f'{name}_auth_p50_ms']:.3f} vs {ao[f'{name}_plain_p50_ms']:.3f} ms = "
                  f"{r:.3f}x [goal <= {goal}x: {'met' if r <= goal else 'NOT met'}]")
    if args.auth_only or args.throughput_only:
        if args.throughput_only:
            _print_scaling(res)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")
        return 0
    lat, big = res["latency"], res["big"]
    print(f"tiny handoff ({lat['bytes']} B): p50 {lat['handoff']['p50_ms']:.3f} ms, "
          f"p99 {lat['handoff']['p99_ms']:.3f} ms  [goal p50 <= {P50_GOAL_MS} ms: "
          f"{'met' if lat['handoff']['p50_ms'] <= P50_GOAL_MS else 'NOT met'}]")
    print(f"tiny session overhead (handoff p50 - raw transport write p50, same run): "
          f"{lat['session_overhead_p50_ms']:.3f} ms; raw transport write p50 "
          f"{lat['raw_transport_write']['p50_ms']:.3f} ms")
    mo = res["metrics_overhead"]
    print(f"metrics on vs off (alternating blocks, same run): p50 {mo['metrics_on_p50_ms']:.3f}"
          f" vs {mo['metrics_off_p50_ms']:.3f} ms = {mo['ratio']:.3f}x [goal <= 1.02x: "
          f"{'met' if mo['ratio'] <= 1.02 else 'NOT met'}]")
    print(f"tiny round trip: p50 {lat['round_trip']['p50_ms']:.3f} ms, "
          f"p99 {lat['round_trip']['p99_ms']:.3f} ms")
    _print_scaling(res)
    print(f"big ({big['bytes'] / 2**20:.1f} MiB): session p50 {big['session_ms']['p50_ms']:.1f} "
          f"ms vs bare transport {big['raw_transport_ms']['p50_ms']:.1f} ms = "
          f"{big['ratio']:.2f}x [goal <= 1.1x: {'met' if big['ratio'] <= 1.1 else 'NOT met'}]; "
          f"session overhead {big['session_overhead_p50_ms']:.1f} ms")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=2))
    _plot(res, args.json.with_suffix(".png"))
    print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
