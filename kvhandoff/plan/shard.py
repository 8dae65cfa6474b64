"""TP intersection: which bytes of one source unit land where in one destination unit.

A *unit* is what one index addresses after row expansion: a whole item, or one
row of it. The result is a few strided **pieces** ``(src_off, dst_off, length,
count, src_stride, dst_stride)``: piece bytes ``[off + j*stride, +length)`` for
``j < count``. A head slice of a 64-token page is one piece with count 64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvhandoff.layout import ShardSpec

PIECE_FIELDS = ("src_off", "dst_off", "length", "count", "src_stride", "dst_stride")
NO_PIECES = np.zeros((0, 6), dtype=np.int64)
NO_PIECES.flags.writeable = False


@dataclass(frozen=True, slots=True)
class Side:
    """One side of a tensor pair as the shard math needs it."""

    unit_bytes: int  # bytes one index addresses (item or row)
    shard: ShardSpec | None
    outer: int  # outer rows inside one unit (shard.outer / rows)
    tp_rank: int
    tp_size: int


def elect(replicas: int, replica: int, dst: Side, src_tp_size: int) -> bool:
    """Exactly one of ``replicas`` identical sources writes for a destination rank.

    The writer is the replica of the first source rank in the destination rank's
    own TP window (``dst_rank * src_tp // dst_tp``): a decode rank then reads
    replicated bytes from a prefill rank it already reads sharded bytes from (no
    extra peer just for an aux row), equal-TP pairs keep the identity mapping, and
    destination ranks spread their reads over the replicas.
    """
    return replica == (dst.tp_rank * src_tp_size // dst.tp_size) % replicas


def pieces(src: Side, dst: Side) -> np.ndarray:
    """The strided pieces moving ``src``'s share of a unit into ``dst``'s share.

    Returns an ``(n, 6)`` int64 array, possibly empty (this source holds nothing
    the destination needs, or another replica was elected). Both sides must
    describe the same global geometry (checked at pairing time).
    """
    if src.shard is None or dst.shard is None:
        if not elect(src.tp_size, src.tp_rank, dst, src.tp_size):
            return NO_PIECES
        n = src.unit_bytes
        return _frozen([[0, 0, n, 1, n, n]])
    inner = src.shard.inner_bytes
    s_ranges = src.shard.ranges(src.tp_rank, src.tp_size)
    d_ranges = dst.shard.ranges(dst.tp_rank, dst.tp_size)
    s_row = sum(r.length for r in s_ranges) * inner
    d_row = sum(r.length for r in d_ranges) * inner
    rows: list[list[int]] = []
    s_base = d_base = 0
    for s, d in zip(s_ranges, d_ranges, strict=True):
        lo, hi = max(s.start, d.start), min(s.start + s.length, d.start + d.length)
        if lo < hi and elect(s.replicas, s.replica, dst, src.tp_size):
            rows.append([
                s_base + (lo - s.start) * inner, d_base + (lo - d.start) * inner,
                (hi - lo) * inner, src.outer, s_row, d_row,
            ])
        s_base += s.length * inner
        d_base += d.length * inner
    return _frozen(_merge(rows, s_row, d_row))


def _merge(rows: list[list[int]], s_row: int, d_row: int) -> list[list[int]]:
    """Merge pieces adjacent on both sides; a piece that is every byte of a row on
    both sides, repeated over contiguous rows, becomes one plain block."""
    merged: list[list[int]] = []
    for p in rows:
        if merged:
            q = merged[-1]
            if q[0] + q[2] == p[0] and q[1] + q[2] == p[1] and q[3:] == p[3:]:
                q[2] += p[2]
                continue
        merged.append(list(p))
    if len(merged) == 1:
        so, do, ln, cnt, ss, ds = merged[0]
        if so == 0 and do == 0 and ln == s_row == d_row and ss == ds == ln:
            merged = [[0, 0, ln * cnt, 1, ln * cnt, ln * cnt]]
    return merged


def _frozen(rows: list[list[int]]) -> np.ndarray:
    if not rows:
        return NO_PIECES
    arr = np.array(rows, dtype=np.int64).reshape(-1, 6)
    arr.flags.writeable = False
    return arr
