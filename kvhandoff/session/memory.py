"""Numpy views of a layout's host tensors, for the few bytes the session itself reads or
writes (aux guards, checksums). The bulk data never passes through here: transports
move it."""

from __future__ import annotations

import ctypes

import numpy as np
import numpy.typing as npt

from kvhandoff.layout import Layout, MemoryKind, TensorSpec

U8 = npt.NDArray[np.uint8]


def host_view(ptr: int, nbytes: int) -> U8:
    """A writable uint8 view of ``nbytes`` host bytes at ``ptr``. The caller keeps the
    memory alive (a Layout's owner does, for as long as the agent runs)."""
    if nbytes <= 0:
        return np.zeros(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(ptr))


class TensorViews:
    """Views of every host tensor of a layout, found by the tensor's ``ptr``.

    Thread-safe after construction (read-only dict). Tensors in device memory have no
    view: :meth:`get` returns None for them, and callers skip what they cannot read."""

    def __init__(self, layout: Layout) -> None:
        self._by_ptr: dict[int, U8] = {}
        for c in layout.components:
            for t in c.tensors:
                if t.nbytes and t.memory is MemoryKind.HOST:
                    self._by_ptr[t.ptr] = host_view(t.ptr, t.nbytes)

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
