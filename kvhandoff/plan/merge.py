"""Several plans between one pair of ranks as one: what a batched submit moves.

When a prefill rank writes many small requests into one decode rank at once, each
request's plan names the same tensor pairs with the same pieces and differs only in its
index arrays. :func:`merge` concatenates those arrays per tensor pair, so the transport
sees one entry per (tensor pair, pieces) however many requests ride in the submit: one
wire record each, one bounds check each on the receiver.

Pure numpy; the plans are not changed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvhandoff.plan.model import Plan, TensorPlan, _entry

# what must agree for two entries to become one (everything but the index arrays)
_FIXED = ("component", "tensor", "layer_id", "src_ptr", "dst_ptr", "src_unit", "dst_unit",
          "pieces", "_per_unit")


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
            key = (e.component, e.tensor, e.layer_id, e.src_ptr, e.dst_ptr, e.src_unit,
                   e.dst_unit, pieces)
            groups.setdefault(key, []).append(e)
    entries = []
    for same in groups.values():
        if len(same) == 1:
            entries.append(same[0])
            continue
        e0 = same[0]
        fixed = {k: getattr(e0, k) for k in _FIXED}
        fixed["_per_unit"] = -1  # recomputed on first use
        entries.append(_entry(fixed, np.concatenate([e.src_idx for e in same]),
                              np.concatenate([e.dst_idx for e in same])))
    notes = tuple(n for p in plans for n in p.notes)
    return Plan(entries=tuple(entries), src_tp_rank=first.src_tp_rank,
                dst_tp_rank=first.dst_tp_rank, notes=notes)
