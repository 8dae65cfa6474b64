"""Shared fakes for transport tests and benchmarks: random factored plans and a peer
that runs in a child process. Test support, not used by the library itself.

:class:`PlanBuilder` allocates source tensors (registered with the sender) and
destination tensors (allocated by the receiver, or carved from a remote buffer),
fills both with noise, and builds TensorPlans of the shapes a real handoff produces:
scattered pages, head-sliced pages (heterogeneous TP), multi-piece Mamba-style
groups, many tiny units, and units larger than any frame. :meth:`PlanBuilder.expected`
applies the numpy executor to copies, which is what every transport must reproduce.
:func:`page_plan` is the one-page plan a test uses to show a transport still works.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvhandoff.plan.execute import HostMemory, execute
from kvhandoff.plan.model import Plan, TensorPlan

Alloc = Callable[[int], tuple[int, np.ndarray]]
"""``nbytes -> (address the receiver sees, local array holding the same initial bytes)``."""

def page_plan(src: np.ndarray, dst: np.ndarray, page: int, *, nbytes: int = 4096) -> Plan:
    """The smallest real plan: the first ``nbytes`` of ``src`` into page ``page`` of
    ``dst`` (pages of ``nbytes``), one unit, one piece."""
    return Plan(entries=(TensorPlan(
        component="c", tensor="t", layer_id=0, src_ptr=int(src.ctypes.data),
        dst_ptr=int(dst.ctypes.data), src_unit=nbytes, dst_unit=nbytes,
        src_idx=np.array([0]), dst_idx=np.array([page]),
        pieces=np.array([[0, 0, nbytes, 1, nbytes, nbytes]])),))


KINDS = ("pages_4k", "pages_256k", "head_slice_gather", "head_slice_split", "mamba_groups",
         "wide_rows", "tiny_many", "huge", "mixed", "empty", "zero_units", "tiny_handoff",
         "tiny_head_sliced", "pages_dense")


def noise(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def bump(base: int, mirror: np.ndarray) -> Alloc:
    """Carve consecutive, 64-byte aligned allocations out of one receiver buffer at
    ``base`` whose initial bytes are ``mirror``."""
    pos = [0]

    def alloc(nbytes: int) -> tuple[int, np.ndarray]:
        off = pos[0]
        if off + nbytes > len(mirror):
            raise MemoryError(f"remote buffer of {len(mirror)} B exhausted")
        pos[0] = (off + nbytes + 63) & ~63
        return base + off, mirror[off:off + nbytes]

    return alloc


@dataclass
class PlanBuilder:
    """Builds plans; ``src_alloc(n)`` returns a registered source array, ``dst_alloc(n)``
    a receiver allocation (see :data:`Alloc`). Source arrays get noise here."""

    rng: np.random.Generator
    src_alloc: Callable[[int], np.ndarray]
    dst_alloc: Alloc

    def __post_init__(self) -> None:
        self.srcs: list[np.ndarray] = []
        self.dsts: list[tuple[int, np.ndarray]] = []
        self._layer = 0

    def pair(self, *, src_unit: int, dst_unit: int, cap: int, n: int, pieces: list[list[int]],
             component: str = "kv", dst_cap: int | None = None) -> TensorPlan:
        """A tensor pair with ``cap`` units each side and ``n`` random distinct units moved."""
        s = self.src_alloc(src_unit * cap)
        s[:] = noise(self.rng, len(s))
        dcap = cap if dst_cap is None else dst_cap
        dptr, d = self.dst_alloc(dst_unit * dcap)
        self.srcs.append(s)
        self.dsts.append((dptr, d))
        self._layer += 1
        return TensorPlan(
            component=component, tensor="t", layer_id=self._layer,
            src_ptr=int(s.ctypes.data), dst_ptr=dptr, src_unit=src_unit, dst_unit=dst_unit,
            src_idx=self.rng.choice(cap, n, replace=False).astype(np.int64),
            dst_idx=self.rng.choice(dcap, n, replace=False).astype(np.int64),
            pieces=np.array(pieces, dtype=np.int64).reshape(-1, 6),
        )

    def entries(self, kind: str) -> list[TensorPlan]:
        r = self.rng
        if kind == "pages_4k":
            return [self.pair(src_unit=4096, dst_unit=4096, cap=600, n=400,
                              pieces=[[0, 0, 4096, 1, 4096, 4096]])]
        if kind == "pages_256k":
            b = 256 << 10
            return [self.pair(src_unit=b, dst_unit=b, cap=24, n=16, pieces=[[0, 0, b, 1, b, b]])]
        if kind in ("head_slice_gather", "head_slice_split"):
            rows, heads, hd = 16, 8, 64  # page of 16 tokens, 8 KV heads of 64 B
            half = heads // 2 * hd
            out = []
            for rank in range(2):
                if kind == "head_slice_gather":  # prefill TP2 → decode TP1
                    su, du, pc = rows * half, rows * heads * hd, [0, rank * half, half, rows,
                                                                 half, heads * hd]
                else:  # prefill TP1 → decode TP2 (this is decode rank `rank`)
                    su, du, pc = rows * heads * hd, rows * half, [rank * half, 0, half, rows,
                                                                 heads * hd, half]
                out.append(self.pair(src_unit=su, dst_unit=du, cap=200, n=int(r.integers(1, 150)),
                                     pieces=[pc]))
            return out
        if kind == "mamba_groups":  # conv state: 3 groups of one slot, rows of the ssm state
            return [self.pair(src_unit=3000, dst_unit=5000, cap=12, n=5, component="mamba",
                              pieces=[[0, 100, 1000, 1, 0, 0], [1000, 2100, 600, 1, 0, 0],
                                      [1600, 3000, 32, 40, 34, 48]])]
        if kind == "wide_rows":  # strided rows long enough to move as memoryviews
            return [self.pair(src_unit=90000, dst_unit=75000, cap=8, n=5,
                              pieces=[[0, 0, 20000, 3, 30000, 25000], [20000, 20000, 600, 7,
                                                                       1000, 700]])]
        if kind == "tiny_many":
            return [self.pair(src_unit=16, dst_unit=24, cap=30000, n=20000,
                              pieces=[[0, 8, 16, 1, 16, 16]])]
        if kind == "huge":
            big = 9 << 20
            return [
                self.pair(src_unit=big, dst_unit=big, cap=2, n=1,
                          pieces=[[0, 0, big, 1, big, big]]),
                # one unit of 70000 short rows, strided on both sides: 9 MB, longer than
                # the tcp bounce buffers (4 MiB receiving, 8 MiB sending)
                self.pair(src_unit=70000 * 256, dst_unit=70000 * 160, cap=1, n=1,
                          pieces=[[0, 0, 128, 70000, 256, 160]]),
            ]
        if kind == "tiny_handoff":  # a short request: see tiny_handoff()
            return self.tiny_handoff()
        if kind == "tiny_head_sliced":  # few pages, head-sliced (TP2 → TP1): strided rows
            rows, half = 16, 256
            return [self.pair(src_unit=rows * half, dst_unit=2 * rows * half, cap=6, n=2,
                              pieces=[[0, half, half, rows, half, 2 * half]]),
                    self.pair(src_unit=4 * rows * 64, dst_unit=rows * 64, cap=3, n=1,
                              pieces=[[64, 0, 64, rows, 4 * 64, 64]])]
        if kind == "pages_dense":  # every unit of a range moves: copy order is free
            b, n = 4096, 300
            full = self.pair(src_unit=b, dst_unit=b, cap=n, n=n, pieces=[[0, 0, b, 1, b, b]])
            to_range = self.pair(src_unit=2 * b, dst_unit=b, cap=n, n=n // 2,
                                 pieces=[[b, 0, b, 1, b, b]])
            to_range = replace(to_range, dst_idx=np.arange(40, 40 + n // 2, dtype=np.int64))
            from_range = self.pair(src_unit=b, dst_unit=3 * b, cap=n, n=n // 3,
                                   pieces=[[0, b, 512, 8, 512, 512]])
            from_range = replace(from_range, src_idx=np.arange(7, 7 + n // 3, dtype=np.int64))
            replicated = self.pair(src_unit=b, dst_unit=b, cap=n, n=n,
                                   pieces=[[0, 0, b, 1, b, b]])  # one source, many copies
            replicated = replace(replicated, src_idx=np.where(np.arange(n) % 2 == 0, 5, 9)
                                 .astype(np.int64))
            return [full, to_range, from_range, replicated]
        if kind == "mixed":
            out = []
            for k in ("pages_4k", "head_slice_gather", "mamba_groups", "wide_rows", "tiny_many"):
                out += self.entries(k)
            return out
        if kind == "empty":
            return []
        if kind == "zero_units":
            return [self.pair(src_unit=4096, dst_unit=4096, cap=4, n=0,
                              pieces=[[0, 0, 4096, 1, 4096, 4096]]),
                    self.pair(src_unit=64, dst_unit=64, cap=4, n=2, pieces=[[0, 0, 0, 1, 0, 0]])]
        raise ValueError(f"unknown plan kind {kind!r}; known: {KINDS}")

    def tiny_handoff(self, layers: int = 8, page: int = 4096) -> list[TensorPlan]:
        """A tiny handoff's shape: one KV page per layer (K and V), one Mamba slot
        (conv state in three groups, SSM state) and one aux row: ~20 small segments."""
        out = [self.pair(src_unit=page, dst_unit=page, cap=4, n=1,
                         pieces=[[0, 0, page, 1, page, page]]) for _ in range(2 * layers)]
        out.append(self.pair(src_unit=3000, dst_unit=3000, cap=3, n=1, component="mamba",
                             pieces=[[0, 0, 1000, 1, 0, 0], [1000, 1000, 1000, 1, 0, 0],
                                     [2000, 2000, 1000, 1, 0, 0]]))
        out.append(self.pair(src_unit=32768, dst_unit=32768, cap=3, n=1, component="mamba",
                             pieces=[[0, 0, 32768, 1, 32768, 32768]]))
        out.append(self.pair(src_unit=64, dst_unit=64, cap=4, n=1, component="aux",
                             pieces=[[0, 0, 64, 1, 64, 64]]))
        return out

    def plan(self, kind: str) -> Plan:
        return Plan(entries=tuple(self.entries(kind)))

    def expected(self, plan: Plan) -> list[np.ndarray]:
        """Every destination allocation as it must look after ``plan`` ran, in
        allocation order (computed now, on copies)."""
        copies = [d.copy() for _, d in self.dsts]
        where = {ptr: c for (ptr, _), c in zip(self.dsts, copies, strict=True)}
        entries = tuple(replace(e, dst_ptr=int(where[e.dst_ptr].ctypes.data))
                        for e in plan.entries)
        execute(Plan(entries=entries), HostMemory(self.srcs), HostMemory(copies))
        return copies


class BusyLoop:
    """An engine's step loop as the GIL sees it: a Python thread that never blocks.
    :meth:`spin` starts one (at most one) and sets the process's GIL switch interval;
    :meth:`stop` ends it and puts the interval back."""

    def __init__(self) -> None:
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._interval = sys.getswitchinterval()
        self.turns = 0  # loop iterations so far: the engine's progress

    def spin(self, switch_interval: float) -> None:
        self.stop()
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(switch_interval)
        self._halt.clear()
        self._thread = threading.Thread(target=self._loop, name="busy-loop", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        halt = self._halt
        while not halt.is_set():
            self.turns += 1  # Python bytecode, holding the GIL between forced switches

    def stop(self) -> None:
        if self._thread is not None:
            self._halt.set()
            self._thread.join(10)
            self._thread = None
            sys.setswitchinterval(self._interval)


def serve_peer(conn: Connection, name: str, options: dict[str, Any], nbytes: int,
               seed: int) -> None:
    """Child-process receiver: allocates ``nbytes`` of noise (``seed``) through the
    transport, sends ``(endpoint, address)``, then answers commands until "exit":
    "sha" → sha256 of the buffer, "bytes" → the buffer, "cpu" → this process's CPU
    seconds so far (all threads), ``("busy", interval_s)`` → a :class:`BusyLoop` spins at
    that GIL switch interval (answers the interval in force), "calm" → it stops. Exits if
    the parent goes away."""
    from kvhandoff.transport.registry import create_transport

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    busy = BusyLoop()
    with create_transport(name, **options) as t:
        buf = t.allocate(nbytes)
        buf[:] = noise(np.random.default_rng(seed), nbytes)
        conn.send((t.endpoint(), int(buf.ctypes.data)))
        while conn.poll(120):
            try:
                cmd = conn.recv()
            except EOFError:
                break
            if cmd == "sha":
                conn.send(hashlib.sha256(buf.data).hexdigest())
            elif cmd == "bytes":
                conn.send_bytes(buf.data)
            elif cmd == "pid":
                conn.send(os.getpid())
            elif cmd == "cpu":
                conn.send(time.process_time())
            elif isinstance(cmd, tuple) and cmd[0] == "busy":
                busy.spin(cmd[1])
                conn.send(sys.getswitchinterval())
            elif cmd == "calm":
                busy.stop()
                conn.send(True)
            else:
                break
