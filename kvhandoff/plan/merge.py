"""Several plans between one pair of ranks as one: what a batched submit moves.

When a prefill rank writes many small requests into one decode rank at once, each
request's plan names the same tensor pairs with the same pieces and differs only in its
index arrays. :func:`merge` concatenates those arrays per tensor pair, so the transport
sees one entry per (tensor pair, pieces) however many requests ride in the submit: one
wire record each, one bounds check each on the receiver.

Pure numpy; the plans are not changed.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

from kvhandoff.plan.model import Part, Plan, TensorPlan, Units, _entry, from_parts
from kvhandoff.plan.request import IndexArray

# what must agree for two entries to become one (everything but the index arrays): the
# fields compared as they are, then the pieces, compared by content
_KEYED = ("component", "tensor", "layer_id", "src_ptr", "dst_ptr", "src_unit", "dst_unit")
_FIXED = (*_KEYED, "pieces", "_per_unit")  # what a merged entry copies from the first
_fixed_key = operator.attrgetter(*_KEYED)
_pieces = operator.attrgetter("pieces")
_table = operator.itemgetter(0)  # a part's unit table


def merge(plans: Sequence[Plan]) -> Plan:
    """One plan that moves exactly the bytes of ``plans`` (between the same two ranks).

    Entries with the same tensor pair, units and pieces are merged, their index arrays
    concatenated in the order of ``plans``; the others are kept as they are, in first-seen
    order. ``ValueError`` when the plans are not between the same source and destination
    ranks, or there are none. Destinations of different plans are expected not to
    overlap (each is a different request's memory); a byte two plans both write is written
    twice, as separate submits would, in no promised order."""
    if not plans:
        raise ValueError("merge() needs at least one plan")
    first = plans[0]
    if len(plans) == 1:
        return first
    ranks = {(p.src_tp_rank, p.dst_tp_rank) for p in plans}
    if len(ranks) > 1:
        raise ValueError(f"merge() takes plans between one pair of ranks, got (src, dst) "
                         f"tp ranks {sorted(ranks)}")
    joined: dict[tuple[int, ...], IndexArray] = {}
    notes = tuple(n for p in plans for n in p.notes)
    parts = _by_parts(plans, joined)
    if parts is not None:
        return from_parts(parts, src_tp_rank=first.src_tp_rank,
                          dst_tp_rank=first.dst_tp_rank, notes=notes)
    entries = _aligned(plans, joined)
    if entries is None:
        entries = _grouped(plans, joined)
    return Plan(entries=tuple(entries), src_tp_rank=first.src_tp_rank,
                dst_tp_rank=first.dst_tp_rank, notes=notes)


def _by_parts(plans: Sequence[Plan], joined: dict[tuple[int, ...], IndexArray]
              ) -> tuple[Part, ...] | None:
    """The planner's own plans, made of the same unit tables (one layout pair, the
    same components moving: a burst of like requests): each table's writers become one
    entry each, over the plans' units joined group by group, no field compared (a
    plan with a group empty adds nothing to it). ``None`` when the plans are not all
    made of the same tables."""
    first = plans[0]._parts
    if first is None:
        return None
    tables = tuple(map(_table, first))
    every: list[tuple[Part, ...]] = []
    for p in plans:
        ps = p._parts
        if ps is None or len(ps) != len(tables) or not all(
                map(operator.is_, tables, map(_table, ps))):
            return None
        every.append(ps)
    return tuple(
        (table, tuple(Units(_join(joined, [ps[i][1][k].src for ps in every]),
                            _join(joined, [ps[i][1][k].dst for ps in every]))
                      for k in range(len(units))))
        for i, (table, units) in enumerate(first))


def _aligned(plans: Sequence[Plan], joined: dict[tuple[int, ...], IndexArray]
             ) -> list[TensorPlan] | None:
    """The common case, without a dict lookup per entry: every plan has the same
    entries in the same order (one layout pair, the same components moving), no two
    alike within a plan, so position ``i`` of every plan forms one group (in the order
    :func:`_grouped` would give, as the first plan's entries all move bytes). ``None``
    when the plans are not like that."""
    first = plans[0].entries
    keys, pieces = list(map(_fixed_key, first)), list(map(id, map(_pieces, first)))
    if len(set(keys)) != len(keys) or not all(len(e.src_idx) for e in first):
        return None
    for p in plans[1:]:
        if (len(p.entries) != len(keys) or list(map(_fixed_key, p.entries)) != keys
                or list(map(id, map(_pieces, p.entries))) != pieces):
            return None
    entries = []
    for column in zip(*(p.entries for p in plans), strict=True):
        same = [e for e in column if len(e.src_idx)]
        if len(same) > 1:
            entries.append(_joined(same, joined))
        elif same:
            entries.append(same[0])
    return entries


def _grouped(plans: Sequence[Plan], joined: dict[tuple[int, ...], IndexArray]
             ) -> list[TensorPlan]:
    """Any plans: entries grouped by everything but their index arrays."""
    groups: dict[tuple[object, ...], list[TensorPlan]] = {}
    # pieces by content, each array read once: the planner shares one pieces array per
    # tensor pair between plans of one layout pair (the ids are stable: plans hold them)
    by_id: dict[int, tuple[object, bytes]] = {}
    for p in plans:
        for e in p.entries:
            if not len(e.src_idx):
                continue
            pieces = by_id.get(id(e.pieces))
            if pieces is None:
                pieces = by_id[id(e.pieces)] = (e.pieces.shape, e.pieces.tobytes())
            groups.setdefault((_fixed_key(e), pieces), []).append(e)
    return [same[0] if len(same) == 1 else _joined(same, joined) for same in groups.values()]


def _joined(same: list[TensorPlan], joined: dict[tuple[int, ...], IndexArray]) -> TensorPlan:
    """One entry for ``same`` (alike but for their index arrays). The planner shares index
    arrays between the tensors of one component, so each run of arrays is concatenated
    once however many entries carry it."""
    fixed = {k: getattr(same[0], k) for k in _FIXED}
    return _entry(fixed, _join(joined, [e.src_idx for e in same]),
                  _join(joined, [e.dst_idx for e in same]))


def _join(joined: dict[tuple[int, ...], IndexArray], arrays: list[IndexArray]) -> IndexArray:
    """``arrays`` concatenated, or the same concatenation made earlier in this merge (the
    arrays are alive all the while, so their ids cannot be reused)."""
    key = tuple(map(id, arrays))
    out = joined.get(key)
    if out is None:
        out = joined[key] = np.concatenate(arrays)
    return out
