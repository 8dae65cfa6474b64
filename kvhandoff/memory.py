"""Numpy views of raw memory: the one place kvhandoff turns an address into bytes and a
factored piece into a strided view. Numpy and ctypes only; the planner's reference
executor, the transports and the session all read memory through these.

* :func:`raw_view`: the bytes at an address, as a writable uint8 array (the caller keeps
  the memory alive: a Layout's owner, a transport's registration);
* :func:`piece_view`: a piece ``(off, length, count, stride)`` of a tensor whose units are
  ``unit`` bytes, as one ``(units, count, length)`` view of the tensor's buffer, so that
  ``view[idx]`` selects every listed unit's bytes of that piece at once — no Python loop
  per page or per head row.
"""

from __future__ import annotations

import ctypes

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import as_strided

U8 = npt.NDArray[np.uint8]


def raw_view(ptr: int, nbytes: int) -> U8:
    """A writable uint8 view of ``nbytes`` host bytes at ``ptr``; empty for ``nbytes <= 0``."""
    if nbytes <= 0:
        return np.zeros(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(ptr))


def piece_view(buf: U8, off: int, unit: int, count: int, stride: int, length: int, *,
               writeable: bool = True) -> U8:
    """``(units, count, length)`` view of ``buf`` (which starts at the tensor's first
    byte): row ``i`` is unit ``i``'s ``count`` runs of ``length`` bytes, ``stride`` apart,
    starting ``off`` bytes into the unit.

    ``units`` is however many whole units fit; callers validate their indices first.
    A zero ``unit`` (one unit addressed repeatedly) yields a single-unit view."""
    span = (count - 1) * stride + length if count else 0
    if len(buf) < off + span:
        units = 0
    elif unit == 0:
        units = 1
    else:
        units = (len(buf) - off - span) // unit + 1
    return as_strided(buf[off:], shape=(units, count, length), strides=(unit, stride, 1),
                      writeable=writeable)
