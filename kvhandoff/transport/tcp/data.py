"""Move one frame's payload between numpy memory and a socket, in the factored form.

Sender: a :class:`Sink` writes each chunk either as memoryviews of the source memory
(``sendmsg`` scatter-gather: no copy in Python) when its contiguous runs are large, or
gathers small runs with one numpy gather per batch of units into a reusable bounce
buffer (several chunks share one ``sendall``). Receiver: :func:`scatter` reads each
record straight into destination memoryviews (``recvmsg_into``) when runs are large,
or into a bounce buffer followed by one fancy-indexed numpy assignment per batch.

Pieces of a few segments (a tiny handoff: one page per layer, a Mamba slot) skip numpy
altogether: their addresses are computed with Python integers and they move as
memoryviews, so a whole small frame is one ``sendmsg`` and one ``recvmsg_into``.

Both sides pick the same way from their own geometry; the byte stream is the same.
"""

from __future__ import annotations

import socket

import numpy as np
import numpy.typing as npt

from kvhandoff.memory import piece_view
from kvhandoff.plan.runs import runs
from kvhandoff.transport.framing.cut import Chunk
from kvhandoff.transport.framing.io import recv_exact, recv_views, send_views, slices
from kvhandoff.transport.framing.wire import Records
from kvhandoff.transport.regions import U8, RegionTable
from kvhandoff.transport.views import as_rows, take_into, unit_contiguous

I64 = npt.NDArray[np.int64]

BATCH = 256 << 10
"""Receive batches through the bounce buffer in this many bytes, so the scatter reads
what the socket just wrote while it is still in cache."""

IOV_MIN = 16 << 10
"""Runs at least this long (on average) move as memoryviews; shorter ones are batched
through the bounce buffer, where one numpy call replaces one Python call per run."""


SMALL_SEGS = 16
"""Pieces of at most this many segments (units × rows) are addressed with Python
integers and moved as memoryviews: a few µs instead of a dozen numpy calls. Past that,
one memoryview and one iovec per segment cost more than a numpy gather through the
bounce buffer (64 short segments, as a batched write of 64 tiny requests has per
tensor: the session benchmark's 64-concurrent rate was ~5% higher at 16 than at 64, the
same at 8, and ~2% lower at 32, alternated runs)."""


def small_starts(idx: I64, unit: int, off: int, length: int, count: int, stride: int
                 ) -> tuple[list[int], int] | None:
    """``(segment starts relative to the tensor ptr, segment length)`` of a piece with
    at most :data:`SMALL_SEGS` segments, else None."""
    n = len(idx)
    if unit_contiguous(count, stride, length):
        if n > SMALL_SEGS:
            return None
        return [u * unit + off for u in idx.tolist()], length * count
    if n * count > SMALL_SEGS:
        return None
    rows = [j * stride for j in range(count)]
    return [u * unit + off + r for u in idx.tolist() for r in rows], length


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
    first, merged = runs(starts, step=seg)  # segments that touch end to start merge
    s, n = starts[first], merged * seg
    if len(n) and int(n.sum()) // len(n) >= IOV_MIN:
        return s, n
    return None


class Sink:
    """Writes one connection's frames. Not thread-safe: one per sender thread.

    Bytes are queued in order, as memoryviews of source memory (:meth:`add`, or
    chunks whose runs are long or few) or gathered into the bounce buffer (short
    runs); :meth:`flush` sends everything queued with as few ``sendmsg`` calls as the
    kernel allows. Nothing queued may change before ``flush``."""

    def __init__(self, sock: socket.socket, bounce_bytes: int) -> None:
        self._sock = sock
        self._bounce: U8 = np.empty(bounce_bytes, np.uint8)
        self._mv = self._bounce.data
        self._pos = 0  # bounce bytes used
        self._mark = 0  # bounce bytes already queued as a view
        self._out: list[memoryview] = []

    @property
    def capacity(self) -> int:
        """Bounce buffer bytes: a frame whose payload fits is queued without a flush."""
        return len(self._bounce)

    def add(self, data: bytes | memoryview) -> None:
        """Queue ``data`` (kept by reference until ``flush``)."""
        self._seal()
        self._out.append(memoryview(data))

    def extend(self, views: list[memoryview]) -> None:
        """Queue ``views`` (kept by reference until ``flush``)."""
        self._seal()
        self._out += views

    def _seal(self) -> None:
        if self._pos > self._mark:
            self._out.append(self._mv[self._mark:self._pos])
            self._mark = self._pos

    def take(self) -> list[memoryview]:
        """Everything queued, for the caller to send; the sink starts afresh. The
        views may point into the bounce buffer: send them before using the sink again."""
        self._seal()
        out, self._out = self._out, []
        self._pos = self._mark = 0
        return out

    def flush(self) -> None:
        self._seal()
        if self._out:
            send_views(self._sock, self._out)
        self._out = []
        self._pos = self._mark = 0

    def chunk(self, c: Chunk, table: RegionTable) -> None:
        """Queue chunk ``c``'s bytes, read from the (validated) source ``table``."""
        buf = table.view(c.src_ptr)
        few = small_starts(c.src_idx, c.src_unit, c.src_off, c.length, c.count, c.src_stride)
        if few is not None:
            self._seal()
            mv, n = buf.data, few[1]
            self._out += [mv[s:s + n] for s in few[0]]
            return
        segs = _segments(c.src_idx, c.src_unit, c.src_off, c.length, c.count, c.src_stride)
        if segs is not None:
            self._seal()
            self._out += slices(buf.data, *segs)
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


def receive(sock: socket.socket, table: RegionTable, records: Records, bounce: U8) -> None:
    """Receive a frame's payload into the (validated) destination ``table``: runs of
    small records are received together with one ``recvmsg_into`` (no numpy)."""
    pending: list[memoryview] = []
    for r in range(len(records)):
        rec = records.record(r)
        ptr, unit, off, length, count, stride, idx = rec
        if not len(idx) or not length or not count:
            continue
        few = small_starts(idx, unit, off, length, count, stride)
        if few is not None:
            mv, n = table.view(ptr).data, few[1]
            pending += [mv[s:s + n] for s in few[0]]
            continue
        if pending:
            recv_views(sock, pending)
            pending = []
        scatter(sock, table, rec, bounce)
    if pending:
        recv_views(sock, pending)


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
