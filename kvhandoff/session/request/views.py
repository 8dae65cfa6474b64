"""Numpy views of a layout's host tensors, for the few bytes the session itself reads or
writes (aux guards, checksums). The bulk data never passes through here: transports
move it."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvhandoff.layout import Layout, MemoryKind, TensorSpec
from kvhandoff.memory import raw_view

U8 = npt.NDArray[np.uint8]


class TensorViews:
    """Views of every host tensor of a layout, found by the tensor's ``ptr``.

    Thread-safe after construction (read-only dict). Tensors in device memory have no
    view: :meth:`get` returns None for them, and callers skip what they cannot read."""

    def __init__(self, layout: Layout) -> None:
        self._by_ptr: dict[int, U8] = {}
        for c in layout.components:
            for t in c.tensors:
                if t.nbytes and t.memory is MemoryKind.HOST:
                    self._by_ptr[t.ptr] = raw_view(t.ptr, t.nbytes)

    def get(self, ptr: int) -> U8 | None:
        return self._by_ptr.get(ptr)

    def tensor(self, t: TensorSpec) -> U8 | None:
        return self._by_ptr.get(t.ptr) if t.nbytes else None

    def row(self, t: TensorSpec, index: int) -> U8 | None:
        """Item ``index`` of tensor ``t`` (None if not host memory or out of range)."""
        buf = self.tensor(t)
        if buf is None or not 0 <= index < t.capacity:
            return None
        start = index * t.item_stride
        return buf[start:start + t.item_bytes]
