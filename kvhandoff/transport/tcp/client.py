"""The sending side of the tcp transport: one :class:`TcpPeer` per connected endpoint.

A peer holds ``connections`` sockets; each has a sender thread (blocks on its queue)
and a reader thread (blocks on the socket for replies), so an idle peer uses no CPU.
Each socket is authenticated both ways before it is used
(:func:`~kvhandoff.transport.framing.served.prove`): nothing is written to a port that does not
prove the endpoint's key.

A submit becomes frames of at most ``frame_bytes`` (see tcp_plan). When there is more
than one frame, a CHECK frame carrying the plan's whole destination side goes first
and the data frames are queued only once the receiver accepted it, so a refused write
writes nothing. Frames go round-robin over the connections; the handle is DONE when
every frame was acknowledged.

Latency: a small plan (a tiny handoff, see tcp_small) is one frame, written by the
submitting thread itself when its connection is idle, without blocking (``os.writev``
on the socket's non-blocking descriptor); bytes the kernel does not take at once stay
in the connection's backlog, which its sender thread writes before anything else.
That saves a thread hand-off (tens of µs on a loaded VM) per small submit.

Notices: a notice rides in the flags and description of a plan's only frame; a plan of
several frames (spread over the connections) sends it in a frame of its own once every
data frame was acknowledged, and its handle is DONE when that frame is.

Failure: any socket error, EOF, malformed reply, or a reply that does not come within
``io_timeout`` of the frame being sent marks the whole peer lost: every pending
transfer fails with PeerLost, sockets are shut down, threads exit by themselves.
"""

from __future__ import annotations

import itertools
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvhandoff.plan.model import Plan
from kvhandoff.transport.base import Handle, TransferState
from kvhandoff.transport.errors import (
    ConnectError,
    PeerLost,
    ProtocolError,
    TransportError,
)
from kvhandoff.transport.framing.cut import Chunk, dst_records, plan_records, split
from kvhandoff.transport.framing.io import send_views, write_some
from kvhandoff.transport.framing.served import WorkerPeer, prove, shut
from kvhandoff.transport.framing.wire import (
    FLAG_CHECK,
    FLAG_NOTICE,
    NO_RECORDS,
    Header,
    Kind,
    Status,
    join_notice,
    reply_error,
)
from kvhandoff.transport.regions import RegionTable
from kvhandoff.transport.tcp.data import Sink
from kvhandoff.transport.tcp.small import SmallFrame


class _Transfer:
    """One submit: its handle, how many data frames are still unacknowledged, and the
    notice still to send once they all are (a plan of several frames)."""

    def __init__(self, handle: Handle, frames: list[list[Chunk]],
                 notice: bytes | None = None) -> None:
        self.handle = handle
        self.frames = frames
        self.remaining = len(frames)
        self.notice = notice
        self.lock = threading.Lock()

    def frame_acked(self) -> bool:
        """Count one acknowledged data frame; True when it was the last."""
        with self.lock:
            self.remaining -= 1
            return self.remaining == 0


@dataclass(eq=False)
class _Frame:
    transfer: _Transfer
    desc: bytes
    payload_len: int
    chunks: list[Chunk] | None  # dropped once sent
    check: bool = False  # validate the whole plan, write nothing
    views: list[memoryview] | None = None  # a small frame's source bytes (tcp_small)
    notice: bytes | None = None  # delivered by the receiver after this frame's bytes
    seq: int = 0
    sent_at: float | None = None


@dataclass(eq=False)
class _Conn:
    """One socket. ``lock`` guards writing to it: the sink, ``seq``, ``inflight``
    (appended in stream order) and ``backlog`` (bytes an inline write left over)."""

    sock: socket.socket
    sink: Sink
    queue: queue.SimpleQueue[_Frame | None] = field(default_factory=queue.SimpleQueue)
    inflight: deque[_Frame] = field(default_factory=deque)
    seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    lock: threading.Lock = field(default_factory=threading.Lock)
    backlog: list[memoryview] = field(default_factory=list)


_KICK = _Frame(_Transfer(Handle(nbytes=0), []), b"", 0, None)
"""Wakes a sender thread to write its connection's backlog; never sent itself."""


class TcpPeer(WorkerPeer):
    """Thread-safe. Built (and connected) by ``TcpTransport.connect``."""

    def __init__(self, endpoint: bytes, *, host: str, port: int, key: bytes, endpoint_id: str,
                 connections: int, frame_bytes: int, io_timeout: float,
                 connect_timeout: float, table: Callable[[], RegionTable]) -> None:
        super().__init__(endpoint, f"tcp://{host}:{port}")
        self._frame_bytes = frame_bytes
        self._io_timeout = io_timeout
        self._table = table
        self._rr = itertools.count()
        self._conns: list[_Conn] = []
        try:
            for _ in range(max(1, connections)):
                sock = self._dial(host, port, key, endpoint_id, connect_timeout)
                self._conns.append(_Conn(sock, Sink(sock, min(frame_bytes, 8 << 20))))
        except BaseException:
            for c in self._conns:
                c.sock.close()
            raise
        for i, c in enumerate(self._conns):
            self._threads += [
                threading.Thread(target=self._guard, args=(self._send_loop, c), daemon=True,
                                 name=f"kvh-tcp-send-{port}-{i}"),
                threading.Thread(target=self._guard, args=(self._read_loop, c), daemon=True,
                                 name=f"kvh-tcp-read-{port}-{i}"),
            ]
        for t in self._threads:
            t.start()

    # --- setup ---------------------------------------------------------------------

    def _dial(self, host: str, port: int, key: bytes, endpoint_id: str,
              timeout: float) -> socket.socket:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise ConnectError(f"cannot reach tcp transport at {host}:{port}: {e}") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            prove(sock, key=key, endpoint_id=endpoint_id, timeout=timeout,
                  peer=f"tcp transport at {host}:{port}")
            sock.settimeout(self._io_timeout)
            return sock
        except (OSError, EOFError, ProtocolError) as e:
            sock.close()
            raise ConnectError(f"handshake with {host}:{port} failed: {e}") from e
        except BaseException:
            sock.close()
            raise

    # --- submit --------------------------------------------------------------------

    def submit(self, plan: Plan, notice: bytes | None = None) -> Handle:
        """Queue ``plan`` (validated by the transport); returns its handle at once."""
        frames = split(plan, self._frame_bytes)
        if not frames and notice is None:
            return Handle.completed(peer=self.name)
        handle, transfer = self._open(plan.nbytes, lambda h: _Transfer(h, frames, notice))
        if transfer is None:
            return handle
        if len(frames) <= 1:
            self._queue_data(transfer, inline=True)
        else:
            check = _Frame(transfer, plan_records(plan).encode(), 0, None, check=True)
            self._conns[next(self._rr) % len(self._conns)].queue.put(check)
        return handle

    def _queue_data(self, transfer: _Transfer, *, inline: bool = False) -> None:
        """Queue the data frames; a notice rides in the only one, or goes alone. With
        ``inline`` (the submitting thread), a lone frame that fits the connection's
        bounce buffer is written from this thread when the connection is idle."""
        if not transfer.frames:
            self._queue_notice(transfer)
            return
        start = next(self._rr)
        for i, chunks in enumerate(transfer.frames):
            frame = _Frame(transfer, dst_records(chunks).encode(),
                           sum(c.nbytes for c in chunks), chunks)
            conn = self._conns[(start + i) % len(self._conns)]
            if len(transfer.frames) == 1:
                frame.notice, transfer.notice = transfer.notice, None
                if (inline and frame.payload_len <= conn.sink.capacity
                        and self._send_inline(conn, frame)):
                    continue
            conn.queue.put(frame)
        transfer.frames = []  # the frames own their chunks now

    def _queue_notice(self, transfer: _Transfer) -> None:
        """Queue the transfer's notice as a frame that writes nothing: its data frames
        (if any) were all acknowledged, so their bytes have landed."""
        frame = _Frame(transfer, NO_RECORDS, 0, None, notice=transfer.notice)
        transfer.notice = None
        transfer.remaining = 1
        self._conns[next(self._rr) % len(self._conns)].queue.put(frame)

    def submit_small(self, small: SmallFrame, notice: bytes | None = None) -> Handle:
        """Send a small plan's frame (built and source-checked by ``tcp_small.build``),
        from this thread when a connection is idle."""
        # one frame to acknowledge, and none left for _queue_data to send
        handle, transfer = self._open(small.nbytes, lambda h: _Transfer(h, [[]]))
        if transfer is None:
            return handle
        transfer.frames = []
        frame = _Frame(transfer, small.desc, small.nbytes, None, views=small.views,
                       notice=notice)
        conn = self._conns[next(self._rr) % len(self._conns)]
        if not self._send_inline(conn, frame):
            conn.queue.put(frame)
        return handle

    def _send_inline(self, conn: _Conn, frame: _Frame) -> bool:
        """Write ``frame`` from this thread if ``conn`` is idle, without blocking: what
        the kernel does not take now is left to the sender thread. False (nothing
        done) if the connection is busy."""
        if not conn.queue.empty() or not conn.lock.acquire(blocking=False):
            return False
        try:
            if conn.backlog or self._error is not None:
                return False
            self._write_frame(conn, frame)
            try:
                conn.backlog = write_some(conn.sock, conn.sink.take())
            except OSError as e:
                self._fail(PeerLost(f"lost {self.name}: {type(e).__name__}: {e}"))
                return True
            frame.sent_at = time.monotonic()
        finally:
            conn.lock.release()
        if conn.backlog:
            conn.queue.put(_KICK)  # the sender thread writes the rest
        return True

    def _write_frame(self, conn: _Conn, frame: _Frame) -> None:
        """Queue ``frame`` into the connection's sink (under ``conn.lock``)."""
        frame.transfer.handle.mark_started()
        frame.seq = next(conn.seq)
        conn.inflight.append(frame)
        flags = FLAG_CHECK if frame.check else 0
        desc = frame.desc
        if frame.notice is not None:
            flags |= FLAG_NOTICE
            desc = join_notice(frame.notice, desc)
        head = Header(Kind.WRITE, flags, frame.seq, len(desc), frame.payload_len)
        conn.sink.add(head.pack() + desc)
        if frame.views:
            conn.sink.extend(frame.views)
        table = self._table()
        for c in frame.chunks or ():
            conn.sink.chunk(c, table)
        frame.chunks = frame.views = None  # drop references to plan memory early

    def _finish(self, transfer: _Transfer, error: TransportError | None) -> None:
        if error is None:
            transfer.handle.set_done()
        else:
            transfer.handle.set_failed(error)
        self._forget(transfer)

    # --- threads -------------------------------------------------------------------

    def _send_loop(self, conn: _Conn) -> None:
        while True:
            frame = conn.queue.get()
            if frame is None or self._error is not None:
                return
            with conn.lock:
                if conn.backlog:  # what an inline write left over goes first
                    send_views(conn.sock, conn.backlog)
                    conn.backlog = []
                if frame is _KICK or frame.transfer.handle.state is not TransferState.PENDING:
                    continue  # failed or released meanwhile: do not send
                self._write_frame(conn, frame)
                conn.sink.flush()
                frame.sent_at = time.monotonic()

    def _read_loop(self, conn: _Conn) -> None:
        self._read_replies(conn.sock, conn.inflight, self._io_timeout, self._on_reply)

    def _on_reply(self, frame: _Frame, h: Header, message: str) -> None:
        transfer = frame.transfer
        if h.code != Status.OK:
            self._finish(transfer, reply_error(h.code, message, self.name))
        elif frame.check:
            self._queue_data(transfer)  # the receiver accepted the whole plan
        elif transfer.frame_acked():
            if transfer.notice is not None:
                self._queue_notice(transfer)  # every data frame landed
            else:
                self._finish(transfer, None)

    # --- failure and close -----------------------------------------------------------

    def _wake(self) -> None:
        for c in self._conns:
            shut(c.sock)
            c.queue.put(None)

    def _release(self) -> None:
        for c in self._conns:
            c.sock.close()
