"""``plan(src, dst, request)``: one prefill rank's writes into one decode rank."""

from __future__ import annotations

from collections.abc import Callable

from kvhandoff.errors import OutOfBounds, PlanError
from kvhandoff.layout import Layout, TensorSpec
from kvhandoff.plan.compat import (
    ComponentPair,
    LayoutPair,
    TensorPair,
    UnitKind,
    UnitsKey,
    by_rows,
    pair_layouts,
    unit_kind,
)
from kvhandoff.plan.model import Part, Plan, TensorPlan, Units, from_parts, part_entries
from kvhandoff.plan.pairing import check_unique, pair_items, ring_units, token_units
from kvhandoff.plan.request import IndexArray, Indices, Request

_ComponentFn = Callable[[ComponentPair, Indices, list[str]], list[TensorPlan] | Part]
"""A component's entries, or its part (the fast path's: entries made when read)."""


def plan(src: Layout, dst: Layout, request: Request) -> Plan:
    """Plan what ``src`` (a prefill rank) writes into ``dst`` (a decode rank).

    ``request`` maps every component name to its :class:`Indices`, or ``None`` when
    the component does not move in this call. Raises :class:`LayoutMismatch` when
    the layouts cannot pair, :class:`IndexLengthMismatch` / :class:`PlanError` for
    index lists that break the component's policy, :class:`OutOfBounds` when a
    byte would fall outside a registered tensor. Pure: no I/O, inputs untouched.
    """
    return _plan(src, dst, request, _component)


def _plan_general(src: Layout, dst: Layout, request: Request) -> Plan:
    """``plan`` through the general path only (tensor by tensor, as specified): the
    reference the fast path is tested against."""
    return _plan(src, dst, request, _component_general)


def _plan(src: Layout, dst: Layout, request: Request, component: _ComponentFn) -> Plan:
    pair = _paired(src, dst)
    if request.keys() != pair.names:
        unknown = set(request) - pair.names
        missing = pair.names - set(request)
        raise PlanError(
            f"request must name every component exactly: unknown {sorted(unknown)}, "
            f"missing {sorted(missing)} (use None for a component that does not move now)"
        )
    notes: list[str] = []
    parts: list[Part] = []
    entries: list[TensorPlan] | None = None  # once a component went entry by entry
    for comp in pair.components:
        idx = request[comp.name]
        if idx is None:
            continue
        got = component(comp, idx, notes)
        if isinstance(got, list):
            if entries is None:
                entries = part_entries(parts)
            entries += got
        elif entries is not None:
            entries += part_entries([got])
        else:
            parts.append(got)
    if entries is None:
        return from_parts(tuple(parts), src_tp_rank=src.tp_rank, dst_tp_rank=dst.tp_rank,
                          notes=tuple(notes))
    return Plan(entries=tuple(entries), src_tp_rank=src.tp_rank, dst_tp_rank=dst.tp_rank,
                notes=tuple(notes))


# (id(src), id(dst)) → the pair of those very objects. ``pair_layouts``' cache finds a
# pair by equality, so a lookup with layouts equal to, but not the objects of, the pair
# it holds compares them field by field, on every plan. That happens whenever an equal
# copy was paired first: an agent built again at the same addresses in one process, or a
# second decoding of the peer's layout (the session benchmark's raw baseline decodes its
# own). A lookup by identity first skips that. An entry keeps its layouts alive, so its
# ids cannot be reused while it is here.
_by_identity: dict[tuple[int, int], tuple[Layout, Layout, LayoutPair]] = {}
_IDENTITY_MAX = 256


def _paired(src: Layout, dst: Layout) -> LayoutPair:
    hit = _by_identity.get((id(src), id(dst)))
    if hit is not None and hit[0] is src and hit[1] is dst:
        return hit[2]
    pair = pair_layouts(src, dst)
    if len(_by_identity) >= _IDENTITY_MAX:
        _by_identity.clear()
    _by_identity[(id(src), id(dst))] = (src, dst, pair)
    return pair


class _UnitCache:
    """A component's units for one request, per units key, each computed (and validated)
    at most once: shared by the fast path and the general path it may fall back to."""

    __slots__ = ("comp", "idx", "items", "notes", "units")

    def __init__(self, comp: ComponentPair, idx: Indices, notes: list[str]) -> None:
        self.comp, self.idx, self.notes = comp, idx, notes
        self.units: dict[UnitsKey, Units] = {}
        self.items: tuple[IndexArray, IndexArray] | None = None
        if idx.num_rows is not None and comp.tensors and not comp.token_rows:
            raise PlanError(f"component {comp.name!r}: num_rows {idx.num_rows} given, but none "
                            f"of its tensors holds token rows (it counts token rows only)")
        if not comp.tensors and not by_rows(idx):
            self.paired()  # nothing to move here, but the lists still obey the policy

    def paired(self) -> tuple[IndexArray, IndexArray]:
        if self.items is None:
            s, d = pair_items(self.comp.name, self.comp.policy, self.idx, self.notes)
            check_unique(self.comp.name, "decode", d)
            self.items = (s, d)
        return self.items

    def get(self, key: UnitsKey) -> Units:
        u = self.units.get(key)
        if u is None:
            kind, s_rows, d_rows = key
            name, idx = self.comp.name, self.idx
            if kind is UnitKind.TOKEN:
                su, du = token_units(name, self.comp.policy, idx, s_rows, d_rows, self.notes)
                check_unique(name, "decode", du)
            elif kind is UnitKind.RING:
                su, du = ring_units(name, *self.paired(), idx.positions, s_rows, d_rows)
            else:  # UnitKind.ITEM
                su, du = self.paired()
            u = self.units[key] = Units(su, du)
        return u


def _component(comp: ComponentPair, idx: Indices, notes: list[str]
               ) -> list[TensorPlan] | Part:
    """The fast path: units once per units key, bounds against each key's tightest
    tensor, and the component's part (its entries come from the table's per-tensor
    templates when read). Anything out of bounds goes down the general path (sharing
    the units computed so far), which raises exactly what it would have raised alone."""
    cache = _UnitCache(comp, idx, notes)
    table = comp.tables[by_rows(idx)]
    units: list[Units] = []
    for group in table.groups:
        u = cache.get(group.key)
        if len(u.src):
            (s_lo, s_hi), (d_lo, d_hi) = u.ranges
            if s_lo < 0 or d_lo < 0 or s_hi > group.src_max or d_hi > group.dst_max:
                return _component_general(comp, idx, notes, cache)
        units.append(u)
    return table, tuple(units)


def _component_general(
    comp: ComponentPair, idx: Indices, notes: list[str], cache: _UnitCache | None = None
) -> list[TensorPlan]:
    """Tensor by tensor: validate its units, bounds-check it, emit its entry."""
    if cache is None:
        cache = _UnitCache(comp, idx, notes)
    rows = by_rows(idx)
    out = []
    for tp in comp.tensors:
        key, by_row = unit_kind(tp, rows)
        u = cache.get(key)  # validates on every rank, writer or not
        if not len(u.src) or not len(tp.item_pieces):
            continue
        out.append(_tensor_plan(comp.name, tp, u, by_row))
    return out


def _tensor_plan(name: str, tp: TensorPair, u: Units, by_row: bool) -> TensorPlan:
    pcs = tp.row_pieces if by_row else tp.item_pieces
    s_unit = tp.src.row_bytes if by_row else tp.src.item_stride
    d_unit = tp.dst.row_bytes if by_row else tp.dst.item_stride
    s_ext, d_ext = tp.row_extent if by_row else tp.item_extent
    src_range, dst_range = u.ranges
    _bounds(name, tp.src, "prefill", src_range, s_unit, s_ext)
    _bounds(name, tp.dst, "decode", dst_range, d_unit, d_ext)
    return TensorPlan(
        component=name, tensor=tp.src.name, layer_id=tp.src.layer_id,
        src_ptr=tp.src.ptr, dst_ptr=tp.dst.ptr, src_unit=s_unit, dst_unit=d_unit,
        src_idx=u.src, dst_idx=u.dst, pieces=pcs,
    )


def _bounds(
    name: str, t: TensorSpec, side: str, rng: tuple[int, int], unit: int, extent: int
) -> None:
    lo, hi = rng
    if lo < 0 or hi * unit + extent > t.nbytes:
        bad = lo if lo < 0 else hi
        raise OutOfBounds(
            f"component {name!r} tensor {t.name!r} layer {t.layer_id}: {side} index {bad} "
            f"(unit {unit} B) reaches byte {bad * unit + extent} of a {t.nbytes} B tensor"
        )

