"""Registered memory as an immutable, searchable table, and bounds checks on plan sides.

A :class:`RegionTable` maps absolute addresses to writable ``uint8`` numpy views of
the registered blocks. Tables are immutable: ``with_regions`` returns a new table,
so a reader thread holding one never sees a half-updated list (swap the reference
under a lock; read it without one).

Bounds checks work on the *envelope* of a piece applied to a set of units: every
unit of one tensor lies in one region (a Layout guarantees it), and regions are
intervals, so if the lowest and the highest byte touched lie in the same region,
every byte in between does too. That makes the check O(1) after ``min``/``max``
of the index array, with Python integers (no int64 overflow on hostile input).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvhandoff.errors import OutOfBounds
from kvhandoff.layout import MemoryKind, Region
from kvhandoff.plan.model import Plan
from kvhandoff.plan.request import index_range

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]


class Span(NamedTuple):
    """A half-open byte interval ``[lo, hi)``; ``hi == lo`` touches nothing."""

    lo: int
    hi: int


def piece_span(ptr: int, unit: int, idx: I64, off: int, length: int, count: int, stride: int,
               bounds: tuple[int, int] | None = None) -> Span:
    """Every byte ``ptr + idx[u]*unit + off + j*stride + [0, length)`` for all u, j < count
    (and ``ptr`` itself). ``bounds``: ``index_range(idx)`` if the caller has it.

    Raises ``ValueError`` on negative sizes, strides or indices (planner output never
    has them; a peer that sends them is malformed)."""
    if length < 0 or count < 0 or unit < 0 or stride < 0 or off < 0 or ptr < 0:
        raise ValueError(
            f"negative field in piece: ptr={ptr} unit={unit} off={off} length={length} "
            f"count={count} stride={stride}"
        )
    if not len(idx) or not length or not count:
        return Span(ptr, ptr)
    lo_i, hi_i = index_range(idx) if bounds is None else bounds
    if lo_i < 0:
        raise ValueError(f"negative unit index {lo_i}")
    # the tensor's own ptr is included so views can be taken from it
    lo = min(ptr, ptr + lo_i * unit + off)
    hi = ptr + hi_i * unit + off + (count - 1) * stride + length
    return Span(lo, hi)


class RegionTable:
    """Sorted, non-overlapping registered blocks. Immutable; thread-safe to read."""

    __slots__ = ("_bufs", "_ends", "_mvs", "_regions", "_starts", "ends", "starts")

    def __init__(self, blocks: Iterable[tuple[Region, U8]] = ()) -> None:
        items = sorted(((r, b) for r, b in blocks if r.nbytes > 0), key=lambda rb: rb[0].ptr)
        for (a, _), (b, _) in itertools.pairwise(items):
            if a.ptr + a.nbytes > b.ptr:
                raise ValueError(
                    f"registered regions overlap: [{a.ptr:#x}, +{a.nbytes}) and "
                    f"[{b.ptr:#x}, +{b.nbytes})"
                )
        self._regions: tuple[Region, ...] = tuple(r for r, _ in items)
        self._bufs: tuple[U8, ...] = tuple(b for _, b in items)
        self._mvs: tuple[memoryview, ...] = tuple(b.data for b in self._bufs)
        self._starts: list[int] = [r.ptr for r in self._regions]
        self._ends: list[int] = [r.ptr + r.nbytes for r in self._regions]
        self.starts = np.array(self._starts, dtype=np.int64)
        self.ends = np.array(self._ends, dtype=np.int64)

    def with_regions(self, blocks: Iterable[tuple[Region, U8]]) -> RegionTable:
        """A new table holding these blocks too. A block inside one already registered
        (a tensor of a registered pool, the same array twice) adds nothing; a registered
        block inside a new one is replaced by it. Partial overlaps raise ValueError."""
        items = [*zip(self._regions, self._bufs, strict=True),
                 *((r, b) for r, b in blocks if r.nbytes > 0)]
        items.sort(key=lambda rb: (rb[0].ptr, -rb[0].nbytes))  # containers first
        kept: list[tuple[Region, U8]] = []
        for r, b in items:
            if kept:
                last = kept[-1][0]
                end = last.ptr + last.nbytes
                if r.ptr + r.nbytes <= end:
                    continue  # inside the previous block (kept blocks never overlap)
                if r.ptr < end:
                    raise ValueError(
                        f"registered regions overlap: [{last.ptr:#x}, +{last.nbytes}) and "
                        f"[{r.ptr:#x}, +{r.nbytes})")
            kept.append((r, b))
        return RegionTable(kept)

    @property
    def regions(self) -> tuple[Region, ...]:
        return self._regions

    def __len__(self) -> int:
        return len(self._regions)

    def locate(self, span: Span) -> int:
        """Index of the region holding all of ``span``; -1 if none (an empty span is
        held by any region, or by none when the table is empty: answer 0 / -1)."""
        if span.hi == span.lo:
            return 0 if self._regions else -1
        i = bisect.bisect_right(self._starts, span.lo) - 1
        if i < 0 or span.hi > self._ends[i]:
            return -1
        return i

    def contains(self, span: Span) -> bool:
        return span.hi == span.lo or self.locate(span) >= 0

    def span_view(self, lo: int, hi: int) -> tuple[memoryview, int] | None:
        """``(mv, off)``: a memoryview of the region holding all of ``[lo, hi)``, whose
        byte ``mv[a + off]`` is address ``a``; None if no region holds it all. Python
        ints only (the small-frame path's lookup)."""
        i = bisect.bisect_right(self._starts, lo) - 1
        if i < 0 or hi > self._ends[i] or hi < lo:
            return None
        return self._mvs[i], -self._starts[i]

    def buffer(self, i: int) -> U8:
        """The whole uint8 buffer of region ``i`` (as ``locate`` numbers them)."""
        return self._bufs[i]

    def view(self, ptr: int) -> U8:
        """A uint8 view from ``ptr`` to the end of its region (the executor's interface)."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0 or ptr >= self._ends[i]:
            raise OutOfBounds(f"address {ptr:#x} lies in no registered region")
        return self._bufs[i][ptr - self._starts[i]:]

    def region_view(self, span: Span) -> tuple[U8, int]:
        """``(whole region buffer, offset of span.lo in it)``; raises OutOfBounds."""
        i = self.locate(span)
        if i < 0:
            raise OutOfBounds(
                f"bytes [{span.lo:#x}, {span.hi:#x}) lie outside every registered region"
            )
        return self._bufs[i], span.lo - self._starts[i]

    def describe(self) -> list[tuple[int, int]]:
        """``[(ptr, nbytes), ...]`` for handshakes and messages."""
        return [(r.ptr, r.nbytes) for r in self._regions]


def host_only(regions: Iterable[Region]) -> None:
    """Raise ValueError unless every region is host memory."""
    for r in regions:
        if r.memory is not MemoryKind.HOST:
            raise ValueError(f"region at {r.ptr:#x} is {r.memory.value} memory; host only")


def plan_side_problem(plan: Plan, table: RegionTable, side: str) -> str | None:
    """None if every ``side`` ("src" or "dst") byte of ``plan`` lies in ``table``;
    otherwise a sentence naming the first offending tensor and bytes."""
    src = side == "src"
    for e in plan.entries:
        ptr, unit, idx = (e.src_ptr, e.src_unit, e.src_idx) if src else (
            e.dst_ptr, e.dst_unit, e.dst_idx)
        bounds = index_range(idx) if len(idx) else None
        for so, do, ln, cnt, ss, ds in e.pieces.tolist():
            off, stride = (so, ss) if src else (do, ds)
            span = piece_span(ptr, unit, idx, off, ln, cnt, stride, bounds)
            if not table.contains(span):
                return (
                    f"{'source' if src else 'destination'} bytes [{span.lo:#x}, {span.hi:#x}) "
                    f"of component {e.component!r} tensor {e.tensor!r} (layer {e.layer_id}) "
                    f"lie outside the registered memory"
                )
    return None
