"""``plan(src, dst, request)``: one prefill rank's writes into one decode rank."""

from __future__ import annotations

import numpy as np

from kvhandoff.errors import OutOfBounds, PlanError
from kvhandoff.layout import Layout, RowKind
from kvhandoff.plan.compat import ComponentPair, TensorPair, pair_layouts
from kvhandoff.plan.model import Plan, TensorPlan
from kvhandoff.plan.pairing import check_unique, pair_items, ring_units, token_units
from kvhandoff.plan.request import IndexArray, Indices, Request


def plan(src: Layout, dst: Layout, request: Request) -> Plan:
    """Plan what ``src`` (a prefill rank) writes into ``dst`` (a decode rank).

    ``request`` maps every component name to its :class:`Indices`, or ``None`` when
    the component does not move in this call. Raises :class:`LayoutMismatch` when
    the layouts cannot pair, :class:`IndexLengthMismatch` / :class:`PlanError` for
    index lists that break the component's policy, :class:`OutOfBounds` when a
    byte would fall outside a registered tensor. Pure: no I/O, inputs untouched.
    """
    pair = pair_layouts(src, dst)
    unknown = set(request) - pair.names
    missing = pair.names - set(request)
    if unknown or missing:
        raise PlanError(
            f"request must name every component exactly: unknown {sorted(unknown)}, "
            f"missing {sorted(missing)} (use None for a component that does not move now)"
        )
    notes: list[str] = []
    entries: list[TensorPlan] = []
    for comp in pair.components:
        idx = request[comp.name]
        if idx is not None:
            entries.extend(_component(comp, idx, notes))
    return Plan(entries=tuple(entries), src_tp_rank=src.tp_rank, dst_tp_rank=dst.tp_rank,
                notes=tuple(notes))


def _component(comp: ComponentPair, idx: Indices, notes: list[str]) -> list[TensorPlan]:
    units: dict[tuple[str, int, int], tuple[IndexArray, IndexArray]] = {}
    items: list[tuple[IndexArray, IndexArray]] = []  # computed at most once, on first need

    def paired() -> tuple[IndexArray, IndexArray]:
        if not items:
            s, d = pair_items(comp.name, comp.policy, idx, notes)
            check_unique(comp.name, "decode", d)
            items.append((s, d))
        return items[0]

    def units_for(tp: TensorPair) -> tuple[tuple[IndexArray, IndexArray], bool]:
        s, t = tp.src, tp.dst
        row_path = s.row_kind is RowKind.TOKEN and (
            not tp.same_rows or idx.src_first_row or idx.dst_first_row
        )
        ring_path = s.row_kind is RowKind.RING and not tp.same_rows
        key = ("token" if row_path else "ring" if ring_path else "item", s.rows, t.rows)
        if key not in units:
            if row_path:
                su, du = token_units(comp.name, comp.policy, idx, s.rows, t.rows, notes)
                check_unique(comp.name, "decode", du)
            elif ring_path:
                su, du = ring_units(comp.name, *paired(), idx.positions, s.rows, t.rows)
            else:
                su, du = paired()
            units[key] = (su, du)
        return units[key], bool(row_path or ring_path)

    out = []
    for tp in comp.tensors:
        (su, du), by_row = units_for(tp)
        if not len(su):
            continue
        pcs = tp.row_pieces if by_row else tp.item_pieces
        s_unit = tp.src.row_bytes if by_row else tp.src.item_bytes
        d_unit = tp.dst.row_bytes if by_row else tp.dst.item_bytes
        _bounds(comp.name, tp, "prefill", su, s_unit, pcs[:, 0], pcs[:, 4], pcs)
        _bounds(comp.name, tp, "decode", du, d_unit, pcs[:, 1], pcs[:, 5], pcs)
        out.append(TensorPlan(
            component=comp.name, tensor=tp.src.name, layer_id=tp.src.layer_id,
            src_ptr=tp.src.ptr, dst_ptr=tp.dst.ptr, src_unit=s_unit, dst_unit=d_unit,
            src_idx=su, dst_idx=du, pieces=pcs,
        ))
    return out


def _bounds(
    name: str, tp: TensorPair, side: str, units: IndexArray, unit: int,
    off: np.ndarray, stride: np.ndarray, pcs: np.ndarray,
) -> None:
    t = tp.src if side == "prefill" else tp.dst
    lo, hi = int(units.min()), int(units.max())
    extent = int((off + (pcs[:, 3] - 1) * stride + pcs[:, 2]).max())
    if lo < 0 or hi * unit + extent > t.nbytes:
        bad = lo if lo < 0 else hi
        raise OutOfBounds(
            f"component {name!r} tensor {t.name!r} layer {t.layer_id}: {side} index {bad} "
            f"(unit {unit} B) reaches byte {bad * unit + extent} of a {t.nbytes} B tensor"
        )
