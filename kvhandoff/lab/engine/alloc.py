"""Free-list allocators for pages and request slots.

A :class:`FreeList` hands out ids ``1 .. capacity-1`` (id 0 is the padding page or
slot every pool keeps, as in sglang) from a shuffled stack, so consecutive requests get
scattered, non-contiguous ids and the index lists the planner sees look like a busy
server's. Allocation and release are vectorised; a double free or a foreign id raises
:class:`AllocatorError` instead of corrupting the free list.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

IdArray = npt.NDArray[np.int64]


class AllocatorError(RuntimeError):
    """A pool ran out of ids, or ids were released that were not allocated."""


class FreeList:
    """Ids ``1 .. capacity-1`` of one pool; id 0 is reserved and never handed out.

    Not thread-safe: one scheduler owns each instance's allocators.
    """

    def __init__(self, name: str, capacity: int, *, seed: int = 0) -> None:
        if capacity < 2:
            raise AllocatorError(f"{name}: capacity {capacity} leaves no id besides padding 0")
        self.name = name
        self.capacity = capacity
        rng = np.random.default_rng(seed)
        self._stack: IdArray = rng.permutation(np.arange(1, capacity, dtype=np.int64))
        self._top = len(self._stack)  # ids _stack[:_top] are free
        self._used = np.zeros(capacity, dtype=bool)

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.capacity - 1 - self._top

    def alloc(self, n: int) -> IdArray:
        """``n`` free ids (a new array); raises AllocatorError when fewer are free."""
        if n < 0 or n > self._top:
            raise AllocatorError(f"{self.name}: asked for {n} ids, {self._top} free "
                                 f"of {self.capacity - 1}")
        ids = self._stack[self._top - n:self._top][::-1].copy()
        self._top -= n
        self._used[ids] = True
        return ids

    def free(self, ids: npt.ArrayLike) -> None:
        """Return ``ids`` to the pool; every id must be allocated and listed once."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not len(arr):
            return
        bad = (arr < 1) | (arr >= self.capacity)
        if bad.any() or not self._used[arr].all() or len(np.unique(arr)) != len(arr):
            raise AllocatorError(f"{self.name}: freeing ids that are not allocated (or "
                                 f"twice): {arr[:8].tolist()}")
        self._used[arr] = False
        self._stack[self._top:self._top + len(arr)] = arr
        self._top += len(arr)
