"""The receiving side of the cma transport: check what a sender asks for, then pull it.

One thread accepts on an abstract Unix socket (named by the endpoint id; reachable only
from this host's network namespace). A connection opens with the mutual
challenge–response of :mod:`~kvhandoff.transport.framing.handshake` (run by
:class:`~kvhandoff.transport.framing.served.ThreadedServer`); the kernel names the
connecting process (``SO_PEERCRED``: its pid as this PID namespace sees it, its uid),
so the sender cannot point the receiver at another process. Then (:mod:`.frames`):

    HELLO (first)  → read the probe from the sender's memory and compare: REPLY OK, or
                     REFUSED naming why the kernel forbids it and the fix (then close)
    HELLO (later)  → the sender's regions, replaced → REPLY OK
    WRITE          → every destination byte inside this side's registered memory, every
                     source byte inside the regions the sender declared; refused:
                     REPLY OUT_OF_BOUNDS, nothing copied → else pull (``process_vm_readv``,
                     :mod:`.iov`) → REPLY OK → deliver the notice, if any (after the
                     reply, so the handler's work is off the sender's latency path)

Each connection has two threads: the serving thread reads and checks frames (a frame in
one syscall when it came whole, :class:`~kvhandoff.transport.framing.io.FrameReader`); a
write that one syscall pulls it pulls itself and answers when nothing is queued (no
thread hand-off on a handoff's latency path), anything else it queues for its copier,
which pulls and replies in frame order. Windows up to :data:`HELD_MAX` are pulled keeping
the GIL (:func:`~.kernel.process_vm_readv_held`). Nothing is ever written into the
sender, and nothing is written here that this side did not check itself.

Stops (the session's "no stale writes"): the copier checks between batches (at most
``IOV_MAX`` iovecs and 4 MiB each) whether the sender closed the connection (the serving
thread sees the EOF at once, even behind queued frames), whether this side is closing,
and whether the transfer is older than half the I/O timeout (past which the sender may
have given up on it); any of these ends the copy with a failed REPLY. So a sender that
closes its peer and waits for this side to hang up (:class:`~.peer.CmaPeer` does) knows
that no byte of its transfers lands afterwards.
"""

from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvhandoff.transport.cma import iov
from kvhandoff.transport.cma.frames import (
    MAX_HELLO,
    Hello,
    decode_hello,
    decode_write,
    encode_moved,
)
from kvhandoff.transport.cma.kernel import (
    ReadV,
    explain,
    iovecs,
    process_vm_readv,
    process_vm_readv_held,
)
from kvhandoff.transport.errors import ProtocolError
from kvhandoff.transport.framing.io import FrameReader
from kvhandoff.transport.framing.served import (
    JOIN_S,
    MAX_PER_HOST,
    ThreadedServer,
    shut,
    unix_listener,
)
from kvhandoff.transport.framing.wire import (
    FLAG_NOTICE,
    HEADER,
    SRC,
    Header,
    Kind,
    Records,
    Status,
    split_notice,
)
from kvhandoff.transport.regions import RegionTable
from kvhandoff.transport.throttle import Throttle

log = logging.getLogger("kvhandoff.transport")
_refused = Throttle(log)

PARALLEL_MIN = 4 << 20
"""Windows of at least this many bytes are shared among the copy threads."""
HELD_MAX = 2 << 20
"""Windows of at most this many bytes are pulled keeping the GIL (~0.2 ms at memory
speed: less than getting the GIL back from a busy engine's thread after the syscall)."""
QUEUE_BYTES = 64 << 20
"""Descriptor bytes a connection holds queued for its copier; past them the serving
thread stops reading until the copier catches up (a sender cannot make the receiver
hold more: it is pushed back through the socket)."""
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True, slots=True)
class _Reply:
    seq: int
    status: Status
    message: str = ""
    small = True
    weight = 0


@dataclass(frozen=True, slots=True)
class _Pull:
    seq: int
    src: Records
    dst: Records
    notice: bytes | None
    read_at: float  # monotonic: when this side had the frame
    deadline: float  # monotonic: past it the sender may have given up
    sides: tuple[iov.Side, iov.Side] | None  # its one window, when built as checked
    weight: int  # its descriptor's bytes, counted against QUEUE_BYTES while queued

    @property
    def small(self) -> bool:
        """One syscall's worth: the serving thread may pull it itself."""
        return self.sides is not None and iov.one_syscall(self.sides)


class CmaServer(ThreadedServer):
    """Accepts senders on the abstract Unix socket ``address``; checks and pulls their
    writes into ``table()`` (this side's registrations). ``deliver``: the notice
    handler. ``copy_threads``: threads sharing one large pull. ``close`` is
    thread-safe and idempotent."""

    def __init__(self, address: str, *, key: bytes, endpoint_id: str,
                 table: Callable[[], RegionTable], io_timeout: float,
                 deliver: Callable[[bytes], None], copy_threads: int = 2,
                 max_per_host: int = MAX_PER_HOST, readv: ReadV | None = None) -> None:
        self.table, self.deliver, self.io_timeout = table, deliver, io_timeout
        self.readv: ReadV = readv if readv is not None else process_vm_readv
        self.readv_held: ReadV = readv if readv is not None else process_vm_readv_held
        self.threads = copy_threads
        self._pool = ThreadPoolExecutor(max(1, copy_threads - 1),
                                        thread_name_prefix="kvh-cma-helper")
        try:
            listener = unix_listener(address)
        except BaseException:
            self._pool.shutdown()
            raise
        super().__init__(listener, "cma", key=key, endpoint_id=endpoint_id,
                         max_per_host=max_per_host)

    def serve(self, conn: socket.socket) -> None:
        pid, uid, _ = _CREDS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                    _CREDS.size))
        conn.settimeout(self.io_timeout)
        _Connection(conn, self, pid, uid).run()

    def pull(self, pid: int, local: iov.Side, remote: iov.Side,
             stop: Callable[[], str | None]) -> None:
        """Pull one window: keeping the GIL when it is small, shared among the copy
        threads when it is large (a part that fails stops the others at their next
        batch)."""
        n = local.nbytes
        if n <= HELD_MAX:
            iov.pull(self.readv_held, pid, local, remote, 0, n, stop=stop)
            return
        parts = self.threads if n >= PARALLEL_MIN else 1
        cuts = [n * k // parts for k in range(parts + 1)]
        failed = threading.Event()

        def part(k: int) -> None:
            try:
                iov.pull(self.readv, pid, local, remote, cuts[k], cuts[k + 1],
                         stop=lambda: "another part of the copy failed" if failed.is_set()
                         else stop())
            except BaseException:
                failed.set()
                raise

        futures = [self._pool.submit(part, k) for k in range(1, parts)]
        errors: list[BaseException] = []
        try:
            part(0)
        except BaseException as e:
            errors.append(e)
        for f in futures:  # bounded: each stops within a batch once told to
            if (e2 := f.exception()) is not None:
                errors.append(e2)
        if errors:  # the cause, not a part that stopped because of it
            raise next((e for e in errors if not isinstance(e, iov.Stopped)), errors[0])

    def close(self) -> None:
        super().close()
        self._pool.shutdown(wait=True)


class _Connection:
    """One sender: the serving thread reads and checks, the copier pulls and replies."""

    def __init__(self, sock: socket.socket, server: CmaServer, pid: int, uid: int) -> None:
        self.sock, self.server, self.pid, self.uid = sock, server, pid, uid
        self.sources = RegionTable()
        self.gone = threading.Event()
        self.jobs: queue.SimpleQueue[_Reply | _Pull | None] = queue.SimpleQueue()
        self._queued = 0  # jobs handed to the copier and not yet answered
        self._held = 0  # ... and their descriptor bytes
        self._cond = threading.Condition(threading.Lock())
        self.held_back = threading.Event()  # set while the serving thread waits for room
        self.reader = FrameReader(sock)  # a frame in one syscall when it came whole

    def run(self) -> None:
        if not self._open():
            return
        copier = threading.Thread(target=self._copy_loop, daemon=True, name="kvh-cma-copy")
        copier.start()
        try:
            self._read_loop()
        finally:
            self.gone.set()  # the copier stops within a batch and skips what is queued
            self.jobs.put(None)
            copier.join(JOIN_S)

    # --- the serving thread ---------------------------------------------------------------

    def _frame(self) -> tuple[Header, bytearray] | None:
        """The next frame (None: idle for an I/O timeout). ProtocolError, after
        queueing a MALFORMED reply, for anything but a payload-free HELLO or WRITE."""
        view = self.reader.header(HEADER.size, idle_ok=True)
        if view is None:
            return None
        try:
            h = Header.unpack(view)
            if h.kind not in (Kind.HELLO, Kind.WRITE) or h.payload_len:
                raise ProtocolError(f"unexpected {h.kind.name} frame (payload "
                                    f"{h.payload_len} B)")
            if h.kind is Kind.HELLO and h.desc_len > MAX_HELLO:
                raise ProtocolError(f"cma HELLO of {h.desc_len} B")
        except ProtocolError as e:
            self._dispatch(_Reply(0, Status.MALFORMED, str(e)))
            raise
        return h, self.reader.exact(h.desc_len)

    def _open(self) -> bool:
        """The first frame: a HELLO whose probe this side can read. Replies directly
        (the copier does not run yet); False when the sender was refused."""
        got = None
        deadline = time.monotonic() + self.server.io_timeout
        while got is None and time.monotonic() < deadline and not self.server.closing:
            got = self._frame()
        if got is None:
            return False
        h, desc = got
        try:
            if h.kind is not Kind.HELLO:
                raise ProtocolError(f"a cma connection opens with HELLO, not {h.kind.name}")
            hello = decode_hello(desc)
            if not hello.probe:
                raise ProtocolError("the first cma HELLO carries no probe")
        except ProtocolError as e:
            self._reply(h.seq, Status.MALFORMED, str(e))
            raise
        problem = self._probe(hello)
        if problem is not None:
            _refused("cma server: refused sender process %d: %s", self.pid, problem)
            self._reply(h.seq, Status.REFUSED, problem)
            return False
        self.sources = hello.regions
        self._reply(h.seq, Status.OK)
        return True

    def _probe(self, hello: Hello) -> str | None:
        """None if this side reads the sender's probe bytes; else why not, and the fix."""
        if self.pid <= 0:
            return ("the sending process is not visible in this PID namespace (the kernel "
                    "reports pid 0): cma needs both in one; use tcp")
        got = np.zeros(len(hello.probe), np.uint8)
        try:
            n = self.server.readv(self.pid, iovecs([(got.ctypes.data, len(got))]),
                                  iovecs([(hello.probe_addr, len(got))]))
        except OSError as e:
            return explain(e, pid=self.pid, peer_uid=self.uid)
        if n != len(got) or got.tobytes() != hello.probe:
            return (f"read {n} B at the sender's probe address of process {self.pid} but "
                    f"not its probe: not the sending process (PID namespaces?)")
        return None

    def _read_loop(self) -> None:
        while not self.server.closing:
            got = self._frame()
            if got is None:
                continue
            h, desc = got
            read_at = time.monotonic()
            try:
                if h.kind is Kind.HELLO:
                    hello = decode_hello(desc)
                    if hello.probe:
                        raise ProtocolError("a second cma HELLO with a probe")
                    self.sources = hello.regions
                    job: _Reply | _Pull = _Reply(h.seq, Status.OK)
                else:
                    job = self._check(h, desc, read_at)
            except ProtocolError as e:
                self._dispatch(_Reply(h.seq, Status.MALFORMED, str(e)))
                raise
            self._dispatch(job)

    def _dispatch(self, job: _Reply | _Pull) -> None:
        """Hand ``job`` to the copier; or, when the copier has nothing to do and the
        job is one syscall's worth, serve it in this thread (a thread hand-off saved per
        tiny handoff). Replies keep frame order: nothing else is queued or served.
        Waits while the queue holds :data:`QUEUE_BYTES` (this thread then reads no
        more frames: the sender is held back by the socket)."""
        with self._cond:
            here = self._queued == 0 and job.small
            while (not here and self._held and self._held + job.weight > QUEUE_BYTES
                   and not (self.gone.is_set() or self.server.closing)):
                self.held_back.set()
                self._cond.wait(0.5)  # also wakes to notice a close
            self.held_back.clear()
            if not here:
                self._queued += 1
                self._held += job.weight
        if here:
            self._serve(job)
        else:
            self.jobs.put(job)

    def _done(self, job: _Reply | _Pull) -> None:
        with self._cond:
            self._queued -= 1
            self._held -= job.weight
            self._cond.notify_all()

    def _check(self, h: Header, desc: bytearray, read_at: float) -> _Reply | _Pull:
        """A WRITE (read at ``read_at``), checked on both sides: a pull, or the refusal
        (nothing copied)."""
        notice: bytes | None = None
        table: bytearray | memoryview = desc
        if h.code & FLAG_NOTICE:
            notice, table = split_notice(desc)
        src, dst = decode_write(table)
        problem = dst.problem(self.server.table()) or src.problem(self.sources, SRC)
        if problem is not None:
            return _Reply(h.seq, Status.OUT_OF_BOUNDS, problem)
        return _Pull(h.seq, src, dst, notice, read_at, read_at + self.server.io_timeout / 2,
                     iov.prebuilt(src, dst), len(desc))

    # --- the copier -----------------------------------------------------------------------

    def _copy_loop(self) -> None:
        try:
            while (job := self.jobs.get()) is not None:
                try:
                    self._serve(job)
                finally:
                    self._done(job)
        except OSError as e:  # the socket: the serving thread sees it too
            log.debug("cma server: connection from process %d ended: %s", self.pid, e)
        except Exception:  # never a silent death: the sender sees the connection drop
            log.exception("cma server: copier for process %d failed", self.pid)
        finally:
            if not self.gone.is_set():
                self.gone.set()
                shut(self.sock)
            with self._cond:
                self._cond.notify_all()  # a serving thread held back may go on

    def _serve(self, job: _Reply | _Pull) -> None:
        """Answer one frame: its reply, or its pull then the reply (and the notice)."""
        if isinstance(job, _Reply):
            self._reply(job.seq, job.status, job.message)
            return
        if self.gone.is_set():
            return  # the sender left: nobody waits for it; copy nothing
        status, message = self._pull(job)
        if status is Status.OK:  # how long the bytes took here, for the sender's figures
            message = encode_moved(job.read_at, time.monotonic())
        try:
            if status is Status.OK or not self.gone.is_set():  # a closing sender fails
                self._reply(job.seq, status, message)  # its own transfers
        finally:  # the reply first: the handler's work (the status reaching decode's
            # request: locks, a GIL hand-over) is off the sender's latency path, and
            # every byte landed before either
            if status is Status.OK and job.notice is not None:
                self.server.deliver(job.notice)

    def _stop(self, deadline: float) -> str | None:
        if self.gone.is_set():
            return "the sender closed the connection"
        if self.server.closing:
            return "this receiver is closing"
        if time.monotonic() > deadline:
            return (f"it is older than half the I/O timeout ({self.server.io_timeout / 2:g} "
                    f"s): the sender may have given up on it")
        return None

    def _pull(self, job: _Pull) -> tuple[Status, str]:
        done = 0
        try:
            for local, remote in ([job.sides] if job.sides else
                                  iov.windows(job.src, job.dst)):
                self.server.pull(self.pid, local, remote, lambda: self._stop(job.deadline))
                done += local.nbytes
        except iov.Stopped as e:
            return Status.INTERNAL, f"{e} ({done} B of earlier windows had landed)"
        except iov.CopyFailed as e:
            why = (explain(e.error, pid=self.pid, peer_uid=self.uid) if e.error
                   else "the kernel made no progress")
            return Status.INTERNAL, (f"pulling from process {self.pid} failed ({done} B of "
                                     f"earlier windows had landed): {e}: {why}")
        return Status.OK, ""

    def _reply(self, seq: int, status: Status, message: str = "") -> None:
        body = message.encode()[:4096]
        self.sock.sendall(Header(Kind.REPLY, status, seq, len(body), 0).pack() + body)
