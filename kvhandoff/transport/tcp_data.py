"""Move one frame's payload between numpy memory and a socket, in the factored form.

Sender: a :class:`Sink` writes each chunk either as memoryviews of the source memory
(``sendmsg`` scatter-gather: no copy in Python) when its contiguous runs are large, or
gathers small runs with one numpy gather per batch of units into a reusable bounce
buffer (several chunks share one ``sendall``). Receiver: :func:`scatter` reads each
record straight into destination memoryviews (``recvmsg_into``) when runs are large,
or into a bounce buffer followed by one fancy-indexed numpy assignment per batch.

Both sides pick the same way from their own geometry; the byte stream is the same.
"""

from __future__ import annotations

import socket

import numpy as np
import numpy.typing as npt

from kvhandoff.transport.regions import U8, RegionTable
from kvhandoff.transport.tcp_io import recv_exact, recv_views, runs, send_views, slices
from kvhandoff.transport.tcp_plan import Chunk
from kvhandoff.transport.views import as_rows, piece_view, take_into, unit_contiguous

I64 = npt.NDArray[np.int64]

BATCH = 256 << 10
"""Receive batches through the bounce buffer in this many bytes, so the scatter reads
what the socket just wrote while it is still in cache."""

IOV_MIN = 16 << 10
"""Runs at least this long (on average) move as memoryviews; shorter ones are batched
through the bounce buffer, where one numpy call replaces one Python call per run."""


def _segments(idx: I64, unit: int, off: int, length: int, count: int, stride: int
              ) -> tuple[I64, I64] | None:
    """Contiguous runs (starts relative to the tensor ptr, sizes) if they are long enough
    to move as memoryviews, else None (use the bounce buffer)."""
    if unit_contiguous(count, stride, length):
        starts = idx * unit + off
        seg = length * count
    elif length >= IOV_MIN:
        starts = ((idx * unit + off)[:, None] + np.arange(count) * stride).ravel()
        seg = length
    else:
        return None
    s, n = runs(starts, seg)
    if len(n) and int(n.sum()) // len(n) >= IOV_MIN:
        return s, n
    return None


class Sink:
    """Writes payload for one connection. Not thread-safe: one per sender thread."""

    def __init__(self, sock: socket.socket, bounce_bytes: int) -> None:
        self._sock = sock
        self._bounce: U8 = np.empty(bounce_bytes, np.uint8)
        self._mv = self._bounce.data
        self._pos = 0

    def flush(self) -> None:
        if self._pos:
            self._sock.sendall(self._mv[:self._pos])
            self._pos = 0

    def chunk(self, c: Chunk, table: RegionTable) -> None:
        """Send chunk ``c``'s bytes, read from the (validated) source ``table``."""
        buf = table.view(c.src_ptr)
        segs = _segments(c.src_idx, c.src_unit, c.src_off, c.length, c.count, c.src_stride)
        if segs is not None:
            self.flush()
            send_views(self._sock, slices(buf.data, *segs))
            return
        view = piece_view(buf, c.src_off, c.src_unit, c.count, c.src_stride, c.length)
        b = c.unit_bytes
        cap = len(self._bounce)
        if b > cap:  # a long strided unit of short rows: gather row groups of one unit
            rows = cap // c.length
            for u in c.src_idx.tolist():
                for r in range(0, c.count, rows):
                    part = view[u, r:r + rows]
                    self.flush()
                    out = self._bounce[:part.size].reshape(part.shape)
                    np.copyto(out, part)
                    self._pos = part.size
            return
        a, n = 0, len(c.src_idx)
        while a < n:
            k = min(n - a, (cap - self._pos) // b)
            if k == 0:
                self.flush()
                continue
            dest = self._bounce[self._pos:self._pos + k * b].reshape(k, c.count, c.length)
            take_into(as_rows(view), c.src_idx[a:a + k], as_rows(dest))
            self._pos += k * b
            a += k


def scatter(sock: socket.socket, table: RegionTable, rec: tuple[int, int, int, int, int, int, I64],
            bounce: U8) -> None:
    """Receive one record's bytes into the (validated) destination ``table``."""
    ptr, unit, off, length, count, stride, idx = rec
    if not len(idx) or not length or not count:
        return
    buf = table.view(ptr)
    segs = _segments(idx, unit, off, length, count, stride)
    if segs is not None:
        recv_views(sock, slices(buf.data, *segs))
        return
    view = piece_view(buf, off, unit, count, stride, length)
    mv = bounce.data
    b = length * count
    cap = len(bounce)
    if b > cap:
        rows = cap // length
        for u in idx.tolist():
            for r in range(0, count, rows):
                k = min(rows, count - r)
                recv_exact(sock, mv[:k * length])
                as_rows(view[u, r:r + k])[...] = as_rows(bounce[:k * length].reshape(k, length))
        return
    per = max(1, min(cap, BATCH) // b)  # batches that stay in cache for the scatter
    for a in range(0, len(idx), per):
        k = min(per, len(idx) - a)
        recv_exact(sock, mv[:k * b])
        as_rows(view)[idx[a:a + k]] = as_rows(bounce[:k * b].reshape(k, count, length))
