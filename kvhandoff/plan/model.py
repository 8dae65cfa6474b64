"""The Plan: factored per tensor pair, flattened and coalesced on demand.

Factored form (what the planner builds and executors prefer):
    for every tensor pair, unit index arrays ``src_idx[N]`` / ``dst_idx[N]`` and a
    few pieces; byte ``b`` of piece ``p`` repetition ``j`` of pair ``i`` moves from
    ``src_ptr + src_idx[i]*src_unit + p.src_off + j*p.src_stride + b`` to the
    matching destination address.
Flat form (for engines that take address lists): ``(src_addr, dst_addr, length)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvhandoff.plan.format import format_plan
from kvhandoff.plan.request import IndexArray, index_range
from kvhandoff.plan.runs import run_starts, runs

if TYPE_CHECKING:
    from kvhandoff.plan.compat import UnitTable

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

    def runs(self) -> Segments:
        """Coalesced segments of a ``whole_units`` pair, computed on the index arrays."""
        return _layer_runs((self,))


def _layer_runs(group: Sequence[TensorPlan]) -> Segments:
    """The coalesced segments of ``whole_units`` pairs that share their index arrays and
    unit size (a component's layers), pair by pair: the runs are found once and laid
    out at every pair's base addresses in one broadcast."""
    first = group[0]
    s, d, unit = first.src_idx, first.dst_idx, first.src_unit
    if not len(s):
        return Segments.empty()
    starts, counts = runs(s, d)
    if len(group) == 1:
        return Segments(first.src_ptr + s[starts] * unit, first.dst_ptr + d[starts] * unit,
                        counts * unit)
    src_base = np.array([e.src_ptr for e in group], np.int64)[:, None]
    dst_base = np.array([e.dst_ptr for e in group], np.int64)[:, None]
    return Segments((src_base + s[starts] * unit).ravel(), (dst_base + d[starts] * unit).ravel(),
                    np.tile(counts * unit, len(group)))


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


class Units:
    """Paired unit indices of one component (for one units key), with their ranges
    computed once, when first asked (the planner's bounds checks ask; a merge's joined
    units are never checked)."""

    __slots__ = ("_ranges", "dst", "src")

    def __init__(self, src: IndexArray, dst: IndexArray) -> None:
        self.src, self.dst = src, dst
        self._ranges: tuple[tuple[int, int], tuple[int, int]] | None = None

    @property
    def ranges(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(index_range(src), index_range(dst))``."""
        if self._ranges is None:
            self._ranges = (index_range(self.src), index_range(self.dst))
        return self._ranges


Part = tuple["UnitTable", tuple[Units, ...]]
"""One component as the planner's fast path planned it: its unit table (what depends
on the layouts alone) and the request's units, one per table group. Its entries are the
table's writers whose units are not empty, in order."""


def part_entries(parts: Sequence[Part]) -> list[TensorPlan]:
    """The entries of ``parts``, part by part."""
    out = []
    for table, units in parts:
        for k, fixed in table.writers:
            u = units[k]
            if len(u.src):
                out.append(_entry(fixed, u.src, u.dst))
    return out


def from_parts(parts: tuple[Part, ...], *, src_tp_rank: int, dst_tp_rank: int,
               notes: tuple[str, ...]) -> Plan:
    """The plan of ``parts``, equal to ``Plan(entries=tuple(part_entries(parts)), ...)``,
    whose entries are made when first read. Most plans of a burst are only counted and
    merged (:func:`~kvhandoff.plan.merge.merge` joins their parts), so theirs never are."""
    p: Plan = _new(Plan)
    p.__dict__.update(src_tp_rank=src_tp_rank, dst_tp_rank=dst_tp_rank, notes=notes,
                      _nbytes=sum(len(u.src) * n for table, units in parts
                                  for u, n in zip(units, table.unit_bytes, strict=True)),
                      _parts=parts)
    return p


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


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything one source rank writes into one destination rank for one call.

    (No ``__slots__``: a plan the planner's fast path builds holds its parts, and its
    ``entries`` are made from them on first read, see :func:`from_parts`.)
    """

    entries: tuple[TensorPlan, ...]
    src_tp_rank: int = 0
    dst_tp_rank: int = 0
    notes: tuple[str, ...] = field(default=())  # trims and other non-fatal decisions
    # nbytes, computed on first use (the sender, the write batcher and the transport ask)
    _nbytes: int = field(default=-1, init=False, repr=False, compare=False)
    # the planner's parts, when every entry came from one (its fast path): see ``Part``.
    # Not an init field, so ``dataclasses.replace`` drops it.
    _parts: tuple[Part, ...] | None = field(default=None, init=False, repr=False,
                                            compare=False)

    def __getattr__(self, name: str) -> object:
        """Only for an attribute never set: the entries of a plan made by
        :func:`from_parts`, made now and kept."""
        parts = self.__dict__.get("_parts")
        if name != "entries" or parts is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        entries = tuple(part_entries(parts))
        object.__setattr__(self, "entries", entries)
        return entries

    @property
    def nbytes(self) -> int:
        if self._nbytes < 0:
            object.__setattr__(self, "_nbytes",
                               sum(e.bytes_per_unit * len(e.src_idx) for e in self.entries))
        return self._nbytes

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
        if self._nbytes < 0:  # the same pass gives nbytes
            object.__setattr__(self, "_nbytes", sum(out.values()))
        return out

    def flatten(self) -> Segments:
        """Every segment, uncoalesced, entry by entry."""
        return Segments.concat([e.segments() for e in self.entries])

    def entry_runs(self) -> list[Segments]:
        """The entries' coalesced segments, in plan order, in parts: neighbouring
        ``whole_units`` entries that share index arrays and unit size (a component's
        layers) make one part and find their runs once; any other entry is a part."""
        out: list[Segments] = []
        es, i = self.entries, 0
        while i < len(es):
            e, j = es[i], i + 1
            if not e.whole_units:
                out.append(e.segments().coalesce())
                i = j
                continue
            while (j < len(es) and es[j].src_idx is e.src_idx and es[j].dst_idx is e.dst_idx
                   and es[j].src_unit == e.src_unit and es[j].whole_units):
                j += 1
            out.append(_layer_runs(es[i:j]))
            i = j
        return out

    def coalesce(self) -> Segments:
        """The fewest segments that move the same bytes, in plan order."""
        return Segments.concat(self.entry_runs()).coalesce()
