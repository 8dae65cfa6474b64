"""``plan(src, dst, request)``: one prefill rank's writes into one decode rank."""

from __future__ import annotations

from kvhandoff.errors import OutOfBounds, PlanError
from kvhandoff.layout import Layout, RowKind, TensorSpec
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
    units: dict[tuple[str, int, int], Units] = {}
    items: list[tuple[IndexArray, IndexArray]] = []  # computed at most once, on first need

    def paired() -> tuple[IndexArray, IndexArray]:
        if not items:
            s, d = pair_items(comp.name, comp.policy, idx, notes)
            check_unique(comp.name, "decode", d)
            items.append((s, d))
        return items[0]

    def units_for(tp: TensorPair) -> tuple[Units, bool]:
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
            units[key] = Units(su, du)
        return units[key], bool(row_path or ring_path)

    by_items = idx.num_rows is None and not idx.src_first_row and not idx.dst_first_row
    if not comp.tensors and by_items:
        paired()  # nothing to move here, but the lists still obey the policy
    out = []
    for tp in comp.tensors:
        u, by_row = units_for(tp)  # validates on every rank, writer or not
        if not len(u.src) or not len(tp.item_pieces):
            continue
        pcs = tp.row_pieces if by_row else tp.item_pieces
        s_unit = tp.src.row_bytes if by_row else tp.src.item_bytes
        d_unit = tp.dst.row_bytes if by_row else tp.dst.item_bytes
        s_ext, d_ext = tp.row_extent if by_row else tp.item_extent
        _bounds(comp.name, tp.src, "prefill", u.src_range, s_unit, s_ext)
        _bounds(comp.name, tp.dst, "decode", u.dst_range, d_unit, d_ext)
        out.append(TensorPlan(
            component=comp.name, tensor=tp.src.name, layer_id=tp.src.layer_id,
            src_ptr=tp.src.ptr, dst_ptr=tp.dst.ptr, src_unit=s_unit, dst_unit=d_unit,
            src_idx=u.src, dst_idx=u.dst, pieces=pcs,
        ))
    return out


class Units:
    """Paired unit indices of one component, with their ranges computed once."""

    __slots__ = ("dst", "dst_range", "src", "src_range")

    def __init__(self, src: IndexArray, dst: IndexArray) -> None:
        self.src, self.dst = src, dst
        self.src_range = (int(src.min()), int(src.max())) if len(src) else (0, 0)
        self.dst_range = (int(dst.min()), int(dst.max())) if len(dst) else (0, 0)


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
