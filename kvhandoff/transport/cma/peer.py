"""The sending side of the cma transport: describe each plan to the receiver, which pulls.

``connect`` dials the receiver's abstract Unix socket, passes the data-plane handshake
(:func:`~kvhandoff.transport.framing.served.prove`: nothing is sent to a socket that
does not prove the endpoint's key), lets receivers read this process where Yama asks
for it (:func:`~kvhandoff.transport.cma.kernel.allow_readers`), and sends the opening
HELLO: a probe (random bytes the receiver must read back from this process's memory)
and the registered source regions. The receiver answers only once it read the probe,
so a kernel that forbids the read fails ``connect`` with the cause and the fix, never a
request.

Each submit becomes one WRITE frame (the plan's paired records, :mod:`.frames`), written
by the submitting thread when nothing is queued before it and the socket takes it at
once, else by the peer's writer thread; when this side registered more memory since, a
HELLO with the new regions goes first. The reader thread completes handles from the
REPLYs, in order: DONE once the receiver pulled every byte (and delivered the notice).
The bytes never pass through this process's threads.

Closing waits (bounded) for the receiver to hang up: it stops pulling within one batch
when it sees this side's end of the stream, so once ``close`` returns no byte of a
transfer to this peer lands any more, and pending handles fail with TransportClosed.
A receiver that dies fails them with PeerLost at once; one that stops answering, after
``io_timeout`` (it stops pulling by itself after half of that).
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from kvhandoff.plan.model import Plan
from kvhandoff.transport.base import Handle, TransferState
from kvhandoff.transport.cma.frames import decode_moved, encode_hello, encode_write
from kvhandoff.transport.cma.kernel import allow_readers
from kvhandoff.transport.errors import (
    ConnectError,
    PeerLost,
    ProtocolError,
    TransferFailed,
    TransportError,
)
from kvhandoff.transport.framing.io import FrameReader, send_views, write_some
from kvhandoff.transport.framing.served import (
    JOIN_S,
    Tracked,
    WorkerPeer,
    prove,
    recv_reply,
    shut,
)
from kvhandoff.transport.framing.wire import (
    FLAG_NOTICE,
    Header,
    Kind,
    Status,
    join_notice,
)
from kvhandoff.transport.regions import RegionTable

PROBE_BYTES = 16


class _Job:
    __slots__ = ("handle", "notice", "plan", "sent_at", "seq")

    def __init__(self, handle: Handle, plan: Plan | None, notice: bytes | None) -> None:
        self.handle, self.plan, self.notice = handle, plan, notice
        self.seq = 0
        self.sent_at: float | None = None


class CmaPeer(WorkerPeer):
    """Thread-safe. A writer thread (frames out) and a reader thread (replies in)."""

    def __init__(self, endpoint: bytes, *, address: str, key: bytes, endpoint_id: str,
                 io_timeout: float, connect_timeout: float,
                 table: Callable[[], RegionTable]) -> None:
        super().__init__(endpoint, f"cma:{endpoint_id[:8]}")
        self._io_timeout = io_timeout
        self._table = table
        self._probe = np.frombuffer(os.urandom(PROBE_BYTES), np.uint8).copy()  # read there
        self._queue: queue.SimpleQueue[_Job | list[memoryview] | None] = queue.SimpleQueue()
        self._out = threading.Lock()  # who writes frames next: see submit
        self._queued = 0  # items put in the queue and not yet written
        self._inflight: deque[_Job] = deque()
        self._seq = 0
        self._closing = False
        allow_readers()
        self._sent = table()
        self._sock = self._dial(address, key, endpoint_id, connect_timeout)
        self._start((self._write_loop, "kvh-cma-write"), (self._read_loop, "kvh-cma-read"))

    def _dial(self, address: str, key: bytes, endpoint_id: str, timeout: float
              ) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
            prove(sock, key=key, endpoint_id=endpoint_id, timeout=timeout, peer=self.name)
            sock.settimeout(timeout)
            hello = encode_hello(int(self._probe.ctypes.data), self._probe.tobytes(),
                                 self._sent.describe())
            sock.sendall(Header(Kind.HELLO, 0, 0, len(hello), 0).pack() + hello)
            reader = FrameReader(sock)
            got = recv_reply(reader, self.name, lambda: None, timeout)
            if got is None:
                raise TimeoutError(f"no answer to the opening HELLO within {timeout} s")
            if reader.buffered:  # the reader thread starts afresh: nothing may be left
                raise ProtocolError(f"{reader.buffered} B after the reply to the opening HELLO")
            h, message = got
            if h.code != Status.OK:
                raise ConnectError(f"{self.name} refused this sender: {message}")
            sock.settimeout(self._io_timeout)
            return sock
        except ConnectError:
            sock.close()
            raise
        except (OSError, EOFError, ProtocolError, ValueError) as e:
            sock.close()
            raise ConnectError(f"cma connection to {address.lstrip(chr(0))!r} failed: "
                               f"{type(e).__name__}: {e}") from e

    def submit(self, plan: Plan, notice: bytes | None = None) -> Handle:
        """Send ``plan``'s frame (its sources checked by the transport): from this thread
        when nothing is queued before it, as far as the socket takes it without
        blocking (a thread hand-off saved per tiny handoff); the writer sends the rest,
        and everything while it has work."""
        if not plan and notice is None:
            return Handle.completed(peer=self.name)
        handle, job = self._open(plan.nbytes, lambda h: _Job(h, plan, notice))
        if job is None:
            return handle
        with self._out:
            now = self._queued == 0
            error = self._write_now(job) if now else None
            self._queued += not now
        if not now:
            self._queue.put(job)
        elif error is not None:  # outside the lock: failing runs the handles' callbacks
            self._fail(error)
        return handle

    def _write_now(self, job: _Job) -> TransportError | None:
        """Under ``self._out`` with nothing queued: write without blocking; the error
        that makes the peer unusable, if any."""
        try:
            rest = write_some(self._sock, self._frames(job))
        except OSError as e:
            return PeerLost(f"lost {self.name}: {type(e).__name__}: {e}")
        except ValueError as e:  # more regions than a receiver accepts
            return TransferFailed(str(e))
        if rest:  # the socket is full: the writer finishes this frame first
            self._queued += 1
            self._queue.put(rest)
        return None

    def _write_loop(self) -> None:
        try:
            while (item := self._queue.get()) is not None and self._error is None:
                try:
                    if isinstance(item, list):
                        send_views(self._sock, item)
                    elif item.handle.state is TransferState.PENDING:  # not released
                        send_views(self._sock, self._frames(item))
                finally:
                    with self._out:
                        self._queued -= 1
        except OSError:
            if not self._closing:
                raise

    def _frames(self, job: _Job) -> list[memoryview]:
        """The frames ``job`` goes out as — a HELLO with this side's regions first when
        it registered more since the last one —, its replies awaited from now on. Only
        one thread at a time (the writer while it has work, else a submitter holding
        ``self._out``)."""
        out: list[memoryview] = []
        table = self._table()
        if table is not self._sent:  # registered more: the receiver must know
            self._sent = table
            regions = encode_hello(0, b"", table.describe())
            out += self._frame(Kind.HELLO, 0, regions, _Job(Handle(nbytes=0), None, None))
        assert job.plan is not None
        desc = encode_write(job.plan)
        code = 0
        if job.notice is not None:
            desc, code = join_notice(job.notice, desc), FLAG_NOTICE
        job.plan = None  # drop references to the plan's arrays
        return out + self._frame(Kind.WRITE, code, desc, job)

    def _frame(self, kind: Kind, code: int, desc: bytes, job: _Job) -> list[memoryview]:
        self._seq += 1
        job.seq = self._seq
        job.sent_at = time.monotonic()
        self._inflight.append(job)  # before the frame: its reply may come at once
        job.handle.mark_started()
        return [memoryview(Header(kind, code, job.seq, len(desc), 0).pack()),
                memoryview(desc)]

    def _read_loop(self) -> None:
        try:
            self._read_replies(self._sock, self._inflight, self._io_timeout, self._replied)
        except (OSError, EOFError):
            if not self._closing:
                raise

    def _replied(self, item: Tracked, h: Header, message: str) -> None:
        """As every served peer, after taking from an OK reply when the receiver moved
        the bytes (``Handle.moving`` / ``moved``)."""
        if h.code == Status.OK and isinstance(item, _Job) and item.sent_at is not None:
            span = decode_moved(message, item.sent_at, time.monotonic())
            if span is not None:
                item.handle.moving, item.handle.moved = span
        super()._replied(item, h, message)

    def close(self) -> None:
        """Let the receiver stop first: end our stream, wait (bounded) for it to hang
        up, then fail what is still pending (TransportClosed)."""
        if self._error is None and not self._closing:
            self._closing = True
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_WR)
            reader = self._threads[1]
            if reader is not threading.current_thread():
                reader.join(min(self._io_timeout, JOIN_S))
        super().close()

    def _wake(self) -> None:
        shut(self._sock)
        self._queue.put(None)

    def _release(self) -> None:
        self._sock.close()
