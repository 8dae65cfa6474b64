"""Small plans with Python integers: the latency path of a tiny handoff.

A tiny handoff (a KV page per layer, a Mamba slot, an aux row: a few dozen segments)
is bound by per-call overhead, not bytes: the general paths spend a dozen numpy calls
per piece (about 1 µs each). Plans of at most :data:`MAX_SEGMENTS` contiguous runs
and :data:`MAX_BYTES` bytes are instead checked and addressed with Python integers in
one pass, as memoryviews in payload order (pair by pair, piece by piece, unit-major,
then row): the tcp frame (:mod:`tcp_small`), the shm copy and every transport's
source check use them.
"""

from __future__ import annotations

from kvhandoff.plan.model import Plan
from kvhandoff.transport.regions import RegionTable

MAX_SEGMENTS = 128
"""Plans (and received frames) of at most this many contiguous runs are small."""

MAX_BYTES = 256 << 10
"""... and of at most this many bytes (one tcp frame, written without blocking)."""


def plan_views(plan: Plan, table: RegionTable, side: str, max_bytes: int = MAX_BYTES,
               *, make: bool = True) -> list[memoryview] | str | None:
    """Views of every ``side`` ("src" or "dst") byte of a small ``plan`` in ``table``,
    in payload order (pair by pair, piece by piece, unit-major, then row); a sentence
    naming the first piece that lies outside ``table`` (no view was made); None if
    the plan is not small or moves nothing. ``make=False``: check only (returns [])."""
    src = side == "src"
    todo: list[tuple[tuple[memoryview, int], int, int, list[int], int, int, int]] = []
    segments = nbytes = 0
    for e in plan.entries:
        idx = e.src_idx if src else e.dst_idx
        n = len(idx)
        if not n:
            continue
        if n > MAX_SEGMENTS:
            return None
        units = idx.tolist()
        lo_i, hi_i = min(units), max(units)
        ptr, unit = (e.src_ptr, e.src_unit) if src else (e.dst_ptr, e.dst_unit)
        for so, do, ln, cnt, ss, ds in e.pieces.tolist():
            if not ln or not cnt:
                continue
            off, stride = (so, ss) if src else (do, ds)
            segments += n if (cnt == 1 or stride == ln) else n * cnt
            nbytes += n * ln * cnt
            if segments > MAX_SEGMENTS or nbytes > max_bytes:
                return None
            if min(lo_i, unit, off, ln, cnt, stride) < 0:
                raise ValueError(f"negative field in a piece of component {e.component!r} "
                                 f"tensor {e.tensor!r}: {(so, do, ln, cnt, ss, ds)}, unit "
                                 f"{unit}, indices from {lo_i}")
            hi = ptr + hi_i * unit + off + (cnt - 1) * stride + ln
            got = table.span_view(ptr, hi)
            if got is None:
                return (f"{'source' if src else 'destination'} bytes "
                        f"[{ptr + lo_i * unit + off:#x}, {hi:#x}) of component "
                        f"{e.component!r} tensor {e.tensor!r} (layer {e.layer_id}) lie "
                        f"outside the registered memory")
            todo.append((got, ptr + off, unit, units, ln, cnt, stride))
    if not nbytes:
        return None
    views: list[memoryview] = []
    if not make:
        return views
    for args in todo:  # every piece passed the check: only now make (writable) views
        views += unit_views(*args)
    return views


def copy_views(dst: list[memoryview], src: list[memoryview]) -> None:
    """Copy the byte stream ``src`` into ``dst`` (the same total length, cut
    differently: one side's rows may be the other's whole units)."""
    i = j = a = b = 0
    while i < len(dst) and j < len(src):
        d, s = dst[i], src[j]
        n = min(len(d) - a, len(s) - b)
        d[a:a + n] = s[b:b + n]
        a += n
        b += n
        if a == len(d):
            i, a = i + 1, 0
        if b == len(s):
            j, b = j + 1, 0


def unit_views(where: tuple[memoryview, int], start: int, unit: int, units: list[int], ln: int,
           cnt: int, stride: int) -> list[memoryview]:
    """Views of ``start + u*unit + j*stride + [0, ln)`` for u in ``units``, j < cnt
    (merged per unit when its rows touch), in payload order."""
    mv, off = where
    base = start + off
    if cnt == 1 or stride == ln:
        size = ln * cnt
        return [mv[a:a + size] for a in [base + u * unit for u in units]]
    rows = [base + j * stride for j in range(cnt)]
    return [mv[a:a + ln] for a in [u * unit + r for u in units for r in rows]]
