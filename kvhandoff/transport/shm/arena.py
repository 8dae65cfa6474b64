"""Shared-memory arenas: memfd-backed mappings that another process on this host maps.

An :class:`Arenas` hands out page-aligned buffers carved from a few large ``memfd``
files (tmpfs pages appear on first touch, so a big arena costs nothing until used).
A peer receives the arena file descriptors over a Unix socket (``SCM_RIGHTS``) and maps
them; nothing is named in ``/dev/shm``, so nothing leaks if a process dies: the memory
goes away with the last mapping.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np

from kvhandoff.transport.regions import U8

ARENA_BYTES = 256 << 20  # virtual size of an arena; pages are allocated on first touch
_ALIGN = 4096


@dataclass(frozen=True, slots=True)
class Allocation:
    """One buffer: its address here, its size, where it lives in which arena."""

    ptr: int
    nbytes: int
    arena: int
    offset: int


def map_fd(fd: int, nbytes: int) -> U8:
    """Map ``nbytes`` of a memfd read-write and shared; the fd may be closed afterwards."""
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return np.frombuffer(mm, dtype=np.uint8)


class Arenas:
    """Thread-safe bump allocator over memfd arenas. ``close`` closes the fds; buffers
    already handed out stay valid (their mappings live as long as the arrays)."""

    def __init__(self, tag: str) -> None:
        self._tag = tag
        self._lock = threading.Lock()
        self.fds: list[int] = []
        self.sizes: list[int] = []
        self._maps: list[U8] = []
        self._used: list[int] = []
        self.allocations: list[Allocation] = []

    def allocate(self, nbytes: int) -> U8:
        """A zeroed, page-aligned uint8 buffer of ``nbytes`` in shared memory."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        need = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        with self._lock:
            i = next((k for k in range(len(self.fds)) if self.sizes[k] - self._used[k] >= need),
                     -1)
            if i < 0:
                i = self._new_arena(max(ARENA_BYTES, need))
            off = self._used[i]
            self._used[i] += need
            buf = self._maps[i][off:off + nbytes]
            if nbytes:
                self.allocations.append(Allocation(int(buf.ctypes.data), nbytes, i, off))
        return buf

    def _new_arena(self, nbytes: int) -> int:
        fd = os.memfd_create(f"kvhandoff-{self._tag}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            self._maps.append(map_fd(fd, nbytes))
        except BaseException:
            os.close(fd)
            raise
        self.fds.append(fd)
        self.sizes.append(nbytes)
        self._used.append(0)
        return len(self.fds) - 1

    def snapshot(self) -> tuple[list[int], list[int], list[Allocation]]:
        """(fds, arena sizes, allocations) as of now, for a peer handshake."""
        with self._lock:
            return list(self.fds), list(self.sizes), list(self.allocations)

    def close(self) -> None:
        with self._lock:
            for fd in self.fds:
                os.close(fd)
            self.fds = []
            self._maps = []
