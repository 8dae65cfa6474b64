"""Runs: neighbours that continue each other on every side, found with one ``np.diff``.

The one run-coalescer of the package. The plan merges segments and unit indices with it
(:meth:`Segments.coalesce`, :meth:`TensorPlan.runs`), the in-process copy and the tcp data
plane merge piece starts with it, and the vLLM host staging merges block ids with it.

Element ``i`` continues element ``i - 1``'s run when, on every side ``a``,
``a[i] == a[i - 1] + step[i - 1]`` (``step`` one number for all, or one per element:
a segment's length). Pure numpy, no loops.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]


def run_starts(*sides: I64, step: int | I64 = 1) -> I64:
    """The positions where runs begin (position 0 first; empty for empty sides).

    Every side has the same length; so has ``step`` when it is an array."""
    n = len(sides[0])
    if n < 2:
        return np.zeros(n, np.int64)
    gap = step[:-1] if isinstance(step, np.ndarray) else step
    breaks = sides[0][1:] != sides[0][:-1] + gap
    for a in sides[1:]:
        breaks |= a[1:] != a[:-1] + gap
    return np.concatenate(([0], np.flatnonzero(breaks) + 1)).astype(np.int64, copy=False)


def runs(*sides: I64, step: int | I64 = 1) -> tuple[I64, I64]:
    """``(first, count)``: where each run begins (see :func:`run_starts`) and how many
    elements it holds. For equal steps, run ``k`` covers ``count[k] * step`` from
    ``side[first[k]]`` on every side."""
    first = run_starts(*sides, step=step)
    count = np.diff(np.append(first, len(sides[0]))).astype(np.int64, copy=False)
    return first, count
