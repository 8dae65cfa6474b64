"""Transport benchmark: two processes on 127.0.0.1, next to this machine's own limits.

The receiver runs in a spawned child process (``kvhandoff.transport.testing.serve_peer``),
the sender here. Each case moves one plan; the first repetition is checked byte-exact
(sha256 of the receiver's buffer against the numpy executor applied to a local mirror).
Baselines are measured in the same run: single-thread memcpy (``np.copyto``) and a raw
Python socket ``sendall`` → ``recv_into`` between two processes.

Cases (``--mib`` total, default 256 MiB):
  pages_4k / pages_32k / pages_256k   scattered pages, random permutation on both sides
  same_tp_16k                         16 KiB pages (the head-sliced case's reference)
  head_sliced                         prefill TP2 → decode TP1: each 16 KiB source page
                                      lands as 16 rows of 1 KiB in every other 1 KiB of a
                                      32 KiB destination page (half the bytes of above)
  block                               one contiguous segment

    python benchmarks/transport.py                      # tcp + shm, ~1 minute
    python benchmarks/transport.py --quick              # 32 MiB, 2 reps
    python benchmarks/transport.py --transports tcp,shm,nixl

Writes ``--json`` (default benchmarks/results/transport.json) and a PNG next to it.
Tests assert correctness; this script only measures.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvhandoff.plan.model import Plan
from kvhandoff.transport import TransferState, available_transports, create_transport
from kvhandoff.transport.testing import PlanBuilder, bump, noise, serve_peer

DEFAULT_JSON = Path(__file__).parent / "results" / "transport.json"
CASES = ("pages_4k", "pages_32k", "pages_256k", "same_tp_16k", "head_sliced", "block")
TIMEOUT = 300.0


@dataclass
class Result:
    transport: str
    case: str
    nbytes: int
    segments: int
    seconds: list[float] = field(default_factory=list)
    verified: bool = False
    error: str = ""

    @property
    def gbps(self) -> float:
        return self.nbytes / statistics.median(self.seconds) / 1e9 if self.seconds else 0.0

    @property
    def segs_per_s(self) -> float:
        return self.segments / statistics.median(self.seconds) if self.seconds else 0.0


# --- baselines -------------------------------------------------------------------------


def memcpy_gbps(nbytes: int, reps: int) -> float:
    src = noise(np.random.default_rng(0), nbytes)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def _socket_sink(port_conn: Any, nbytes: int, reps: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_conn.send(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = np.empty(nbytes, np.uint8)
    buf[:] = 0
    mv = memoryview(buf.data)
    for _ in range(reps):
        got = 0
        while got < nbytes:
            n = conn.recv_into(mv[got:])
            if not n:
                return
            got += n
        conn.sendall(b"k")
    conn.close()


def raw_socket_gbps(nbytes: int, reps: int) -> float:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_socket_sink, args=(b, nbytes, reps), daemon=True)
    p.start()
    port = a.recv()
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    src = noise(np.random.default_rng(1), nbytes)
    mv = memoryview(src.data)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        s.sendall(mv)
        if s.recv(1) != b"k":
            raise RuntimeError("raw socket sink went away")
        times.append(time.perf_counter() - t)
    s.close()
    p.join(30)
    return nbytes / statistics.median(times) / 1e9


# --- transport cases -------------------------------------------------------------------


def build(case: str, b: PlanBuilder, total: int) -> Plan:
    def pages(size: int) -> Plan:
        n = total // size
        return Plan(entries=(b.pair(src_unit=size, dst_unit=size, cap=n, n=n,
                                    pieces=[[0, 0, size, 1, size, size]]),))

    if case == "pages_4k":
        return pages(4 << 10)
    if case == "pages_32k":
        return pages(32 << 10)
    if case == "pages_256k":
        return pages(256 << 10)
    if case == "same_tp_16k":
        return pages(16 << 10)
    if case == "head_sliced":
        row, rows = 1 << 10, 16  # 4 heads × 256 B per token row on the source
        n = total // (2 * row * rows)  # destination pages are twice as large
        return Plan(entries=(b.pair(src_unit=row * rows, dst_unit=2 * row * rows, cap=n, n=n,
                                    pieces=[[0, row, row, rows, row, 2 * row]]),))
    if case == "block":
        return Plan(entries=(b.pair(src_unit=total, dst_unit=total, cap=1, n=1,
                                    pieces=[[0, 0, total, 1, total, total]]),))
    raise ValueError(case)


class Remote:
    def __init__(self, name: str, nbytes: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve_peer, args=(child, name, {}, nbytes, 3),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise TimeoutError(f"{name} receiver did not start")
        self.endpoint, self.base = self.conn.recv()
        self.mirror = noise(np.random.default_rng(3), nbytes)

    def sha(self) -> str:
        self.conn.send("sha")
        if not self.conn.poll(120):
            raise TimeoutError("receiver did not answer")
        return str(self.conn.recv())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send("exit")
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def _carve(buf: np.ndarray) -> Callable[[int], np.ndarray]:
    """Consecutive slices of one registered source buffer."""
    pos = [0]

    def alloc(n: int) -> np.ndarray:
        a = buf[pos[0]:pos[0] + n]
        pos[0] += n
        return a

    return alloc


def run_transport(name: str, total: int, reps: int, cases: tuple[str, ...]) -> list[Result]:
    remote = Remote(name, total + (1 << 20))
    results = []
    src = np.empty(total + (1 << 20), np.uint8)
    try:
        with create_transport(name) as sender:
            sender.register(src)
            peer = sender.connect(remote.endpoint)
            for case in cases:
                b = PlanBuilder(np.random.default_rng(7), _carve(src),
                                bump(remote.base, remote.mirror))
                p = build(case, b, total)
                r = Result(name, case, p.nbytes, p.num_segments)
                want = b.expected(p)
                results.append(r)
                try:
                    for rep in range(reps + 1):  # the first repetition warms up and verifies
                        t = time.perf_counter()
                        h = sender.submit(peer, p)
                        state = sender.wait(h, TIMEOUT)
                        dt = time.perf_counter() - t
                        h.release()
                        if state is not TransferState.DONE:
                            raise RuntimeError(f"{state.value}: {h.error}")
                        if rep == 0:
                            for (ptr, _), exp in zip(b.dsts, want, strict=True):
                                off = ptr - remote.base
                                remote.mirror[off:off + len(exp)] = exp
                            local = hashlib.sha256(remote.mirror.data).hexdigest()
                            r.verified = remote.sha() == local
                            if not r.verified:
                                raise RuntimeError("receiver bytes differ from the oracle")
                        else:
                            r.seconds.append(dt)
                except Exception as e:  # one broken case must not hide the others
                    r.error = f"{type(e).__name__}: {e}"
                print(f"  {name:8s} {case:12s} {r.gbps:6.2f} GB/s {r.segs_per_s / 1e3:9.1f} k seg/s"
                      f"{'  ' + r.error if r.error else ''}", flush=True)
            peer.close()
    finally:
        remote.close()
    return results


# --- report ----------------------------------------------------------------------------


def goals(res: list[Result], memcpy: float, raw: float) -> dict[str, Any]:
    by = {(r.transport, r.case): r.gbps for r in res}
    out: dict[str, Any] = {}

    def ratio(key: str, value: float, base: float, goal: float) -> None:
        out[key] = {"ratio": round(value / base, 3) if base else None, "goal": goal,
                    "met": bool(base and value / base >= goal)}

    for case in ("pages_32k", "pages_256k", "block"):
        if ("tcp", case) in by:
            ratio(f"tcp {case} / raw socket", by["tcp", case], raw, 0.9)
    if ("shm", "pages_256k") in by:
        ratio("shm pages_256k / memcpy", by["shm", "pages_256k"], memcpy, 0.7)
    if ("shm", "pages_4k") in by:
        ratio("shm pages_4k / memcpy", by["shm", "pages_4k"], memcpy, 0.4)
    for t in {r.transport for r in res}:
        if (t, "head_sliced") in by and (t, "same_tp_16k") in by:
            ratio(f"{t} head_sliced / same_tp_16k", by[t, "head_sliced"], by[t, "same_tp_16k"],
                  0.8)
    return out


def plot(res: list[Result], memcpy: float, raw: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r.transport for r in res})
    cases = [c for c in CASES if any(r.case == c for r in res)]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    w = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        vals = [next((r.gbps for r in res if r.transport == n and r.case == c), 0.0)
                for c in cases]
        ax.bar(np.arange(len(cases)) + i * w, vals, w, label=n)
    ax.axhline(memcpy, color="k", ls="--", lw=1, label=f"memcpy {memcpy:.1f}")
    ax.axhline(raw, color="gray", ls=":", lw=1, label=f"raw socket {raw:.2f}")
    ax.set_xticks(np.arange(len(cases)) + 0.4 - w / 2, cases)
    ax.set_ylabel("GB/s (median)")
    ax.set_title("kvhandoff transports, two processes on 127.0.0.1")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--transports", default="tcp,shm")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="32 MiB, 2 repetitions")
    args = ap.parse_args(argv)
    total = (32 if args.quick else args.mib) << 20
    reps = 2 if args.quick else args.reps
    avail = available_transports()
    names = [n for n in args.transports.split(",") if n]
    print(f"baselines ({total >> 20} MiB)...", flush=True)
    memcpy = memcpy_gbps(total, reps + 2)
    raw = raw_socket_gbps(total, reps + 2)
    print(f"  memcpy {memcpy:.2f} GB/s   raw socket {raw:.2f} GB/s", flush=True)
    res: list[Result] = []
    skipped = {}
    for n in names:
        if n not in avail or not avail[n].ok:
            skipped[n] = avail[n].reason if n in avail else "unknown transport"
            print(f"  {n}: skipped ({skipped[n]})")
            continue
        res += run_transport(n, total, reps, CASES)
    goal_report = goals(res, memcpy, raw)
    report: dict[str, Any] = {
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                    "numpy": np.__version__, "cpus": mp.cpu_count()},
        "nbytes": total, "reps": reps,
        "baselines": {"memcpy_gbps": memcpy, "raw_socket_gbps": raw},
        "results": [{**asdict(r), "gbps": r.gbps, "segments_per_s": r.segs_per_s,
                     "ratio_memcpy": r.gbps / memcpy, "ratio_raw_socket": r.gbps / raw}
                    for r in res],
        "goals": goal_report,
        "skipped": skipped,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    plot(res, memcpy, raw, args.json.with_suffix(".png"))
    for k, v in goal_report.items():
        print(f"  goal {k}: {v['ratio']} (>= {v['goal']}) {'met' if v['met'] else 'NOT met'}")
    print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    return 0 if all(not r.error for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
