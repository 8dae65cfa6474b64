"""A deliberately naive oracle: which source byte lands on every destination byte.

The planner (:func:`kvhandoff.plan.plan`) is clever: it factors a handoff into
strided pieces per tensor pair. This module is the opposite on purpose. It walks
the semantics one index, one row, one sharded element at a time, with no shared
code, so that a test can compare the two byte for byte.

Semantics implemented (the contract the planner is checked against):

* Components pair by name, tensors by ``(name, layer_id)``; elided tensors move
  nothing. A ``NO_LAYER`` tensor is written only by the last prefill PP stage.
* Index lists pair per the component's policy: ``exact`` needs equal lengths
  (else :class:`IndexLengthMismatch`), ``trim`` keeps the common prefix.
* Item ``i`` of a tensor starts at ``ptr + i * stride`` (``stride`` 0: ``item_bytes``)
  and is its first ``item_bytes`` bytes; padding after it is never written.
* Whole items move for ``ITEM`` tensors and for TOKEN/RING tensors with equal
  ``rows`` and no first-row offsets. TOKEN tensors otherwise move token rows of
  the concatenated pages; RING tensors with different ring sizes move the row of
  every logical position (``p % rows``) on each side.
* Replicated tensors are written by source rank ``dst.tp_rank * src.tp_size // dst.tp_size``
  (the first source rank of the decode rank's own TP window).
  Sharded tensors: every destination element comes from the source rank holding
  it; among replicas (in rank order), from replica
  ``(dst.tp_rank * src.tp_size // dst.tp_size) % replicas``.

Only layout *data* is used (fields of the records); no planner module is imported.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvhandoff.errors import (
    IndexLengthMismatch,
    LayoutError,
    LayoutMismatch,
    OutOfBounds,
    PlanError,
)
from kvhandoff.layout import NO_LAYER, Component, Layout, RowKind, ShardSpec, TensorSpec
from kvhandoff.plan.execute import HostMemory
from kvhandoff.plan.request import Indices, Request
from kvhandoff.state_types import LengthPolicy, policy

I64 = npt.NDArray[np.int64]

UnitPair = tuple[int, int]
"""Absolute start addresses of one source unit and the destination unit it fills."""


@dataclass(frozen=True, slots=True)
class ByteMap:
    """Every destination byte one handoff writes, sorted by destination address.

    ``dst[i]`` receives the byte at absolute address ``src[i]`` of source layout
    number ``layout[i]`` (its position in the list given to :func:`expected_writes`).
    Destination addresses are unique. ``trimmed`` names the components whose
    index lists (or token rows) a ``trim`` policy shortened; ``moved`` those that
    write at least one byte.
    """

    dst: I64
    layout: I64
    src: I64
    trimmed: frozenset[str]
    moved: frozenset[str]

    def __len__(self) -> int:
        return len(self.dst)

    def of_layout(self, i: int) -> tuple[I64, I64]:
        """``(dst, src)`` address arrays of the bytes source layout ``i`` supplies."""
        mask = self.layout == i
        return self.dst[mask], self.src[mask]

    def as_dict(self) -> dict[int, tuple[int, int]]:
        """``{dst_addr: (source layout index, src_addr)}``."""
        return {
            int(d): (int(i), int(s))
            for d, i, s in zip(self.dst, self.layout, self.src, strict=True)
        }

    def apply(self, src_mems: Sequence[HostMemory], dst_mem: HostMemory) -> None:
        """Copy every mapped byte, one at a time, from ``src_mems[layout]`` to ``dst_mem``."""
        for d, i, s in zip(self.dst.tolist(), self.layout.tolist(), self.src.tolist(),
                           strict=True):
            dst_mem.view(d)[0] = src_mems[i].view(s)[0]


def expected_writes(srcs: Sequence[Layout], dst: Layout, request: Request) -> ByteMap:
    """The oracle: what every source layout in ``srcs`` writes into ``dst``.

    ``srcs`` are the ranks of one prefill instance (all TP ranks, and all PP
    stages when it is pipelined). Raises :class:`IndexLengthMismatch` /
    :class:`PlanError` / :class:`OutOfBounds` / :class:`LayoutMismatch` where the
    planner must, and :class:`ValueError` when two writes hit one destination byte
    (a request that overlaps itself has no defined result).
    """
    dsts: list[I64] = []
    lays: list[I64] = []
    srcs_out: list[I64] = []
    trimmed: set[str] = set()
    moved: set[str] = set()
    for li, src in enumerate(srcs):
        for comp, st, dt, idx in _tensor_pairs(src, dst, request):
            units, per_row, trim = _units(comp, st, dt, idx)
            if trim:
                trimmed.add(comp.name)
            if st.elided or dt.elided or not units:
                continue
            s_off, d_off = _unit_pattern(st, dt, src, dst, per_row)
            for s_unit, d_unit in units:
                s_addr = s_unit + s_off
                d_addr = d_unit + d_off
                _check_inside(st, s_addr, "source")
                _check_inside(dt, d_addr, "destination")
                srcs_out.append(s_addr)
                dsts.append(d_addr)
                lays.append(np.full(len(d_addr), li, dtype=np.int64))
                if len(d_addr):
                    moved.add(comp.name)
    return _assemble(dsts, lays, srcs_out, frozenset(trimmed), frozenset(moved))


def _assemble(dsts: list[I64], lays: list[I64], srcs: list[I64],
              trimmed: frozenset[str], moved: frozenset[str]) -> ByteMap:
    if not dsts:
        z = np.zeros(0, dtype=np.int64)
        return ByteMap(z, z, z, trimmed, moved)
    d, i, s = np.concatenate(dsts), np.concatenate(lays), np.concatenate(srcs)
    order = np.argsort(d, kind="stable")
    d, i, s = d[order], i[order], s[order]
    dup = np.flatnonzero(np.diff(d) == 0)
    if len(dup):
        raise ValueError(f"destination byte {int(d[dup[0]]):#x} is written twice")
    return ByteMap(d, i, s, trimmed, moved)


# ---------------------------------------------------------------- pairing


def _tensor_pairs(src: Layout, dst: Layout, request: Request
                  ) -> Iterator[tuple[Component, TensorSpec, TensorSpec, Indices]]:
    """Every (destination component, source tensor, destination tensor, indices)
    that ``src`` must write, in destination order."""
    for comp in dst.components:
        if comp.name not in request:
            raise PlanError(f"request does not name component {comp.name!r}")
        idx = request[comp.name]
        if idx is None:
            continue
        src_comp = _component(src, comp)
        by_key = {t.key: t for t in src_comp.tensors}
        live = [t for t in comp.tensors if not t.elided and t.key in by_key]
        if idx.num_rows is not None and live and all(
                t.row_kind is not RowKind.TOKEN for t in live):
            raise PlanError(f"component {comp.name!r}: num_rows {idx.num_rows} given, but "
                            f"none of its tensors holds token rows")
        for dt in comp.tensors:
            st = by_key.get(dt.key)
            if st is not None and _stage_writes(src, dst, dt):
                yield comp, st, dt, idx


def _component(src: Layout, comp: Component) -> Component:
    for c in src.components:
        if c.name == comp.name:
            if c.type != comp.type:
                raise LayoutMismatch(f"component {comp.name!r}: {c.type} vs {comp.type}")
            return c
    raise LayoutMismatch(f"prefill has no component {comp.name!r}")


def _stage_writes(src: Layout, dst: Layout, dt: TensorSpec) -> bool:
    """Layer tensors exist on exactly one prefill stage, so holding one means
    writing it. A NO_LAYER tensor exists on every stage; only the last writes."""
    if dt.layer_id != NO_LAYER:
        return True
    if dst.pp_size != 1:
        raise NotImplementedError("the oracle defines NO_LAYER tensors only for decode PP 1")
    return src.pp_rank == src.pp_size - 1


def _pair_lists(comp: Component, idx: Indices) -> tuple[list[int], list[int], bool]:
    """The paired item lists per the component policy, and whether it trimmed."""
    s, d = idx.src.tolist(), idx.dst.tolist()
    if len(s) == len(d):
        return s, d, False
    if policy(comp.type).length is LengthPolicy.EXACT:
        raise IndexLengthMismatch(
            f"component {comp.name!r}: {len(s)} source vs {len(d)} destination indices"
        )
    n = min(len(s), len(d))
    return s[:n], d[:n], True


# ---------------------------------------------------------------- units


def _units(comp: Component, st: TensorSpec, dt: TensorSpec, idx: Indices
           ) -> tuple[list[UnitPair], bool, bool]:
    """``(unit pairs, units are rows, trimmed)`` for one tensor pair.

    A unit is a whole item, or one row when the two sides page differently.
    """
    if st.row_kind is not dt.row_kind:
        raise LayoutMismatch(f"tensor {dt.key}: row kinds {st.row_kind} vs {dt.row_kind}")
    token_rows = st.row_kind is RowKind.TOKEN and (
        st.rows != dt.rows or idx.src_first_row != 0 or idx.dst_first_row != 0
        or idx.num_rows is not None
    )
    if token_rows:
        units, trim = _token_units(comp, st, dt, idx)
        return units, True, trim
    if st.row_kind is RowKind.RING and st.rows != dt.rows:
        units, trim = _ring_units(comp, st, dt, idx)
        return units, True, trim
    s, d, trim = _pair_lists(comp, idx)
    units = [(_item(st, i), _item(dt, j)) for i, j in zip(s, d, strict=True)]
    return units, False, trim


def _stride(t: TensorSpec) -> int:
    """Bytes between item starts, read off the record's fields (0: items are packed)."""
    return t.stride if t.stride else t.item_bytes


def _item(t: TensorSpec, item: int) -> int:
    return t.ptr + item * _stride(t)


def _row(t: TensorSpec, item: int, row: int) -> int:
    return t.ptr + item * _stride(t) + row * t.row_bytes


def _token_units(comp: Component, st: TensorSpec, dt: TensorSpec, idx: Indices
                 ) -> tuple[list[UnitPair], bool]:
    """Token row ``i`` of the chunk is row ``first_row + i`` of the concatenated pages."""
    fs, fd = idx.src_first_row, idx.dst_first_row
    cap_s = len(idx.src) * st.rows - fs
    cap_d = len(idx.dst) * dt.rows - fd
    trim = False
    if idx.num_rows is not None:
        n = idx.num_rows
        if n > min(cap_s, cap_d):
            raise PlanError(
                f"component {comp.name!r}: num_rows {n} exceeds the pages "
                f"({cap_s} source rows, {cap_d} destination rows)"
            )
    elif cap_s == cap_d:
        n = cap_s
    elif policy(comp.type).length is LengthPolicy.EXACT:
        raise IndexLengthMismatch(
            f"component {comp.name!r}: {cap_s} source token rows vs {cap_d} destination"
        )
    else:
        n, trim = min(cap_s, cap_d), True
    units = []
    for i in range(n):
        s, d = fs + i, fd + i
        units.append((
            _row(st, int(idx.src[s // st.rows]), s % st.rows),
            _row(dt, int(idx.dst[d // dt.rows]), d % dt.rows),
        ))
    return units, trim


def _ring_units(comp: Component, st: TensorSpec, dt: TensorSpec, idx: Indices
                ) -> tuple[list[UnitPair], bool]:
    """Position ``p`` lives in row ``p % rows`` of a ring, on each side."""
    if idx.positions is None:
        raise PlanError(f"component {comp.name!r}: ring sizes differ but no positions given")
    s, d, trim = _pair_lists(comp, idx)
    units = [
        (_row(st, i, p % st.rows), _row(dt, j, p % dt.rows))
        for i, j in zip(s, d, strict=True)
        for p in idx.positions.tolist()
    ]
    return units, trim


def _check_inside(t: TensorSpec, addrs: I64, side: str) -> None:
    if len(addrs) and (addrs.min() < t.ptr or addrs.max() >= t.ptr + t.nbytes):
        raise OutOfBounds(f"{side} tensor {t.key}: a byte falls outside [{t.ptr:#x}, +{t.nbytes})")


# ---------------------------------------------------------------- sharding


def _unit_pattern(st: TensorSpec, dt: TensorSpec, src: Layout, dst: Layout,
                  per_row: bool) -> tuple[I64, I64]:
    """Byte offsets ``(in the source unit, in the destination unit)`` that the
    source rank writes; the same for every unit of the pair."""
    if (st.shard is None) != (dt.shard is None):
        raise LayoutMismatch(f"tensor {dt.key}: sharded on one side only")
    if st.shard is None or dt.shard is None:
        return _replicated_pattern(st, dt, src, dst, per_row)
    return _sharded_pattern(st, dt, st.shard, dt.shard, src, dst, per_row)


def _replicated_pattern(st: TensorSpec, dt: TensorSpec, src: Layout, dst: Layout,
                        per_row: bool) -> tuple[I64, I64]:
    """Every byte of the unit, from the one source rank at the start of the decode rank's
    TP window, ``dst.tp_rank * src.tp_size // dst.tp_size``."""
    size = st.row_bytes if per_row else st.item_bytes
    if size != (dt.row_bytes if per_row else dt.item_bytes):
        raise LayoutMismatch(f"tensor {dt.key}: replicated units of different sizes")
    if src.tp_rank != dst.tp_rank * src.tp_size // dst.tp_size:
        size = 0
    off = np.arange(size, dtype=np.int64)
    return off, off.copy()


def _held(g: int, tp: int, rank: int) -> range:
    """Global elements of a group of length ``g`` that ``rank`` of ``tp`` holds."""
    if tp <= g:
        if g % tp:
            raise LayoutError(f"group {g} does not split over TP {tp}")
        n = g // tp
        return range(rank * n, rank * n + n)
    if tp % g:
        raise LayoutError(f"TP {tp} is not a multiple of group {g}")
    head = rank // (tp // g)
    return range(head, head + 1)


def _local_index(groups: tuple[int, ...], tp: int, rank: int, j: int, a: int) -> int:
    """Position of global element ``a`` of group ``j`` on ``rank``'s local axis."""
    before = sum(len(_held(g, tp, rank)) for g in groups[:j])
    return before + a - _held(groups[j], tp, rank).start


def _writer(g: int, a: int, src_tp: int, dst_rank: int, dst_tp: int) -> int:
    """The source rank that writes element ``a`` of a group of length ``g``:
    the one holding it, or among several holders (replicas, in rank order)
    replica ``(dst_rank * src_tp // dst_tp) % replicas``."""
    holders = [r for r in range(src_tp) if a in _held(g, src_tp, r)]
    return holders[(dst_rank * src_tp // dst_tp) % len(holders)]


def _sharded_pattern(st: TensorSpec, dt: TensorSpec, ss: ShardSpec, ds: ShardSpec,
                     src: Layout, dst: Layout, per_row: bool) -> tuple[I64, I64]:
    """Walk every (outer row, group, destination element, byte) of one unit."""
    if ss.groups != ds.groups or ss.inner_bytes != ds.inner_bytes:
        raise LayoutMismatch(f"tensor {dt.key}: shard specs {ss} vs {ds}")
    outer = ss.outer // st.rows if per_row else ss.outer
    if outer != (ds.outer // dt.rows if per_row else ds.outer):
        raise LayoutMismatch(f"tensor {dt.key}: units hold different outer rows")
    groups, inner = ss.groups, ss.inner_bytes
    s_axis = sum(len(_held(g, src.tp_size, src.tp_rank)) for g in groups)
    d_axis = sum(len(_held(g, dst.tp_size, dst.tp_rank)) for g in groups)
    s_off: list[int] = []
    d_off: list[int] = []
    for o in range(outer):
        for j, g in enumerate(groups):
            for a in _held(g, dst.tp_size, dst.tp_rank):
                if _writer(g, a, src.tp_size, dst.tp_rank, dst.tp_size) != src.tp_rank:
                    continue
                s_el = o * s_axis + _local_index(groups, src.tp_size, src.tp_rank, j, a)
                d_el = o * d_axis + _local_index(groups, dst.tp_size, dst.tp_rank, j, a)
                for b in range(inner):
                    s_off.append(s_el * inner + b)
                    d_off.append(d_el * inner + b)
    return np.array(s_off, dtype=np.int64), np.array(d_off, dtype=np.int64)
