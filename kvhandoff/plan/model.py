"""The Plan: factored per tensor pair, flattened and coalesced on demand.

Factored form (what the planner builds and executors prefer):
    for every tensor pair, unit index arrays ``src_idx[N]`` / ``dst_idx[N]`` and a
    few pieces; byte ``b`` of piece ``p`` repetition ``j`` of pair ``i`` moves from
    ``src_ptr + src_idx[i]*src_unit + p.src_off + j*p.src_stride + b`` to the
    matching destination address.
Flat form (for engines that take address lists): ``(src_addr, dst_addr, length)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvhandoff.plan.format import format_plan
from kvhandoff.plan.request import IndexArray
from kvhandoff.plan.runs import run_starts, runs

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, kw_only=True)
class TensorPlan:
    """The bytes moving between one source tensor and its paired destination tensor.

    (No ``__slots__``: the planner builds entries from a per-tensor template with one
    dict update, several times cheaper than the frozen ``__init__``; see ``_entry``.)
    """

    component: str
    tensor: str
    layer_id: int
    src_ptr: int
    dst_ptr: int
    src_unit: int  # bytes between consecutive units on the source
    dst_unit: int
    src_idx: IndexArray
    dst_idx: IndexArray
    pieces: I64  # (k, 6): src_off, dst_off, length, count, src_stride, dst_stride
    # bytes_per_unit, computed on first use (transports and the session ask per submit)
    _per_unit: int = field(default=-1, init=False, repr=False, compare=False)

    @property
    def bytes_per_unit(self) -> int:
        if self._per_unit < 0:  # a handful of pieces: plain Python beats a numpy call
            per_unit = sum(row[2] * row[3] for row in self.pieces.tolist())
            object.__setattr__(self, "_per_unit", int(per_unit))
        return self._per_unit

    @property
    def nbytes(self) -> int:
        return self.bytes_per_unit * len(self.src_idx)

    @property
    def num_segments(self) -> int:
        """Segments before coalescing."""
        return int(self.pieces[:, 3].sum()) * len(self.src_idx)

    @property
    def whole_units(self) -> bool:
        """One piece that is the whole unit on both sides: runs of consecutive
        indices then coalesce without expanding every unit."""
        if len(self.pieces) != 1:
            return False
        so, do, ln, cnt, _, _ = (int(v) for v in self.pieces[0])
        return so == 0 and do == 0 and cnt == 1 and ln == self.src_unit == self.dst_unit

    def segments(self) -> Segments:
        """Every (src, dst, length) of this pair, unit-major, uncoalesced."""
        if not len(self.src_idx) or not len(self.pieces):
            return Segments.empty()
        so, do, ln, cnt, ss, ds = (self.pieces[:, k] for k in range(6))
        rep = np.repeat(np.arange(len(self.pieces)), cnt)  # piece of each repetition
        j = np.arange(len(rep)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        src_in = so[rep] + j * ss[rep]
        dst_in = do[rep] + j * ds[rep]
        src = (self.src_ptr + self.src_idx[:, None] * self.src_unit + src_in[None, :]).ravel()
        dst = (self.dst_ptr + self.dst_idx[:, None] * self.dst_unit + dst_in[None, :]).ravel()
        length = np.broadcast_to(ln[rep], (len(self.src_idx), len(rep))).ravel()
        return Segments(src, dst, np.ascontiguousarray(length))

    def runs(self, cache: dict[tuple[int, int], tuple[I64, I64]] | None = None) -> Segments:
        """Coalesced segments of a ``whole_units`` pair, computed on the index arrays.

        ``cache`` shares run detection between pairs that use the same index arrays
        (every layer of a component does)."""
        s, d = self.src_idx, self.dst_idx
        if not len(s):
            return Segments.empty()
        key = (id(s), id(d))
        found = cache.get(key) if cache is not None else None
        if found is None:
            found = runs(s, d)
            if cache is not None:
                cache[key] = found
        starts, counts = found
        return Segments(
            self.src_ptr + s[starts] * self.src_unit,
            self.dst_ptr + d[starts] * self.dst_unit,
            counts * self.src_unit,
        )


_new = object.__new__


def _entry(fixed: dict[str, object], src_idx: IndexArray, dst_idx: IndexArray) -> TensorPlan:
    """A TensorPlan from its fixed fields (every field but the index arrays, plus
    ``_per_unit``) and its index arrays: equal to ``TensorPlan(...)`` with those values."""
    e: TensorPlan = _new(TensorPlan)
    d = e.__dict__
    d.update(fixed)
    d["src_idx"] = src_idx
    d["dst_idx"] = dst_idx
    return e


@dataclass(frozen=True, slots=True)
class Segments:
    """Flat ``(src_addr, dst_addr, length)`` arrays, in execution order."""

    src: I64
    dst: I64
    length: I64

    @staticmethod
    def empty() -> Segments:
        z = np.zeros(0, dtype=np.int64)
        return Segments(z, z, z)

    @staticmethod
    def concat(parts: list[Segments]) -> Segments:
        parts = [p for p in parts if len(p)]
        if not parts:
            return Segments.empty()
        return Segments(
            np.concatenate([p.src for p in parts]),
            np.concatenate([p.dst for p in parts]),
            np.concatenate([p.length for p in parts]),
        )

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def coalesce(self) -> Segments:
        """Merge neighbours that are contiguous on both sides (pages 7,8,9 → one)."""
        if len(self) < 2:
            return self
        starts = run_starts(self.src, self.dst, step=self.length)
        return Segments(self.src[starts], self.dst[starts], np.add.reduceat(self.length, starts))


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Everything one source rank writes into one destination rank for one call."""

    entries: tuple[TensorPlan, ...]
    src_tp_rank: int = 0
    dst_tp_rank: int = 0
    notes: tuple[str, ...] = field(default=())  # trims and other non-fatal decisions

    @property
    def nbytes(self) -> int:
        return sum(e.bytes_per_unit * len(e.src_idx) for e in self.entries)

    @property
    def num_pieces(self) -> int:
        return sum(len(e.pieces) for e in self.entries)

    @property
    def num_units(self) -> int:
        return sum(len(e.src_idx) for e in self.entries)

    @property
    def num_segments(self) -> int:
        return sum(e.num_segments for e in self.entries)

    def __bool__(self) -> bool:
        return any(e.bytes_per_unit and len(e.src_idx) for e in self.entries)

    def __str__(self) -> str:
        """A few human lines (:func:`kvhandoff.plan.format.format_plan`), so that
        ``log.debug("%s", plan)`` formats only when the record is emitted."""
        return format_plan(self)

    def by_component(self) -> dict[str, int]:
        """Bytes planned per component."""
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.component] = out.get(e.component, 0) + e.nbytes
        return out

    def flatten(self) -> Segments:
        """Every segment, uncoalesced, entry by entry."""
        return Segments.concat([e.segments() for e in self.entries])

    def coalesce(self) -> Segments:
        """The fewest segments that move the same bytes, in plan order."""
        cache: dict[tuple[int, int], tuple[I64, I64]] = {}
        parts = [e.runs(cache) if e.whole_units else e.segments().coalesce()
                 for e in self.entries]
        return Segments.concat(parts).coalesce()
