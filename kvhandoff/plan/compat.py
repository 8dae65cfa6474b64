"""Handshake-time compatibility: pair two layouts' components and tensors, or say why not.

``pair_layouts`` is computed once per (prefill rank, decode rank) and cached; it is
where every layout-level incompatibility is found, so a request never fails on
something the handshake could have seen.
"""

from __future__ import annotations

import enum
import functools
import sys
from dataclasses import dataclass, field

import numpy as np

from kvhandoff.errors import LayoutMismatch
from kvhandoff.layout import NO_LAYER, Component, Layout, RowKind, TensorSpec
from kvhandoff.plan.request import Indices
from kvhandoff.plan.shard import NO_PIECES, Side, pieces
from kvhandoff.state_types import Policy, policy


@dataclass(frozen=True, slots=True)
class TensorPair:
    src: TensorSpec
    dst: TensorSpec
    item_pieces: np.ndarray  # pieces for one whole item
    row_pieces: np.ndarray  # pieces for one row (TOKEN / RING tensors)
    # bytes past a unit's start that the pieces reach, per side: (src, dst)
    item_extent: tuple[int, int]
    row_extent: tuple[int, int]

    @property
    def same_rows(self) -> bool:
        return self.src.rows == self.dst.rows


class UnitKind(enum.StrEnum):
    """What one unit of a tensor pair is, for a request: how the planner turns the
    request's indices into unit indices (see :func:`unit_kind`)."""

    TOKEN = "token"  # one token row of a page tensor (page sizes differ, or rows are named)
    RING = "ring"  # one ring row; ring sizes differ, so rows move by position
    ITEM = "item"  # one whole item (page, slot, aux row), paired item by item


UnitsKey = tuple[UnitKind, int, int]
"""(kind, prefill rows, decode rows): tensors with equal keys share their units."""


@dataclass(frozen=True, slots=True)
class UnitGroup:
    """One distinct way a component's tensors turn a request into units (computed once
    per request for every tensor sharing it), with the bounds of every tensor that uses
    it folded into the highest unit index each side may take."""

    key: UnitsKey
    src_max: int  # a unit index above this reaches past some writing tensor's end
    dst_max: int


@dataclass(frozen=True, slots=True)
class UnitTable:
    """A component's tensors as the planner walks them for one request shape (whether
    the request starts mid-page or not): everything that depends only on the layouts."""

    groups: tuple[UnitGroup, ...]  # in order of first use
    # per writing tensor pair, in order: (index into groups, the fixed TensorPlan fields)
    writers: tuple[tuple[int, dict[str, object]], ...]
    # per group: the bytes one of its units moves, summed over the writers that use it
    unit_bytes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ComponentPair:
    name: str
    policy: Policy
    # every non-elided pair, including those this source does not write (another rank
    # was elected): a request is validated the same way on every rank
    tensors: tuple[TensorPair, ...]
    # [whole pages, token rows named by the request (by_rows)]: see unit_table()
    tables: tuple[UnitTable, UnitTable] = field(init=False, repr=False, compare=False)
    # some tensor holds token rows (what a request's num_rows counts)
    token_rows: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", (unit_table(self.name, self.tensors, False),
                                            unit_table(self.name, self.tensors, True)))
        object.__setattr__(self, "token_rows",
                           any(tp.src.row_kind is RowKind.TOKEN for tp in self.tensors))


@dataclass(frozen=True, slots=True)
class LayoutPair:
    src: Layout
    dst: Layout
    components: tuple[ComponentPair, ...]
    names: frozenset[str]


def check_compatible(src: Layout, dst: Layout) -> None:
    """Raise :class:`LayoutMismatch` listing every reason ``src`` cannot feed ``dst``."""
    pair_layouts(src, dst)


@functools.lru_cache(maxsize=256)
def pair_layouts(src: Layout, dst: Layout) -> LayoutPair:
    problems: list[str] = []
    src_by = {c.name: c for c in src.components}
    dst_by = {c.name: c for c in dst.components}
    for name in sorted(src_by.keys() - dst_by.keys()):
        problems.append(f"component {name!r} ({src_by[name].type.value}) exists on prefill only")
    for name in sorted(dst_by.keys() - src_by.keys()):
        problems.append(f"component {name!r} ({dst_by[name].type.value}) exists on decode only")
    pairs = []
    for c in src.components:
        d = dst_by.get(c.name)
        if d is None:
            continue
        if c.type is not d.type:
            problems.append(
                f"component {c.name!r}: prefill type {c.type.value} vs decode type {d.type.value}"
            )
            continue
        pairs.append(_pair_component(src, dst, c, d, problems))
    if problems:
        raise LayoutMismatch(problems)
    return LayoutPair(src, dst, tuple(pairs), frozenset(src_by))


def _pair_component(
    src: Layout, dst: Layout, c: Component, d: Component, problems: list[str]
) -> ComponentPair:
    dst_t = {t.key: t for t in d.tensors}
    src_keys = {t.key for t in c.tensors}
    lo, hi = src.layers
    for t in d.tensors:
        mine = t.layer_id == NO_LAYER or lo <= t.layer_id < hi
        if mine and t.key not in src_keys:
            problems.append(
                f"component {c.name!r}: decode tensor {t.name!r} layer {t.layer_id} lies in "
                f"prefill's layers {lo}..{hi} but prefill registers no such tensor"
            )
    out = []
    for s in c.tensors:
        match = dst_t.get(s.key)
        if match is None:
            problems.append(
                f"component {c.name!r}: prefill tensor {s.name!r} layer {s.layer_id} has no "
                f"decode counterpart"
            )
            continue
        t = match
        why = _mismatch(src, dst, s, t)
        if why:
            problems.append(f"component {c.name!r} tensor {s.name!r} layer {s.layer_id}: {why}")
            continue
        if s.elided:
            continue
        if _pp_elected(src, dst, s):
            item, row = _pieces(src, dst, s, t, rows=False), _pieces(src, dst, s, t, rows=True)
        else:
            item = row = NO_PIECES
        out.append(TensorPair(s, t, item, row, _extent(item), _extent(row)))
    return ComponentPair(c.name, policy(c.type), tuple(out))


def _pp_elected(src: Layout, dst: Layout, t: TensorSpec) -> bool:
    """A tensor of no layer exists on every prefill PP stage; when decode has one stage,
    only the last prefill stage (which sampled the first token) writes it."""
    return t.layer_id != NO_LAYER or dst.pp_size > 1 or src.pp_rank == src.pp_size - 1


def _mismatch(src: Layout, dst: Layout, s: TensorSpec, t: TensorSpec) -> str:
    if s.elided != t.elided:
        side = "prefill" if s.elided else "decode"
        return f"elided (item_bytes 0) on {side} only"
    if s.elided:
        return ""
    if s.dtype != t.dtype:
        return f"dtype {s.dtype} on prefill vs {t.dtype} on decode"
    if s.row_kind is not t.row_kind:
        return f"row kind {s.row_kind.value} on prefill vs {t.row_kind.value} on decode"
    if (s.shard is None) != (t.shard is None):
        side = "prefill" if s.shard is None else "decode"
        return f"replicated on {side} but TP-sharded on the other side"
    if s.geometry() == t.geometry():
        return ""
    tp = f"TP {src.tp_size} → {dst.tp_size}"
    if s.shard is None:
        return (f"prefill row {s.row_bytes} B vs decode row {t.row_bytes} B ({tp}); "
                f"prefill item {s.item_bytes} B, decode item {t.item_bytes} B")
    a, b = s.shard, t.shard
    assert b is not None
    return (f"global shard shape differs: prefill outer {a.outer // s.rows} x groups {a.groups} "
            f"x {a.inner_bytes} B vs decode outer {b.outer // t.rows} x groups {b.groups} x "
            f"{b.inner_bytes} B per row (prefill item {s.item_bytes} B vs decode item "
            f"{t.item_bytes} B with {tp})")


def _extent(pcs: np.ndarray) -> tuple[int, int]:
    if not len(pcs):
        return (0, 0)
    reps = pcs[:, 3] - 1
    return (int((pcs[:, 0] + reps * pcs[:, 4] + pcs[:, 2]).max()),
            int((pcs[:, 1] + reps * pcs[:, 5] + pcs[:, 2]).max()))


def _pieces(src: Layout, dst: Layout, s: TensorSpec, t: TensorSpec, rows: bool) -> np.ndarray:
    div_s = s.rows if rows else 1
    div_t = t.rows if rows else 1
    if not rows and s.rows != t.rows and s.row_kind is not RowKind.ITEM:
        # whole items differ in size; only row units can pair. Pieces for a whole item
        # are then never used, but still say whether this source sends anything.
        div_s, div_t = s.rows, t.rows
    return pieces(
        Side(s.item_bytes // div_s, s.shard, s.shard.outer // div_s if s.shard else 1,
             src.tp_rank, src.tp_size),
        Side(t.item_bytes // div_t, t.shard, t.shard.outer // div_t if t.shard else 1,
             dst.tp_rank, dst.tp_size),
    )


_NO_LIMIT = sys.maxsize  # above any int64 index


def by_rows(idx: Indices) -> bool:
    """Whether a request names token rows itself (a first row on either side, or
    ``num_rows``): TOKEN tensors then move row by row even when whole pages match."""
    return bool(idx.src_first_row or idx.dst_first_row or idx.num_rows is not None)


def unit_kind(tp: TensorPair, rows: bool) -> tuple[UnitsKey, bool]:
    """The units key of a tensor pair and whether it moves by rows: the same decision the
    general path of the planner makes per tensor (``rows``: :func:`by_rows` of the
    request)."""
    s, t = tp.src, tp.dst
    row_path = s.row_kind is RowKind.TOKEN and (not tp.same_rows or rows)
    ring_path = s.row_kind is RowKind.RING and not tp.same_rows
    kind = UnitKind.TOKEN if row_path else UnitKind.RING if ring_path else UnitKind.ITEM
    key = (kind, s.rows, t.rows)
    return key, bool(row_path or ring_path)


def _max_index(unit: int, extent: int, nbytes: int) -> int:
    """The highest unit index ``i`` with ``i * unit + extent <= nbytes`` (-1: none)."""
    if unit > 0:
        return (nbytes - extent) // unit
    if unit == 0:
        return _NO_LIMIT if extent <= nbytes else -1
    return -1  # never happens for a validated layout; -1 sends it down the general path


def unit_table(name: str, tensors: tuple[TensorPair, ...], rows: bool) -> UnitTable:
    keys: dict[UnitsKey, list[int]] = {}  # key -> [src_max, dst_max]
    per_key: dict[UnitsKey, int] = {}  # key -> bytes per unit, over its writers
    writers: list[tuple[int, dict[str, object]]] = []
    for tp in tensors:
        key, by_row = unit_kind(tp, rows)
        lim = keys.setdefault(key, [_NO_LIMIT, _NO_LIMIT])
        if not len(tp.item_pieces):
            continue
        pcs = tp.row_pieces if by_row else tp.item_pieces
        s_unit = tp.src.row_bytes if by_row else tp.src.item_stride
        d_unit = tp.dst.row_bytes if by_row else tp.dst.item_stride
        s_ext, d_ext = tp.row_extent if by_row else tp.item_extent
        lim[0] = min(lim[0], _max_index(s_unit, s_ext, tp.src.nbytes))
        lim[1] = min(lim[1], _max_index(d_unit, d_ext, tp.dst.nbytes))
        per_unit = int(sum(row[2] * row[3] for row in pcs.tolist()))
        per_key[key] = per_key.get(key, 0) + per_unit
        writers.append((list(keys).index(key), {
            "component": name, "tensor": tp.src.name, "layer_id": tp.src.layer_id,
            "src_ptr": tp.src.ptr, "dst_ptr": tp.dst.ptr, "src_unit": s_unit,
            "dst_unit": d_unit, "pieces": pcs, "_per_unit": per_unit,
        }))
    groups = tuple(UnitGroup(k, v[0], v[1]) for k, v in keys.items())
    return UnitTable(groups, tuple(writers), tuple(per_key.get(k, 0) for k in keys))
