"""The in-memory executor: runs a factored Plan with numpy strided views.

Used by tests, the demo and the in-process transport. A piece becomes one
``(units, count, length)`` strided view on each side, and one fancy-indexed
assignment moves every unit of it: no per-page Python loop.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import numpy as np

from kvhandoff.errors import OutOfBounds
from kvhandoff.memory import piece_view
from kvhandoff.plan.model import Plan, TensorPlan


class HostMemory:
    """Host buffers addressed by their real addresses (``arr.ctypes.data``), as the
    ``ptr`` fields of a Layout are. Keeps references; never frees."""

    def __init__(self, buffers: Iterable[np.ndarray] = ()) -> None:
        self._starts: list[int] = []
        self._bufs: list[np.ndarray] = []
        for b in buffers:
            self.add(b)

    def add(self, buf: np.ndarray) -> int:
        """Register ``buf`` (any dtype, C-contiguous); returns its address."""
        if not buf.flags.c_contiguous:
            raise ValueError("HostMemory needs C-contiguous buffers")
        raw = buf.reshape(-1).view(np.uint8)
        ptr = int(raw.ctypes.data)
        i = bisect.bisect_left(self._starts, ptr)
        self._starts.insert(i, ptr)
        self._bufs.insert(i, raw)
        return ptr

    def view(self, ptr: int) -> np.ndarray:
        """A uint8 view from ``ptr`` to the end of the buffer that contains it."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0 or ptr >= self._starts[i] + len(self._bufs[i]):
            raise OutOfBounds(f"address {ptr:#x} lies in no registered buffer")
        return self._bufs[i][ptr - self._starts[i]:]


    def read(self, addrs: np.ndarray) -> np.ndarray:
        """The bytes at absolute addresses ``addrs`` (vectorised, for checks)."""
        addrs = np.asarray(addrs, dtype=np.int64)
        starts = np.asarray(self._starts, dtype=np.int64)
        which = np.searchsorted(starts, addrs, side="right") - 1
        out = np.empty(len(addrs), dtype=np.uint8)
        for i in np.unique(which).tolist():
            mask = which == i
            off = addrs[mask] - self._starts[i]
            if i < 0 or (len(off) and int(off.max()) >= len(self._bufs[i])):
                raise OutOfBounds("an address lies in no registered buffer")
            out[mask] = self._bufs[i][off]
        return out


def execute(plan: Plan, src: HostMemory, dst: HostMemory) -> int:
    """Copy every planned byte from ``src`` to ``dst``; returns the bytes moved."""
    moved = 0
    for e in plan.entries:
        moved += _entry(e, src.view(e.src_ptr), dst.view(e.dst_ptr))
    return moved


def _entry(e: TensorPlan, s_buf: np.ndarray, d_buf: np.ndarray) -> int:
    for so, do, ln, cnt, ss, ds in e.pieces.tolist():
        s_view = piece_view(s_buf, so, e.src_unit, cnt, ss, ln)
        d_view = piece_view(d_buf, do, e.dst_unit, cnt, ds, ln)
        d_view[e.dst_idx] = s_view[e.src_idx]
    return e.nbytes
