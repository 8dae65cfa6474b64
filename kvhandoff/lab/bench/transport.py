"""Transport benchmark: two processes on 127.0.0.1, next to this machine's own limits.

The receiver runs in a spawned child process (``kvhandoff.lab.testing.transport.serve_peer``),
the sender here. Each case moves one plan: first a warm-up checked byte-exact (sha256
of the receiver's buffer against the numpy executor applied to a local mirror), then
``--reps`` rounds; a round samples the references and then times every case once, so
a transport's cases and the references share the same moments and ratios are taken
round by round (the machine may be shared: its speed drifts). References: single-
thread memcpy (``np.copyto``), a raw Python socket ``sendall`` → ``recv_into`` to a
child process, a numpy gather of scattered pages (once), and Mooncake's own engine
API (``batch_transfer_sync_write``, ≤1024 requests per call: its default queue) on
the same plans into the same receiver.

Cases (``--mib`` total bytes moved, default 256 MiB):
  pages_4k / pages_32k / pages_256k   scattered pages, random permutation on both sides
  same_tp_16k                         16 KiB pages (the head-sliced case's reference)
  head_sliced                         prefill TP2 → decode TP1: each 16 KiB source page
                                      lands as 16 rows of 1 KiB in every other 1 KiB of a
                                      32 KiB destination page (the other rank's half)
  block                               one contiguous segment
  tiny                                latency, not bandwidth: a tiny handoff (one 4 KiB
                                      page per layer for K and V, 8 layers, a Mamba slot
                                      in four pieces, an aux row: ~20 segments, ~100 KB)
                                      submitted and waited for one at a time; p50/p99 of
                                      submit → wait(DONE), next to a raw socket ping-pong
                                      of the same bytes (1-byte ack) in the same run

Every run also records the CPU time both processes spend (CPU-s per GB moved: unlike
GB/s, barely disturbed by other work on the machine). After its cases each transport
idles for a second, connected, and the CPU both processes use meanwhile is recorded
(an idle transport must not spin).

    kvhandoff bench transport                    # tcp, shm, cma, mooncake, nixl: minutes
    kvhandoff bench transport --quick            # 32 MiB, 2 reps: seconds
    python benchmarks/transport.py --transports tcp,nixl --json out.json

Writes ``--json`` (default benchmarks/results/transport.json) and a PNG next to it,
and prints every goal as met / NOT met with its ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import platform
import resource
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvhandoff.lab.testing.transport import PlanBuilder, bump, noise, serve_peer
from kvhandoff.plan.model import Plan
from kvhandoff.transport import TransferState, available_transports, create_transport

DEFAULT_JSON = Path("benchmarks") / "results" / "transport.json"
CASES = ("pages_4k", "pages_32k", "pages_256k", "same_tp_16k", "head_sliced", "block", "tiny")
TINY_N = 400  # timed tiny submits per transport, after TINY_WARM untimed ones
TINY_WARM = 40
TINY_GOAL_S = 0.4e-3  # the bare tcp transport's share of the session's 1 ms budget
TRANSPORTS = ("tcp", "shm", "cma", "mooncake", "nixl")
TIMEOUT = 300.0
RAW_BATCH = 1024  # Mooncake's default per-peer queue; more in one call is rejected


@dataclass
class Row:
    """One (path, case): seconds per repetition, after a verified warm-up."""

    path: str  # a transport name, or "mooncake-raw"
    case: str
    nbytes: int
    segments: int
    seconds: list[float] = field(default_factory=list)
    refs: list[dict[str, float]] = field(default_factory=list)  # same-round references
    cpu: list[tuple[float, float]] = field(default_factory=list)  # (sender, receiver) CPU-s
    verified: bool = False
    error: str = ""

    def rates(self) -> list[float]:
        """GB/s of every repetition, in round order."""
        return [self.nbytes / t / 1e9 for t in self.seconds]

    @property
    def gbps(self) -> float:
        return self.nbytes / statistics.median(self.seconds) / 1e9 if self.seconds else 0.0

    @property
    def segs_per_s(self) -> float:
        return self.segments / statistics.median(self.seconds) if self.seconds else 0.0

    def cpu_per_gb(self) -> tuple[float, float]:
        """Median CPU seconds per GB moved: (sender process, receiver process). Unlike
        GB/s, barely affected by other work on the machine."""
        if not self.cpu:
            return 0.0, 0.0
        gb = self.nbytes / 1e9
        return (statistics.median(c[0] for c in self.cpu) / gb,
                statistics.median(c[1] for c in self.cpu) / gb)


@dataclass(frozen=True)
class Goal:
    """``ratio``: the median over rounds of (value / reference measured in the same
    round) where both were sampled round by round, else the ratio of medians."""

    name: str
    ratio: float
    goal: float
    how: str

    @property
    def met(self) -> bool:
        return self.ratio >= self.goal


# --- baselines ---------------------------------------------------------------------------


def gather_gbps(nbytes: int, page: int, reps: int) -> float:
    """Single-thread numpy gather of randomly permuted ``page``-byte pages."""
    src = noise(np.random.default_rng(0), nbytes).reshape(-1, page)
    dst = np.empty_like(src)
    idx = np.random.default_rng(1).permutation(len(src))
    np.take(src, idx, axis=0, out=dst, mode="clip")
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        np.take(src, idx, axis=0, out=dst, mode="clip")
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def pattern_copy_gbps(nbytes: int, reps: int) -> dict[str, float]:
    """The machine's own cost of the head-sliced pattern: single-thread in-process numpy
    copies of the same_tp_16k plan (randomly placed 16 KiB pages) and of the head_sliced
    plan (1 KiB rows into every other 1 KiB of 32 KiB pages), each with the best numpy
    form found (one element per page / per row). Their ratio is what memory alone allows
    a head-sliced plan next to a same-TP one, before any transport is involved."""
    row, page = 1 << 10, 16 << 10
    pages = nbytes // page
    src = noise(np.random.default_rng(2), pages * page)
    same_dst = np.empty_like(src)
    sliced_dst = np.empty(2 * len(src), np.uint8)
    perm = np.random.default_rng(3).permutation(pages)
    s_pages, d_pages = src.view(f"V{page}"), same_dst.view(f"V{page}")
    s_rows = src.view(f"V{row}").reshape(pages, page // row)
    d_rows = sliced_dst.view(f"V{row}").reshape(pages, page // row, 2)[:, :, 1]

    def same() -> None:
        d_pages[perm] = s_pages

    def sliced() -> None:
        np.copyto(d_rows, s_rows)

    out = {}
    for key, fn in (("copy_same_tp_16k_gbps", same), ("copy_head_sliced_gbps", sliced)):
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[key] = nbytes / statistics.median(times) / 1e9
    return out


def _socket_sink(port_conn: Any, nbytes: int) -> None:
    """Receive ``nbytes`` messages into one buffer and ack each with a byte, until EOF."""
    srv = socket.create_server(("127.0.0.1", 0))
    port_conn.send(srv.getsockname()[1])
    srv.settimeout(60)
    conn, _ = srv.accept()
    conn.settimeout(600)
    buf = np.zeros(nbytes, np.uint8)
    mv = memoryview(buf.data)
    while True:
        got = 0
        while got < nbytes:
            n = conn.recv_into(mv[got:])
            if not n:
                return
            got += n
        conn.sendall(b"k")


class References:
    """The machine's own limits, sampled once per round next to the transports:
    single-thread ``np.copyto`` (in this process) and a plain Python socket
    ``sendall`` → ``recv_into`` of the same bytes to a child process, timed to a 1-byte
    ack. Sampling them in every round makes ratios robust to a machine whose speed
    drifts (other work on a shared VM)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._src = noise(np.random.default_rng(0), nbytes)
        self._dst = np.empty_like(self._src)
        np.copyto(self._dst, self._src)  # fault the pages in
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        self._proc = ctx.Process(target=_socket_sink, args=(b, nbytes), daemon=True)
        self._proc.start()
        b.close()
        if not a.poll(60):
            self._proc.kill()
            raise TimeoutError("raw socket sink did not start")
        self._sock = socket.create_connection(("127.0.0.1", a.recv()), timeout=60)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        a.close()
        self.samples: list[dict[str, float]] = []
        self.sample()  # warm up

    def sample(self) -> dict[str, float]:
        t, c = time.perf_counter(), time.thread_time()
        np.copyto(self._dst, self._src)
        memcpy = self.nbytes / (time.perf_counter() - t) / 1e9
        memcpy_cpu = (time.thread_time() - c) / (self.nbytes / 1e9)
        t = time.perf_counter()
        self._sock.sendall(memoryview(self._src.data))
        if self._sock.recv(1) != b"k":
            raise RuntimeError("raw socket sink went away")
        raw = self.nbytes / (time.perf_counter() - t) / 1e9
        out = {"memcpy_gbps": memcpy, "raw_socket_gbps": raw, "memcpy_cpu_s_per_gb": memcpy_cpu}
        self.samples.append(out)
        return out

    def medians(self) -> dict[str, float]:
        keys = self.samples[0].keys() if self.samples else ()
        return {k: statistics.median(x[k] for x in self.samples[1:] or self.samples)
                for k in keys}

    def close(self) -> None:
        self._sock.close()
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()


# --- plans and the receiving child ---------------------------------------------------------


def build(case: str, b: PlanBuilder, total: int) -> Plan:
    """The plan of ``case``, moving ``total`` bytes."""
    def pages(size: int) -> Plan:
        n = total // size
        return Plan(entries=(b.pair(src_unit=size, dst_unit=size, cap=n, n=n,
                                    pieces=[[0, 0, size, 1, size, size]]),))

    sizes = {"pages_4k": 4 << 10, "pages_32k": 32 << 10, "pages_256k": 256 << 10,
             "same_tp_16k": 16 << 10}
    if case in sizes:
        return pages(sizes[case])
    if case == "head_sliced":
        row, rows = 1 << 10, 16  # 4 heads × 256 B per token row on the source
        n = total // (row * rows)
        return Plan(entries=(b.pair(src_unit=row * rows, dst_unit=2 * row * rows, cap=n, n=n,
                                    pieces=[[0, row, row, rows, row, 2 * row]]),))
    if case == "block":
        return Plan(entries=(b.pair(src_unit=total, dst_unit=total, cap=1, n=1,
                                    pieces=[[0, 0, total, 1, total, total]]),))
    raise ValueError(f"unknown case {case!r}; known: {CASES}")


class Remote:
    """The receiving transport in a spawned child process."""

    def __init__(self, name: str, nbytes: int, options: dict[str, Any] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve_peer, args=(child, name, options or {}, nbytes, 3),
                                daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(120):
            self.proc.kill()
            raise TimeoutError(f"{name} receiver did not start")
        self.endpoint, self.base = self.conn.recv()
        self.mirror = noise(np.random.default_rng(3), nbytes)

    def ask(self, cmd: str | tuple[str, float]) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(120):
            raise TimeoutError(f"receiver did not answer {cmd!r}")
        return self.conn.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send("exit")
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()


def carve(buf: np.ndarray) -> Callable[[int], np.ndarray]:
    """Consecutive slices of one registered source buffer."""
    pos = [0]

    def alloc(n: int) -> np.ndarray:
        a = buf[pos[0]:pos[0] + n]
        pos[0] += n
        return a

    return alloc


def _cases(remote: Remote, src: np.ndarray, total: int, cases: tuple[str, ...]
           ) -> list[tuple[str, Plan, PlanBuilder]]:
    out = []
    for case in cases:
        if case == "tiny":
            continue  # a latency case: see tiny_latency
        b = PlanBuilder(np.random.default_rng(7), carve(src), bump(remote.base, remote.mirror))
        out.append((case, build(case, b, total), b))
    return out


def _warm(row: Row, run: Callable[[], None], verify: Callable[[], bool]) -> None:
    """One verified run; errors end up in ``row.error``."""
    try:
        run()
        row.verified = verify()
        if not row.verified:
            raise RuntimeError("receiver bytes differ from the oracle")
    except Exception as e:  # one broken case must not hide the others
        row.error = f"{type(e).__name__}: {e}"


def _rounds(runs: list[tuple[Row, Callable[[], None]]], reps: int,
            refs: References | None, remote: Remote) -> None:
    """``reps`` rounds; each samples the references, then times every case once, so
    all cases of a transport (and the references) share the same moments. The CPU
    time both processes spend on each run is recorded too."""
    for _ in range(reps):
        sample = refs.sample() if refs is not None else {}
        for row, run in runs:
            if row.error:
                continue
            try:
                r0, u0 = float(remote.ask("cpu")), _own_cpu()
                t = time.perf_counter()
                run()
                row.seconds.append(time.perf_counter() - t)
                row.cpu.append((_own_cpu() - u0, float(remote.ask("cpu")) - r0))
                row.refs.append(sample)
            except Exception as e:
                row.error = f"{type(e).__name__}: {e}"


def _own_cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def verifier(remote: Remote, b: PlanBuilder, plan: Plan) -> Callable[[], bool]:
    want = b.expected(plan)  # before anything moved: the mirror is the receiver's state

    def verify() -> bool:
        for (ptr, _), exp in zip(b.dsts, want, strict=True):
            off = ptr - remote.base
            remote.mirror[off:off + len(exp)] = exp
        return bool(remote.ask("sha") == hashlib.sha256(remote.mirror.data).hexdigest())

    return verify


def _print(row: Row) -> None:
    snd, rcv = row.cpu_per_gb()
    print(f"  {row.path:13s} {row.case:12s} {row.gbps:7.2f} GB/s {row.segs_per_s / 1e3:10.1f} "
          f"k seg/s   CPU-s/GB sender {snd:5.2f} receiver {rcv:5.2f}"
          f"{'  ' + row.error if row.error else ''}", flush=True)


def run_transport(name: str, total: int, reps: int, cases: tuple[str, ...],
                  refs: References, tiny: dict[str, dict[str, Any]]
                  ) -> tuple[list[Row], dict[str, float]]:
    """Every case through transport ``name`` (the tiny case into ``tiny[name]``); then
    the CPU both sides use idling."""
    remote = Remote(name, 2 * total + (1 << 20))
    runs: list[tuple[Row, Callable[[], None]]] = []
    idle: dict[str, float] = {}
    src = np.zeros(total + (1 << 20), np.uint8)
    try:
        with create_transport(name) as sender:
            sender.register(src)
            peer = sender.connect(remote.endpoint)
            for case, plan, b in _cases(remote, src, total, cases):
                row = Row(name, case, plan.nbytes, plan.num_segments)

                def run(plan: Plan = plan) -> None:
                    h = sender.submit(peer, plan)
                    state = sender.wait(h, TIMEOUT)
                    h.release()
                    if state is not TransferState.DONE:
                        raise RuntimeError(f"{state.value}: {h.error}")

                _warm(row, run, verifier(remote, b, plan))
                runs.append((row, run))
            _rounds(runs, reps, refs, remote)
            for row, _ in runs:
                _print(row)
            if "tiny" in cases:
                tiny[name] = tiny_latency(sender, peer, remote, src)
                _print_tiny(name, tiny[name])
            idle = idle_cpu(remote)
            print(f"  {name:13s} idle for 1 s: sender {idle['sender_cpu_s']:.3f} CPU-s, "
                  f"receiver {idle['receiver_cpu_s']:.3f} CPU-s", flush=True)
            peer.close()
    finally:
        remote.close()
    return [row for row, _ in runs], idle


def latency(samples: list[float]) -> dict[str, float]:
    xs = sorted(samples)
    return {"p50_ms": 1e3 * xs[len(xs) // 2], "p99_ms": 1e3 * xs[min(len(xs) - 1,
                                                                   int(0.99 * len(xs)))],
            "n": len(xs)}


def timed_handoff(sender: Any, peer: Any, plan: Plan, what: str) -> float:
    """Seconds from submitting ``plan`` to ``peer`` until it is done; raises naming
    ``what`` if it ends otherwise."""
    t = time.perf_counter()
    h = sender.submit(peer, plan)
    state = sender.wait(h, TIMEOUT)
    dt = time.perf_counter() - t
    h.release()
    if state is not TransferState.DONE:
        raise RuntimeError(f"{what} {state.value}: {h.error}")
    return dt


def tiny_latency(sender: Any, peer: Any, remote: Remote, src: np.ndarray,
                 n: int = TINY_N) -> dict[str, Any]:
    """p50/p99 of submit → wait(DONE) of a tiny handoff, one at a time (checked
    byte-exact once), and the CPU both processes spend per handoff."""
    b = PlanBuilder(np.random.default_rng(11), carve(src), bump(remote.base, remote.mirror))
    plan = Plan(entries=tuple(b.tiny_handoff()))
    verify = verifier(remote, b, plan)

    def once() -> float:
        return timed_handoff(sender, peer, plan, "tiny handoff")

    out: dict[str, Any] = {"segments": plan.num_segments, "nbytes": plan.nbytes}
    try:
        once()
        out["verified"] = verify()
        if not out["verified"]:
            raise RuntimeError("receiver bytes differ from the oracle")
        for _ in range(TINY_WARM):
            once()
        r0, u0 = float(remote.ask("cpu")), _own_cpu()
        out.update(latency([once() for _ in range(n)]))
        out["cpu_ms_per_handoff"] = {"sender": 1e3 * (_own_cpu() - u0) / n,
                                     "receiver": 1e3 * (float(remote.ask("cpu")) - r0) / n}
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def pingpong(nbytes: int, n: int = TINY_N) -> dict[str, Any]:
    """Raw socket reference for the tiny case: ``sendall`` of ``nbytes`` to a child
    process that ``recv_into``s them and answers one byte; p50/p99 of the round trip."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_socket_sink, args=(b, nbytes), daemon=True)
    proc.start()
    b.close()
    try:
        if not a.poll(60):
            raise TimeoutError("ping-pong sink did not start")
        with socket.create_connection(("127.0.0.1", a.recv()), timeout=60) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            data = memoryview(noise(np.random.default_rng(5), nbytes).data)
            samples = []
            for i in range(TINY_WARM + n):
                t = time.perf_counter()
                sock.sendall(data)
                if sock.recv(1) != b"k":
                    raise RuntimeError("ping-pong sink went away")
                if i >= TINY_WARM:
                    samples.append(time.perf_counter() - t)
        return {**latency(samples), "nbytes": nbytes}
    finally:
        a.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _print_tiny(name: str, r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"  {name:13s} tiny         {r['error']}", flush=True)
        return
    cpu = r.get("cpu_ms_per_handoff")
    print(f"  {name:13s} tiny         p50 {r['p50_ms']:6.3f} ms  p99 {r['p99_ms']:6.3f} ms"
          f"  ({r.get('segments', '?')} segments, {r['nbytes']} B"
          + (f"; CPU ms/handoff sender {cpu['sender']:.3f} receiver {cpu['receiver']:.3f})"
             if cpu else ")"), flush=True)


def idle_cpu(remote: Remote, seconds: float = 1.0) -> dict[str, float]:
    """CPU seconds this process and the receiver use over ``seconds`` of idling."""
    time.sleep(0.2)
    r0, u0 = float(remote.ask("cpu")), resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(seconds)
    r1, u1 = float(remote.ask("cpu")), resource.getrusage(resource.RUSAGE_SELF)
    mine = (u1.ru_utime - u0.ru_utime) + (u1.ru_stime - u0.ru_stime)
    return {"sender_cpu_s": mine, "receiver_cpu_s": r1 - r0, "seconds": seconds}


def run_mooncake_raw(total: int, reps: int, cases: tuple[str, ...]) -> list[Row]:
    """The same plans written with Mooncake's engine API directly (coalesced segments,
    ``batch_transfer_sync_write`` of ≤1024 requests per call) into a kvhandoff
    receiver: what the engine does without our adapter."""
    from kvhandoff.transport.engines.mooncake import available

    if not available().ok:
        return []
    from mooncake.engine import TransferEngine

    remote = Remote("mooncake", 2 * total + (1 << 20), {"staging": False})
    rows: list[Row] = []
    src = np.zeros(total + (1 << 20), np.uint8)
    te = TransferEngine()
    try:
        if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("mooncake engine did not initialize")
        if te.register_memory(int(src.ctypes.data), src.nbytes, "cpu:0") != 0:
            raise RuntimeError("mooncake could not register the source buffer")
        session = str(json.loads(remote.endpoint)["address"])
        runs: list[tuple[Row, Callable[[], None]]] = []
        for case, plan, b in _cases(remote, src, total, cases):
            segs = plan.coalesce()
            s_, d_, n_ = segs.src.tolist(), segs.dst.tolist(), segs.length.tolist()
            row = Row("mooncake-raw", case, plan.nbytes, plan.num_segments)

            def run(s_: list[int] = s_, d_: list[int] = d_, n_: list[int] = n_) -> None:
                for a in range(0, len(s_), RAW_BATCH):
                    z = a + RAW_BATCH
                    rc = te.batch_transfer_sync_write(session, s_[a:z], d_[a:z], n_[a:z])
                    if rc != 0:
                        raise RuntimeError(f"batch_transfer_sync_write returned {rc}")

            _warm(row, run, verifier(remote, b, plan))
            runs.append((row, run))
        _rounds(runs, min(reps, 2), None, remote)  # slow (request-bound): two rounds do
        for row, _ in runs:
            rows.append(row)
            _print(row)
    finally:
        te.unregister_memory(int(src.ctypes.data))
        remote.close()
    return rows


# --- goals, report, plot ------------------------------------------------------------------


def _paired(a: Row, ref: Row | str) -> tuple[float, str]:
    """Median over rounds of ``a`` / ``ref`` (a row of the same rounds, or a reference
    key), or the ratio of medians when the two were not sampled together."""
    if isinstance(ref, str):
        pairs = [x / r[ref] for x, r in zip(a.rates(), a.refs, strict=True) if r.get(ref)]
        return (statistics.median(pairs), "paired by round") if pairs else (0.0, "no samples")
    if len(a.seconds) == len(ref.seconds) and a.refs and a.refs == ref.refs:
        pairs = [x / y for x, y in zip(a.rates(), ref.rates(), strict=True)]
        return statistics.median(pairs), "paired by round"
    return (a.gbps / ref.gbps if ref.gbps else 0.0), "ratio of medians"


def goals(rows: list[Row], idle: dict[str, dict[str, float]],
          tiny: dict[str, dict[str, Any]] | None = None,
          ceiling: float | None = None) -> list[Goal]:
    """The transport goals, each as a ratio measured in this run."""
    by = {(r.path, r.case): r for r in rows if not r.error and r.seconds}
    out: list[Goal] = []

    def add(name: str, key: tuple[str, str], ref: tuple[str, str] | str, goal: float) -> None:
        if key in by and (isinstance(ref, str) or ref in by):
            ratio, how = _paired(by[key], ref if isinstance(ref, str) else by[ref])
            out.append(Goal(name, ratio, goal, how))

    for case in ("pages_32k", "pages_256k", "block"):
        add(f"tcp {case} >= 0.9x raw socket", ("tcp", case), "raw_socket_gbps", 0.9)
    add("tcp pages_4k >= 10x Mooncake TCP (its own API)", ("tcp", "pages_4k"),
        ("mooncake-raw", "pages_4k"), 10.0)
    add("shm pages_256k >= 0.7x memcpy", ("shm", "pages_256k"), "memcpy_gbps", 0.7)
    add("shm pages_4k >= 0.4x memcpy", ("shm", "pages_4k"), "memcpy_gbps", 0.4)
    add("cma pages_256k >= 0.9x memcpy", ("cma", "pages_256k"), "memcpy_gbps", 0.9)
    add("cma pages_4k >= 0.6x memcpy", ("cma", "pages_4k"), "memcpy_gbps", 0.6)
    for case, goal in (("pages_256k", 0.9), ("pages_4k", 0.6)):  # the same, per CPU-second
        row = by.get(("cma", case))
        if row is not None and row.cpu and row.refs:
            mine = sum(row.cpu_per_gb())
            ref = statistics.median(r["memcpy_cpu_s_per_gb"] for r in row.refs)
            out.append(Goal(f"cma {case} CPU per GB >= {goal}x memcpy's (ratio: memcpy's / "
                            f"cma's, both processes)", ref / mine if mine else 0.0, goal,
                            "CPU-s per GB, medians: barely moved by other load"))
    add("nixl block >= 0.8x memcpy", ("nixl", "block"), "memcpy_gbps", 0.8)
    n_goals = len(out)
    for t in TRANSPORTS:
        add(f"{t} head_sliced >= 0.8x same_tp_16k", (t, "head_sliced"), (t, "same_tp_16k"),
            0.8)
    if ceiling is not None:  # say what memory alone allows, next to each head-sliced goal
        out[n_goals:] = [replace(g, how=f"{g.how}; an in-process copy of the two patterns: "
                                        f"{ceiling:.3f}x") for g in out[n_goals:]]
    t_tcp = (tiny or {}).get("tcp", {})
    if t_tcp.get("p50_ms"):
        out.append(Goal(f"tcp tiny p50 <= {TINY_GOAL_S * 1e3:.1f} ms (ratio: goal / p50)",
                        TINY_GOAL_S * 1e3 / t_tcp["p50_ms"], 1.0, "submit → DONE"))
    for t, cpu in idle.items():
        busy = max(cpu["sender_cpu_s"], cpu["receiver_cpu_s"]) / cpu["seconds"]
        out.append(Goal(f"{t} idle: <5% of a core busy on either side (ratio: 1 - busy)",
                        1.0 - busy, 0.95, "CPU time over 1 s idle"))
    return out


def plot(rows: list[Row], base: dict[str, float], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    paths = list(dict.fromkeys(r.path for r in rows))
    cases = [c for c in CASES if any(r.case == c for r in rows)]
    fig, ax = plt.subplots(figsize=(12, 4.8))
    w = 0.8 / max(1, len(paths))
    for i, n in enumerate(paths):
        vals = [next((r.gbps for r in rows if r.path == n and r.case == c), 0.0) for c in cases]
        ax.bar(np.arange(len(cases)) + i * w, vals, w, label=n)
    ax.axhline(base["memcpy_gbps"], color="k", ls="--", lw=1,
               label=f"memcpy {base['memcpy_gbps']:.1f}")
    ax.axhline(base["raw_socket_gbps"], color="gray", ls=":", lw=1,
               label=f"raw socket {base['raw_socket_gbps']:.2f}")
    ax.set_xticks(np.arange(len(cases)) + 0.4 - w / 2, cases)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (median, log scale)")
    ax.set_title("kvhandoff transports, two processes on 127.0.0.1")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _args(argv: list[str] | None) -> argparse.Namespace:
    """The bench's flags, checked (``--cases`` names known cases only)."""
    ap = argparse.ArgumentParser(prog="kvhandoff bench transport",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    ap.add_argument("--transports", default=",".join(TRANSPORTS),
                    help=f"comma-separated (default {','.join(TRANSPORTS)})")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    ap.add_argument("--mib", type=int, default=256, help="bytes moved per case, MiB")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per case")
    ap.add_argument("--no-raw", action="store_true", help="skip the raw Mooncake baseline")
    ap.add_argument("--quick", action="store_true", help="32 MiB, 2 repetitions (seconds)")
    args = ap.parse_args(argv)
    unknown = {c for c in args.cases.split(",") if c} - set(CASES)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    return args


def _report(rows: list[Row], base: dict[str, float], refs: References,
            idle: dict[str, dict[str, float]], tiny: dict[str, dict[str, Any]],
            skipped: dict[str, str], results: list[Goal], total: int, reps: int
            ) -> dict[str, Any]:
    """The JSON report: the machine, the baselines, every row with its ratios, goals."""
    return {
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                    "numpy": np.__version__, "cpus": mp.cpu_count(),
                    "loadavg": os.getloadavg()},
        "nbytes": total, "reps": reps, "baselines": base, "reference_samples": refs.samples,
        "results": [{**asdict(r), "gbps": r.gbps, "segments_per_s": r.segs_per_s,
                     "cpu_s_per_gb": dict(zip(("sender", "receiver"), r.cpu_per_gb(),
                                              strict=True)),
                     "ratio_memcpy": r.gbps / base["memcpy_gbps"],
                     "ratio_raw_socket": r.gbps / base["raw_socket_gbps"]} for r in rows],
        "idle": idle,
        "tiny": tiny,
        "goals": [{"name": g.name, "ratio": round(g.ratio, 3), "goal": g.goal, "met": g.met,
                   "how": g.how} for g in results],
        "skipped": skipped,
    }


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    total = (32 if args.quick else args.mib) << 20
    reps = 2 if args.quick else max(1, args.reps)
    cases = tuple(c for c in args.cases.split(",") if c)
    avail = available_transports()
    names = [n for n in args.transports.split(",") if n]

    print(f"baselines ({total >> 20} MiB, {reps} rounds)...", flush=True)
    gathers = {f"gather_{page >> 10}k_gbps": gather_gbps(total, page, reps + 1)
               for page in (4 << 10, 32 << 10, 256 << 10)}
    gathers.update(pattern_copy_gbps(total, reps + 1))
    refs = References(total)
    rows: list[Row] = []
    idle: dict[str, dict[str, float]] = {}
    tiny: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    try:
        for n in names:
            if n not in avail or not avail[n].ok:
                skipped[n] = avail[n].reason if n in avail else "unknown transport"
                print(f"  {n}: skipped ({skipped[n]})", flush=True)
                continue
            got, idle[n] = run_transport(n, total, reps, cases, refs, tiny)
            rows += got
        if "tiny" in cases and tiny:
            nbytes = next(int(r["nbytes"]) for r in tiny.values())
            tiny["raw-pingpong"] = pingpong(nbytes)
            _print_tiny("raw-pingpong", tiny["raw-pingpong"])
        if not args.no_raw and "mooncake" in names and "mooncake" not in skipped:
            rows += run_mooncake_raw(total, reps, cases)
    finally:
        refs.close()
    base = {**refs.medians(), **gathers}
    print("  references (medians over rounds): " + "   ".join(
        f"{k[:-5]} {v:.2f} GB/s" if k.endswith("_gbps") else f"{k} {v:.3f}"
        for k, v in base.items()), flush=True)

    results = goals(rows, idle, tiny,
                    base["copy_head_sliced_gbps"] / base["copy_same_tp_16k_gbps"])
    report = _report(rows, base, refs, idle, tiny, skipped, results, total, reps)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    png = args.json.with_suffix(".png")
    drew = plot(rows, base, png)
    print("goals:")
    for g in results:
        print(f"  {'met    ' if g.met else 'NOT met'} {g.name}: {g.ratio:.3f}x ({g.how})")
    print(f"wrote {args.json}" + (f" and {png}" if drew else " (no matplotlib: no PNG)"))
    broken = [r.error for r in rows if r.error] + [t["error"] for t in tiny.values()
                                                   if "error" in t]
    return 0 if not broken else 1


if __name__ == "__main__":
    sys.exit(main())
