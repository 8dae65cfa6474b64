"""End-to-end checksums: a crc32 per component over one side of a plan, in plan order.

Prefill digests the *source* bytes of each chunk's plan just before submitting it and
sends the digests, with the plan's inputs, in the chunk's ``TransferStatus``. Decode
rebuilds the same plan (same layouts, same indices: the planner is deterministic) and
digests the *destination* bytes in the same order. Equal digests mean every byte landed
where the plan put it; a mismatch names the component.

Plan order: entries in order; within an entry, pieces in order; within a piece, units
in index order, each unit's ``count`` runs of ``length`` bytes. Vectorised: one strided
numpy view per piece, gathered in bounded batches (no per-page Python loop).
"""

from __future__ import annotations

import zlib
from typing import Literal

import numpy as np

from kvhandoff.memory import piece_view
from kvhandoff.plan.model import Plan, TensorPlan
from kvhandoff.session.request.views import U8, TensorViews

_BATCH_BYTES = 16 << 20  # bound on the temporary gathered per step


def plan_digests(plan: Plan, side: Literal["src", "dst"], views: TensorViews
                 ) -> dict[str, int]:
    """crc32 of each component's ``side`` bytes of ``plan``, in plan order.

    Components with any tensor outside host memory (no view) are left out: they cannot
    be read here, and the other side leaves them out too."""
    crcs: dict[str, int] = {}
    unreadable: set[str] = set()
    for e in plan.entries:
        ptr = e.src_ptr if side == "src" else e.dst_ptr
        buf = views.get(ptr)
        if buf is None:
            unreadable.add(e.component)
            continue
        crcs[e.component] = _entry_crc(e, buf, side, crcs.get(e.component, 0))
    for name in unreadable:
        crcs.pop(name, None)
    return crcs


def _entry_crc(e: TensorPlan, buf: U8, side: str, crc: int) -> int:
    src = side == "src"
    unit = e.src_unit if src else e.dst_unit
    idx = e.src_idx if src else e.dst_idx
    if not len(idx):
        return crc
    for so, do, ln, cnt, ss, ds in e.pieces.tolist():
        off, stride = (so, ss) if src else (do, ds)
        if not ln or not cnt:
            continue
        view = piece_view(buf, off, unit, cnt, stride, ln, writeable=False)
        step = max(1, _BATCH_BYTES // (cnt * ln))
        for i in range(0, len(idx), step):
            crc = zlib.crc32(np.ascontiguousarray(view[idx[i:i + step]]).data, crc)
    return crc
