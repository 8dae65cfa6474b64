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
