"""Strided numpy views of one factored piece, and the in-process copy built on them.

A piece ``(off, length, count, stride)`` of a tensor with units of ``unit`` bytes is
one ``(units, count, length)`` view of the region buffer: ``view[i]`` is unit ``i``'s
bytes of that piece. Fancy indexing with a unit index array selects every unit at
once, so no Python loop runs per page or per head row.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from kvhandoff.memory import piece_view
from kvhandoff.plan.model import TensorPlan
from kvhandoff.plan.runs import runs
from kvhandoff.transport.regions import U8, RegionTable

I64 = npt.NDArray[np.int64]


def unit_contiguous(count: int, stride: int, length: int) -> bool:
    """Whether one unit's bytes of the piece are one contiguous run."""
    return count <= 1 or stride == length


RUN_MIN = 64 << 10
"""Runs at least this long are copied one by one (a single copy each); shorter units
go through a cache-sized temporary in batches (two copies, but both in cache, and one
numpy call per batch instead of one Python call per unit)."""

TMP_BYTES = 512 << 10


def is_range(idx: I64) -> bool:
    """Whether ``idx`` is ``a, a+1, ..., a+n-1`` (n >= 2)."""
    n = len(idx)
    return n >= 2 and int(idx[-1]) - int(idx[0]) == n - 1 and bool((np.diff(idx) == 1).all())


DENSE_MIN = 64
"""Pairs with fewer units are not worth reordering (see :func:`by_source`)."""


def by_source(e: TensorPlan) -> TensorPlan:
    """``e`` with its units in source order, when its source indices are a dense range
    without repeats and its destination indices do not repeat (copy order is then
    irrelevant); else ``e`` itself. The source side of every contiguous slice of
    units is then one contiguous block: :func:`copy_entry` scatters straight from it
    (one copy instead of a gather and a scatter), also after ``split_work`` cut it."""
    s, d = e.src_idx, e.dst_idx
    n = len(s)
    if n < DENSE_MIN:
        return e
    lo, hi = int(s.min()), int(s.max())
    dlo, dhi = int(d.min()), int(d.max())
    if hi - lo + 1 != n or dhi - dlo >= 16 * n:
        return e
    order = np.full(n, -1, np.int64)
    order[s - lo] = np.arange(n)
    if (order < 0).any():
        return e  # a repeated source unit
    seen = np.zeros(dhi - dlo + 1, np.bool_)
    seen[d - dlo] = True
    if int(np.count_nonzero(seen)) != n:
        return e  # a repeated destination unit: keep the plan's order
    return replace(e, src_idx=np.arange(lo, hi + 1, dtype=np.int64), dst_idx=d[order])


def _from_block(e: TensorPlan, s_buf: U8, d_buf: U8, piece: list[int]) -> bool:
    """One copy when the source units are a contiguous range (e.g. after
    :func:`by_source`): one fancy-indexed scatter straight from the source's strided
    view, whatever the piece's shape on either side."""
    if not is_range(e.src_idx):
        return False
    so, do, ln, cnt, ss, ds = piece
    a = int(e.src_idx[0])
    s_view = as_rows(piece_view(s_buf, so, e.src_unit, cnt, ss, ln)[a:a + len(e.src_idx)])
    as_rows(piece_view(d_buf, do, e.dst_unit, cnt, ds, ln))[e.dst_idx] = s_view
    return True


def _direct(e: TensorPlan, s_buf: U8, d_buf: U8, so: int, do: int, b: int) -> bool:
    """One copy for whole contiguous units when the destination units are a contiguous
    block: gather into it with one call."""
    if is_range(e.dst_idx):
        a = int(e.dst_idx[0])
        s_rows = as_rows(piece_view(s_buf, so, e.src_unit, 1, b, b)[:, 0])
        d_rows = as_rows(piece_view(d_buf, do, e.dst_unit, 1, b, b)[a:a + len(e.dst_idx), 0])
        take_into(s_rows, e.src_idx, d_rows)
        return True
    return False


def copy_entry(e: TensorPlan, src: RegionTable, dst: RegionTable) -> int:
    """Copy one tensor pair between two validated tables; returns bytes copied.

    Not atomic and not locked: the caller validated both sides and owns ordering."""
    if not e.nbytes:
        return 0
    s_buf, d_buf = src.view(e.src_ptr), dst.view(e.dst_ptr)
    for so, do, ln, cnt, ss, ds in e.pieces.tolist():
        if not ln or not cnt:
            continue
        b = ln * cnt
        if unit_contiguous(cnt, ss, ln) and unit_contiguous(cnt, ds, ln):
            s_at, d_at = e.src_idx * e.src_unit + so, e.dst_idx * e.dst_unit + do
            first, units = runs(s_at, d_at, step=b)  # units contiguous on both sides merge
            s0, d0, sizes = s_at[first], d_at[first], units * b
            if int(sizes.sum()) >= RUN_MIN * len(sizes):
                for a, c, n in zip(s0.tolist(), d0.tolist(), sizes.tolist(), strict=True):
                    d_buf[c:c + n] = s_buf[a:a + n]
                continue
            if _direct(e, s_buf, d_buf, so, do, b):
                continue
        if _from_block(e, s_buf, d_buf, [so, do, ln, cnt, ss, ds]):
            continue
        s_view = as_rows(piece_view(s_buf, so, e.src_unit, cnt, ss, ln))
        d_view = as_rows(piece_view(d_buf, do, e.dst_unit, cnt, ds, ln))
        if b > TMP_BYTES:  # big strided units: one direct strided copy each
            for si, di in zip(e.src_idx.tolist(), e.dst_idx.tolist(), strict=True):
                d_view[di] = s_view[si]
            continue
        k = max(1, min(TMP_BYTES // b, len(e.src_idx)))  # no bigger than needed
        tmp = np.empty(k * b, np.uint8)
        for a in range(0, len(e.src_idx), k):
            m = min(k, len(e.src_idx) - a)
            t3 = as_rows(tmp[:m * b].reshape(m, cnt, ln))
            take_into(s_view, e.src_idx[a:a + m], t3)
            d_view[e.dst_idx[a:a + m]] = t3
    return e.nbytes


ROW_ITEM_MAX = 2048
"""Rows up to this long are moved as one numpy element each (see :func:`as_rows`)."""


def as_rows(a: np.ndarray) -> np.ndarray:
    """``a`` (``(..., length)`` uint8, last axis contiguous) with each row as one
    ``V<length>`` element, when rows are short: numpy then copies a row per element
    instead of iterating over its bytes, 1.1-1.6× faster for 64 B-1 KiB rows (fancy
    get and set, measured), no better beyond 2 KiB. Longer rows: ``a`` unchanged.
    Both sides of a copy must be viewed alike."""
    length = a.shape[-1]
    if not 0 < length <= ROW_ITEM_MAX:
        return a
    return a.view(np.dtype(f"V{length}"))[..., 0]


def take_into(view: np.ndarray, idx: I64, out: np.ndarray) -> None:
    """``out[k] = view[idx[k]]`` along the first axis of a piece view (as bytes or as
    rows), with no hidden copy of ``view``: ``np.take`` first makes a C-contiguous
    copy of a strided input (the whole tensor, per call), so strided views are
    gathered by fancy indexing in cache-sized batches instead. Indices are validated
    by the caller."""
    if view.flags.c_contiguous:
        # mode="clip" avoids numpy's hidden buffering of `out`
        np.take(view, idx, axis=0, out=out, mode="clip")
        return
    unit_bytes = view.itemsize * int(np.prod(view.shape[1:]))
    per = max(1, TMP_BYTES // max(1, unit_bytes))
    for a in range(0, len(idx), per):
        out[a:a + per] = view[idx[a:a + per]]


def split_work(entries: tuple[TensorPlan, ...], parts: int, min_bytes: int = 1 << 20
               ) -> list[list[TensorPlan]]:
    """Share tensor pairs among ``parts`` workers with about equal bytes each. Pairs of
    at least ``min_bytes`` with several units are cut by units; the rest go whole to the
    least loaded worker. Pure; the parts together move exactly ``entries``."""
    out: list[list[TensorPlan]] = [[] for _ in range(max(1, parts))]
    load = [0] * len(out)
    for e in entries:
        n = len(e.src_idx)
        cuts = min(len(out), n) if e.nbytes >= min_bytes else 1
        bounds = [n * k // cuts for k in range(cuts + 1)]
        for a, z in itertools.pairwise(bounds):
            i = load.index(min(load))
            piece = e if cuts == 1 else replace(e, src_idx=e.src_idx[a:z], dst_idx=e.dst_idx[a:z])
            out[i].append(piece)
            load[i] += piece.nbytes
    return out
