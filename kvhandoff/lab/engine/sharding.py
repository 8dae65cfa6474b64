"""Tensor-parallel emulation at the memory level: a unit's global bytes ↔ one rank's share.

Uses the :class:`~kvhandoff.layout.ShardSpec` of the tensor — the same declaration the
planner intersects — so a rank's pool holds exactly the bytes that rank would hold in a
real TP deployment (its KV heads, its slice of each GDN ``q|k|v`` conv sub-block, its
SSM heads), and reassembly uses nothing but what each rank holds.

A unit is viewed as ``outer × axis × inner_bytes`` (``outer`` counts the shard's outer
rows inside one unit). All copies are vectorised fancy indexing over every unit at once.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvhandoff.layout import ShardSpec

Rows = npt.NDArray[np.uint8]


def axis_positions(shard: ShardSpec, tp_rank: int, tp_size: int) -> npt.NDArray[np.int64]:
    """Global axis positions rank ``tp_rank`` holds, in the rank's local order."""
    offsets = np.cumsum((0, *shard.groups[:-1]))
    return np.concatenate([
        off + r.start + np.arange(r.length, dtype=np.int64)
        for off, r in zip(offsets, shard.ranges(tp_rank, tp_size), strict=True)
    ])


def _view(rows: Rows, outer: int, axis: int, inner: int) -> Rows:
    return rows.reshape(len(rows), outer, axis, inner)


def split(rows: Rows, shard: ShardSpec | None, outer: int, tp_rank: int, tp_size: int) -> Rows:
    """Rank ``tp_rank``'s share of global ``rows`` (``[m, unit_bytes]``)."""
    if shard is None:
        return rows
    axis = sum(shard.groups)
    idx = axis_positions(shard, tp_rank, tp_size)
    # explicit widths, not -1: zero rows (a window of 1 keeps no token) must still reshape
    local = _view(rows, outer, axis, shard.inner_bytes)[:, :, idx, :]
    return local.reshape(len(rows), outer * len(idx) * shard.inner_bytes)


def join(parts: list[Rows], shard: ShardSpec | None, outer: int) -> tuple[Rows, bool]:
    """Reassemble global rows from every rank's share (``parts[r]`` is rank r's).

    Returns the rows and whether every replica agreed: where ranks hold the same bytes
    (replicated tensors, GQA heads past the KV head count), rank order decides which copy
    is used and a disagreement is reported, never hidden."""
    tp = len(parts)
    if shard is None:
        same = all(np.array_equal(parts[0], p) for p in parts[1:])
        return parts[0], same
    axis = sum(shard.groups)
    m = len(parts[0])
    out = np.zeros((m, outer, axis, shard.inner_bytes), dtype=np.uint8)
    seen = np.zeros(axis, dtype=bool)
    same = True
    for r, part in enumerate(parts):
        idx = axis_positions(shard, r, tp)
        local = _view(part, outer, len(idx), shard.inner_bytes)
        fresh = ~seen[idx]
        if (~fresh).any():
            same &= bool(np.array_equal(out[:, :, idx[~fresh], :], local[:, :, ~fresh, :]))
        out[:, :, idx[fresh], :] = local[:, :, fresh, :]
        seen[idx] = True
    return out.reshape(m, outer * axis * shard.inner_bytes), same and bool(seen.all())
