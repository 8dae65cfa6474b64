"""The sending side of the cma transport: describe each plan to the receiver, which pulls.

``connect`` dials the receiver's abstract Unix socket, passes the data-plane handshake
(:func:`~kvhandoff.transport.framing.served.prove`: nothing is sent to a socket that
does not prove the endpoint's key), lets receivers read this process where Yama asks
for it (:func:`~kvhandoff.transport.cma.kernel.allow_readers`), and sends the opening
HELLO: a probe (random bytes the receiver must read back from this process's memory)
and the registered source regions. The receiver answers only once it read the probe,
so a kernel that forbids the read fails ``connect`` with the cause and the fix, never a
request.

Each submit becomes one WRITE frame (the plan's paired records, :mod:`.frames`), sent
by the peer's writer thread; when this side registered more memory since, a HELLO with
the new regions goes first. The reader thread completes handles from the REPLYs, in
order: DONE once the receiver pulled every byte (and delivered the notice). The bytes
never pass through this process's threads.

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
from kvhandoff.transport.cma.frames import encode_hello, encode_write
from kvhandoff.transport.cma.kernel import allow_readers
from kvhandoff.transport.errors import ConnectError, ProtocolError
from kvhandoff.transport.framing.served import JOIN_S, WorkerPeer, prove, recv_reply, shut
from kvhandoff.transport.framing.wire import (
    FLAG_NOTICE,
    HEADER,
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
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
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
            got = recv_reply(sock, bytearray(HEADER.size), self.name, lambda: None, timeout)
            if got is None:
                raise TimeoutError(f"no answer to the opening HELLO within {timeout} s")
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
        """Queue ``plan`` (its sources checked by the transport) for the writer."""
        if not plan and notice is None:
            return Handle.completed(peer=self.name)
        job: _Job
        handle = Handle(nbytes=plan.nbytes, peer=self.name,
                        on_release=lambda h: self._forget(job))
        job = _Job(handle, plan, notice)
        if self._track(job):
            self._queue.put(job)
        return handle

    def _write_loop(self) -> None:
        try:
            while (job := self._queue.get()) is not None and self._error is None:
                if job.handle.state is not TransferState.PENDING:
                    continue  # released before it went out: nothing to cancel
                table = self._table()
                if table is not self._sent:  # registered more: the receiver must know
                    self._sent = table
                    regions = encode_hello(0, b"", table.describe())
                    self._send(Kind.HELLO, 0, regions, _Job(Handle(nbytes=0), None, None))
                assert job.plan is not None
                desc = encode_write(job.plan)
                code = 0
                if job.notice is not None:
                    desc, code = join_notice(job.notice, desc), FLAG_NOTICE
                job.plan = None  # drop references to the plan's arrays
                self._send(Kind.WRITE, code, desc, job)
        except OSError:
            if not self._closing:
                raise

    def _send(self, kind: Kind, code: int, desc: bytes, job: _Job) -> None:
        self._seq += 1
        job.seq = self._seq
        job.sent_at = time.monotonic()
        self._inflight.append(job)  # before the frame: its reply may come at once
        job.handle.mark_started()
        self._sock.sendall(Header(kind, code, job.seq, len(desc), 0).pack() + desc)

    def _read_loop(self) -> None:
        try:
            self._read_replies(self._sock, self._inflight, self._io_timeout, self._replied)
        except (OSError, EOFError):
            if not self._closing:
                raise

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
