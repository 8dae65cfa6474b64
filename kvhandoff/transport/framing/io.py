"""Blocking socket helpers that move bytes straight between the socket and numpy memory.

Every helper loops until done, raises ``EOFError`` when the peer closed the stream,
and lets ``OSError`` / ``TimeoutError`` (from the socket's own timeout) propagate:
the caller maps them to PeerLost. Loops are bounded by the byte count, since every
iteration moves at least one byte or raises.
"""

from __future__ import annotations

import os
import socket

import numpy as np
import numpy.typing as npt

IOV_BATCH = 512  # below IOV_MAX (1024) on Linux

I64 = npt.NDArray[np.int64]


def recv_exact(sock: socket.socket, buf: memoryview) -> None:
    """Fill ``buf`` completely."""
    while len(buf):
        n = sock.recv_into(buf)
        if n == 0:
            raise EOFError("peer closed the connection")
        buf = buf[n:]


def recv_header(sock: socket.socket, buf: memoryview, idle_ok: bool) -> bool:
    """Fill ``buf`` (a header). Returns False if the socket timed out before its first
    byte and ``idle_ok`` (an idle connection, not an error); raises otherwise."""
    got = 0
    while got < len(buf):
        try:
            n = sock.recv_into(buf[got:])
        except TimeoutError:
            if got == 0 and idle_ok:
                return False
            raise
        if n == 0:
            raise EOFError("peer closed the connection")
        got += n
    return True


class FrameReader:
    """Reads one socket's frames with one ``recv_into`` per frame once the frame has
    arrived whole (a header read alone would cost a second syscall for its
    descriptors). Inside an engine every syscall hands the GIL away and waits to get it
    back from the engine's busy thread, so a syscall saved is a hand-over saved.

    Bytes past the current frame stay buffered for the next one: only one thread reads
    the socket, and only through this reader. Buffers at most ``capacity`` bytes; a
    longer frame part is read straight into its own buffer."""

    def __init__(self, sock: socket.socket, capacity: int = 64 << 10) -> None:
        self.sock = sock
        self._buf = bytearray(capacity)
        self._start = self._end = 0

    @property
    def buffered(self) -> int:
        """Bytes read from the socket and not yet taken."""
        return self._end - self._start

    def header(self, size: int, idle_ok: bool) -> memoryview | None:
        """The next ``size`` bytes (a header; valid until the next call). None if the
        socket timed out before any byte of it and ``idle_ok``; raises otherwise."""
        self._fill(size, idle_ok)
        return self._take(size) if self.buffered >= size else None

    def exact(self, n: int) -> bytearray:
        """The next ``n`` bytes, in a buffer of their own."""
        if n <= len(self._buf):
            self._fill(n, idle_ok=False)
            return bytearray(self._take(n))
        out = bytearray(n)
        have = self.buffered
        out[:have] = self._take(have)
        recv_exact(self.sock, memoryview(out)[have:])
        return out

    def _take(self, n: int) -> memoryview:
        view = memoryview(self._buf)[self._start:self._start + n]
        self._start += n
        return view

    def _fill(self, size: int, idle_ok: bool) -> None:
        """Read until ``size`` bytes (at most the capacity) are buffered, as many as the
        socket has per call; nothing when they are. Returns short only for an idle
        timeout with nothing buffered and ``idle_ok``."""
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buf) - self._start < size:  # move the rest to the front
            rest = self.buffered
            self._buf[:rest] = self._buf[self._start:self._end]
            self._start, self._end = 0, rest
        view = memoryview(self._buf)
        while self.buffered < size:
            try:
                n = self.sock.recv_into(view[self._end:])
            except TimeoutError:
                if self.buffered == 0 and idle_ok:
                    return
                raise
            if n == 0:
                raise EOFError("peer closed the connection")
            self._end += n


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Send every view, in order, with as few ``sendmsg`` calls as the kernel allows."""
    i = 0
    views = [v for v in views if len(v)]
    while i < len(views):
        i = _advance(views, i, sock.sendmsg(views[i:i + IOV_BATCH]))


def write_some(sock: socket.socket, views: list[memoryview]) -> list[memoryview]:
    """Write as much of ``views`` as the kernel takes now, without blocking; returns
    what is left (empty when all was written). Needs the socket in timeout mode
    (Python keeps its descriptor non-blocking then); ``os.writev`` skips the
    readiness poll a timeout-mode ``sendmsg`` makes first."""
    assert sock.gettimeout() is not None, "write_some needs a socket with a timeout"
    fd, i = sock.fileno(), 0
    views = [v for v in views if len(v)]
    while i < len(views):
        try:
            n = os.writev(fd, views[i:i + IOV_BATCH])
        except BlockingIOError:
            break
        i = _advance(views, i, n)
    return views[i:]


def recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view, in order (scatter receive with ``recvmsg_into``)."""
    i = 0
    views = [v for v in views if len(v)]
    while i < len(views):
        if len(views) - i == 1:
            recv_exact(sock, views[i])
            return
        n = sock.recvmsg_into(views[i:i + IOV_BATCH])[0]
        if n == 0:
            raise EOFError("peer closed the connection")
        i = _advance(views, i, n)


def _advance(views: list[memoryview], i: int, n: int) -> int:
    """Account for ``n`` bytes moved from ``views[i:]``: returns the first view not
    finished, trimming a partly moved one in place."""
    while n and i < len(views):
        size = len(views[i])
        if n >= size:
            n -= size
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i


def drain(sock: socket.socket, nbytes: int, scratch: memoryview) -> None:
    """Read and discard ``nbytes`` (the payload of a refused write)."""
    while nbytes > 0:
        part = scratch[:min(nbytes, len(scratch))]
        recv_exact(sock, part)
        nbytes -= len(part)


def slices(mv: memoryview, starts: I64, sizes: I64) -> list[memoryview]:
    """Memoryviews ``mv[s:s+n]`` for every run."""
    return [mv[s:s + n] for s, n in zip(starts.tolist(), sizes.tolist(), strict=True)]
