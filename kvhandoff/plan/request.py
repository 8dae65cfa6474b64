"""What a request asks the planner to move, per component."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

IndexArray = npt.NDArray[np.int64]
_I64 = np.dtype(np.int64)


_FEW = 32  # up to this many indices, Python's min/max beat two numpy reductions


def index_range(a: IndexArray) -> tuple[int, int]:
    """``(min, max)`` of an index array as Python ints, ``(0, 0)`` when it is empty."""
    n = len(a)
    if not n:
        return (0, 0)
    if n == 1:
        v = int(a[0])
        return (v, v)
    if n <= _FEW:
        vals = a.tolist()
        return (min(vals), max(vals))
    return (int(a.min()), int(a.max()))


def as_indices(values: object, what: str) -> IndexArray:
    """A read-only int64 copy/view of ``values`` (never the caller's array, never written)."""
    if type(values) is np.ndarray and values.ndim == 1 and values.dtype == _I64:
        fast: IndexArray = values.copy()  # the common case, without the general checks
        fast.setflags(write=False)
        return fast
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{what}: index list must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what}: index list must hold integers, got dtype {arr.dtype}")
    out = arr.astype(np.int64, copy=True)
    out.flags.writeable = False
    return out


@dataclass(frozen=True, slots=True, init=False)
class Indices:
    """Source and destination index lists of one component for one request (or chunk).

    ``src`` / ``dst``: item indices (pages, slots or rows) on each side, paired
    position by position.
    ``src_first_row`` / ``dst_first_row`` / ``num_rows``: for TOKEN tensors whose
    page sizes differ (or a chunk that starts mid-page on one side, or ends
    mid-page), the token rows to move: row ``i`` of the chunk is row
    ``first_row + i`` of the concatenated pages. ``num_rows`` defaults to what the
    pages hold; when given, exactly that many rows move, whatever the page sizes
    (more than both sides' pages hold is an error, as is ``num_rows`` for a component
    none of whose tensors holds token rows).
    ``positions``: for RING tensors whose ring sizes differ, the logical positions
    whose rows move (row of position ``p`` is ``p % ring``).
    """

    src: IndexArray
    dst: IndexArray
    src_first_row: int
    dst_first_row: int
    num_rows: int | None
    positions: IndexArray | None

    def __init__(
        self,
        src: object,
        dst: object,
        *,
        src_first_row: int = 0,
        dst_first_row: int = 0,
        num_rows: int | None = None,
        positions: object | None = None,
    ) -> None:
        if src_first_row < 0 or dst_first_row < 0 or (num_rows is not None and num_rows < 0):
            raise ValueError(
                f"row offsets and num_rows must be >= 0, got src_first_row={src_first_row}, "
                f"dst_first_row={dst_first_row}, num_rows={num_rows}"
            )
        object.__setattr__(self, "src", as_indices(src, "src"))
        object.__setattr__(self, "dst", as_indices(dst, "dst"))
        object.__setattr__(self, "src_first_row", int(src_first_row))
        object.__setattr__(self, "dst_first_row", int(dst_first_row))
        object.__setattr__(self, "num_rows", None if num_rows is None else int(num_rows))
        pos = None if positions is None else as_indices(positions, "positions")
        object.__setattr__(self, "positions", pos)


Request = Mapping[str, Indices | None]
"""Per component name: its index lists, or ``None`` when it does not move in this
call (e.g. state components on a non-last KV chunk). Every component of the pair
of layouts must be named: a forgotten component is an error, never a silent skip."""
