"""Cut a Plan into frames of bounded size, keeping the factored form. Pure numpy.

A :class:`Chunk` is one piece of one tensor pair applied to a slice of its units, with
both sides' geometry. Frames hold chunks totalling at most ``budget`` payload bytes
(a unit larger than the budget is cut into row groups, or a row into byte ranges), so
a frame never needs more than a bounded amount of anything on either side.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvhandoff.plan.model import Plan
from kvhandoff.transport.framing.wire import Records

I64 = npt.NDArray[np.int64]


class Chunk:
    """Bytes ``ptr + idx[u]*unit + off + j*stride + [0, length)`` on each side.
    Immutable by convention. (A slotted class: built once per chunk on the submit
    path, 5x cheaper than a frozen dataclass.)"""

    __slots__ = ("count", "dst_idx", "dst_off", "dst_ptr", "dst_stride", "dst_unit", "length",
                 "src_idx", "src_off", "src_ptr", "src_stride", "src_unit")

    def __init__(self, src_ptr: int, src_unit: int, src_off: int, src_stride: int,
                 dst_ptr: int, dst_unit: int, dst_off: int, dst_stride: int, length: int,
                 count: int, src_idx: I64, dst_idx: I64) -> None:
        self.src_ptr, self.src_unit, self.src_off, self.src_stride = (
            src_ptr, src_unit, src_off, src_stride)
        self.dst_ptr, self.dst_unit, self.dst_off, self.dst_stride = (
            dst_ptr, dst_unit, dst_off, dst_stride)
        self.length, self.count, self.src_idx, self.dst_idx = length, count, src_idx, dst_idx

    @property
    def unit_bytes(self) -> int:
        return self.length * self.count

    @property
    def nbytes(self) -> int:
        return len(self.src_idx) * self.unit_bytes


def _subpieces(so: int, do: int, ln: int, cnt: int, ss: int, ds: int, budget: int
               ) -> list[tuple[int, int, int, int]]:
    """``(src_off, dst_off, length, count)`` parts of one unit's piece, each ≤ budget."""
    if ln * cnt <= budget:
        return [(so, do, ln, cnt)]
    if ln <= budget:
        rows = budget // ln
        return [(so + c * ss, do + c * ds, ln, min(rows, cnt - c)) for c in range(0, cnt, rows)]
    return [(so + c * ss + b, do + c * ds + b, min(budget, ln - b), 1)
            for c in range(cnt) for b in range(0, ln, budget)]


def split(plan: Plan, budget: int) -> list[list[Chunk]]:
    """Frames of chunks, in plan order, each totalling at most ``budget`` bytes.

    Loops run per tensor pair and piece, and per frame; never per page."""
    if budget < 1:
        raise ValueError(f"frame budget must be >= 1 byte, got {budget}")
    frames: list[list[Chunk]] = []
    cur: list[Chunk] = []
    used = 0
    for e in plan.entries:
        n = len(e.src_idx)
        for so, do, ln, cnt, ss, ds in e.pieces.tolist():
            if not n or not ln or not cnt:
                continue
            parts = _subpieces(so, do, ln, cnt, ss, ds, budget)
            # a unit that fits moves with its neighbours; a bigger one part by part
            groups = ([(0, n, parts[0])] if len(parts) == 1
                      else [(u, u + 1, p) for u in range(n) for p in parts])
            for lo, hi, (pso, pdo, pln, pcnt) in groups:
                b = pln * pcnt
                u = lo
                while u < hi:
                    if used and used + b > budget:
                        frames.append(cur)
                        cur, used = [], 0
                    k = min(hi - u, max(1, (budget - used) // b))
                    whole = k == n
                    cur.append(Chunk(e.src_ptr, e.src_unit, pso, ss, e.dst_ptr, e.dst_unit,
                                     pdo, ds, pln, pcnt,
                                     e.src_idx if whole else e.src_idx[u:u + k],
                                     e.dst_idx if whole else e.dst_idx[u:u + k]))
                    used += k * b
                    u += k
    if cur:
        frames.append(cur)
    return frames


def dst_records(chunks: list[Chunk]) -> Records:
    """The destination side of a frame's chunks, for the wire."""
    return Records.build(
        [(c.dst_ptr, c.dst_unit, c.dst_off, c.length, c.count, c.dst_stride) for c in chunks],
        [c.dst_idx for c in chunks],
    )


def plan_records(plan: Plan) -> Records:
    """The destination side of a whole plan, one record per tensor pair and piece (what
    a receiver validates before any frame of a multi-frame write is written)."""
    rows: list[tuple[int, int, int, int, int, int]] = []
    idxs: list[I64] = []
    for e in plan.entries:
        for _so, do, ln, cnt, _ss, ds in e.pieces.tolist():
            rows.append((e.dst_ptr, e.dst_unit, do, ln, cnt, ds))
            idxs.append(e.dst_idx)
    return Records.build(rows, idxs)
