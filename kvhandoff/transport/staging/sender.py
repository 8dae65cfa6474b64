"""Staging's sending side: a link to one peer's staging server, which gathers a plan's
frames into its registered buffers, writes them into leased slots through the engine,
and commits each (see the package docstring for the protocol)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from kvhandoff.layout import Region
from kvhandoff.plan.model import Plan
from kvhandoff.transport.base import Handle, Peer, TransferState
from kvhandoff.transport.errors import PeerLost, TransportClosed, TransportError
from kvhandoff.transport.framing.cut import Chunk, dst_records, plan_records, split
from kvhandoff.transport.framing.served import WorkerPeer, shut
from kvhandoff.transport.framing.wire import FLAG_CHECK, Header, Kind, Records, Status, reply_error
from kvhandoff.transport.regions import U8, RegionTable
from kvhandoff.transport.staging.arena import gather
from kvhandoff.transport.staging.common import BYE, FRAME_S, JOB

log = logging.getLogger("kvhandoff.transport")


class Buffers:
    """The sender's registered gather buffers, shared by its links. Thread-safe; grows
    (allocating and registering another block) when a link wants more than are free."""

    def __init__(self, slot_bytes: int, register: Callable[[Region], None]) -> None:
        self.slot_bytes = slot_bytes
        self._register = register
        self._free: list[U8] = []
        self._blocks: list[U8] = []
        self._lock = threading.Lock()

    def lease(self, want: int) -> list[U8]:
        with self._lock:
            if len(self._free) < want:
                block = np.zeros((want - len(self._free)) * self.slot_bytes, np.uint8)
                self._register(Region(ptr=int(block.ctypes.data), nbytes=block.nbytes))
                self._blocks.append(block)
                self._free += [block[k:k + self.slot_bytes]
                               for k in range(0, block.nbytes, self.slot_bytes)]
            out, self._free = self._free[:want], self._free[want:]
        return out

    def give_back(self, bufs: Iterable[U8]) -> None:
        with self._lock:
            self._free.extend(bufs)


class StagedHandle(Handle):
    """The handle of a staged submit: completed by the link's threads (the engine's
    progress is driven there), so waiting on it never needs to poll the engine."""

    __slots__ = ()


@dataclass(eq=False)
class _Job:
    handle: Handle
    plan: Plan
    id: int
    remaining: int = 0  # frames whose COMMIT is not yet acknowledged

    def fail(self, error: TransportError) -> None:
        self.handle.set_failed(error)


@dataclass(eq=False)
class _Sent:
    """A control message awaiting its reply (replies come in order)."""

    seq: int
    job: _Job
    slot: int  # -1: a CHECK
    sent_at: float = field(default_factory=time.monotonic)


Write = Callable[[Peer, int, int, int], Handle]
"""``(engine peer, src address, dst address, nbytes) -> handle`` of one engine write."""
Wait = Callable[[Handle, float], TransferState]


class StagingLink(WorkerPeer):
    """A sender's staging channel to one peer (built by :meth:`Staging.connect`).

    Thread-safe. One sender thread works through the staged submits in order
    (gather, engine write, COMMIT; up to one frame per leased slot in flight), one
    reader thread takes the replies. Lost (``PeerLost``) when the control connection
    fails or a reply or engine write does not come within ``io_timeout``. ``close``
    says BYE (the receiver frees the slots at once) only when the sender thread has
    exited and every engine write it posted completed; a lost link never does."""

    def __init__(self, peer: Peer, sock: socket.socket, slots: list[tuple[int, int]],
                 bufs: list[U8], pool: Buffers, *, write: Write, wait: Wait,
                 table: Callable[[], RegionTable], io_timeout: float) -> None:
        super().__init__(peer.endpoint, f"{peer.name} (staging)")
        self._peer, self._sock = peer, sock
        self._slots = [p for p, _ in slots]
        self._bufs, self._pool = bufs, pool
        self._write, self._wait, self._table = write, wait, table
        self._io_timeout = io_timeout
        self.frame_bytes = min(pool.slot_bytes, *(n for _, n in slots))
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()  # slot indices; -1 wakes
        for i in range(len(slots)):
            self._free.put(i)
        self._sent: deque[_Sent] = deque()
        self._seq = 0
        self._ids = itertools.count(1)
        self.submitted = 0  # plans staged through this link so far
        self._stuck = False  # an engine write never completed: its buffer is not reused
        self._unsettled = 0  # engine writes posted and not seen DONE (sender thread only)
        self._send_cond = threading.Condition()  # orders control frames against _wake
        self._sending = False  # a control frame is being written (under _send_cond)
        self._goodbye = False  # closed by its owner between frames: BYE may follow
        self._threads = [
            threading.Thread(target=self._guard, args=(self._send_loop,), daemon=True,
                             name="kvh-staging-send"),
            threading.Thread(target=self._guard, args=(self._read_loop,), daemon=True,
                             name="kvh-staging-read"),
        ]
        for t in self._threads:
            t.start()

    def submit(self, plan: Plan) -> Handle:
        self.submitted = job_id = next(self._ids)
        handle, job = self._open(plan.nbytes, lambda h: _Job(h, plan, job_id),
                                 handle_type=StagedHandle, peer=self._peer.name)
        if job is not None:
            self._queue.put(job)
        return handle

    # --- sender thread ------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None or self._error is not None:
                return
            if job.handle.state is TransferState.PENDING:
                self._send_job(job)
            job.plan = Plan(entries=())  # drop references to the plan's arrays

    def _send_job(self, job: _Job) -> None:
        job.handle.mark_started()
        frames = split(job.plan, self.frame_bytes)
        job.remaining = len(frames)
        if len(frames) > 1:  # the receiver refuses the whole plan before any scatter
            self._message(job, -1, plan_records(job.plan), check=True)
        bufs = self._bufs  # close() may empty the list while this thread still runs
        free = list(range(len(bufs)))  # never more buffers than slots: no deadlock
        flying: deque[tuple[list[Chunk], int, int, Handle]] = deque()
        try:
            for frame in frames:
                if self._halted(job):
                    break
                while not free:  # commits the oldest frame, so its slot will come back
                    free.append(self._complete(job, *flying.popleft()))
                if self._halted(job):
                    break  # failed or closed while that frame completed
                b = free.pop()
                n = gather(frame, self._table(), bufs[b])  # while slots come back
                slot = self._take_slot()  # fewer frames fly than slots exist: one returns
                self._unsettled += 1  # counted before the call: it may post, then raise
                inner = self._write(self._peer, int(bufs[b].ctypes.data), self._slots[slot], n)
                flying.append((frame, slot, b, inner))
                while flying and flying[0][3].state is not TransferState.PENDING:
                    free.append(self._complete(job, *flying.popleft()))
            while flying:
                free.append(self._complete(job, *flying.popleft()))
        except BaseException:
            for _, _, _, inner in flying:  # never leave an engine write unaccounted for
                state = self._wait(inner, self._io_timeout)
                if state is TransferState.PENDING:
                    self._stuck = True
                elif state is TransferState.DONE:
                    self._unsettled -= 1
                inner.release()
            raise

    def _halted(self, job: _Job) -> bool:
        """Whether ``job`` must send nothing more (failed, released, or link lost)."""
        return job.handle.state is not TransferState.PENDING or self._error is not None

    def _take_slot(self) -> int:
        try:
            slot = self._free.get(timeout=self._io_timeout)
        except queue.Empty:
            raise PeerLost(f"{self.name}: no staging slot came back within "
                           f"{self._io_timeout}s") from None
        if slot < 0:  # woken by _fail
            self._free.put(slot)
            raise self._error or PeerLost(f"{self.name} is closed")
        return slot

    def _complete(self, job: _Job, frame: list[Chunk], slot: int, buf: int,
                  inner: Handle) -> int:
        """Wait for one engine write, then COMMIT its slot (or give it back).
        Returns the buffer, free again."""
        state = self._wait(inner, self._io_timeout)
        if state is TransferState.PENDING:
            self._stuck = True
            raise PeerLost(f"{self.name}: an engine write into a staging slot did not "
                           f"complete within {self._io_timeout}s")
        if state is TransferState.DONE:
            self._unsettled -= 1  # a FAILED write may still run in the engine (a close)
        error = inner.error
        inner.release()
        if state is TransferState.FAILED:  # the slot is registered: the peer is gone
            job.fail(error if isinstance(error, PeerLost) else PeerLost(
                f"{self.name}: the engine write into a staging slot failed: {error}"))
            self._forget(job)
            self._free.put(slot)
        elif job.handle.state is not TransferState.PENDING or self._error is not None:
            self._free.put(slot)  # failed or released meanwhile: nothing to scatter
        else:
            self._message(job, slot, dst_records(frame))
        return buf

    def _message(self, job: _Job, slot: int, records: Records, check: bool = False) -> None:
        desc = JOB.pack(job.id, slot) + records.encode()
        self._seq += 1
        self._sent.append(_Sent(self._seq, job, slot))  # before sending: replies are fast
        head = Header(Kind.WRITE, FLAG_CHECK if check else 0, self._seq, len(desc), 0)
        with self._send_cond:  # once _wake ran, nothing more is sent (but a BYE)
            if self._error is not None:
                raise PeerLost(f"{self.name} is closed")
            self._sending = True
        try:
            self._sock.sendall(head.pack() + desc)
        finally:
            with self._send_cond:
                self._sending = False
                self._send_cond.notify_all()

    # --- reader thread --------------------------------------------------------------

    def _read_loop(self) -> None:
        self._read_replies(self._sock, self._sent, self._io_timeout, self._on_reply)

    def _on_reply(self, sent: _Sent, h: Header, message: str) -> None:
        if sent.slot >= 0:
            self._free.put(sent.slot)
        job = sent.job
        if h.code != Status.OK:
            job.fail(reply_error(h.code, message, self._peer.name))
            self._forget(job)
        elif sent.slot >= 0:
            job.remaining -= 1
            if job.remaining == 0:
                job.handle.set_done()
                self._forget(job)

    # --- failure and close ----------------------------------------------------------

    def abandon(self, error: TransportError) -> None:
        """Fail what is pending and wake the threads; joins nothing."""
        self._fail(error)

    def _wake(self) -> None:
        closing = isinstance(self._error, TransportClosed)
        with self._send_cond:  # a frame cut short would leave no room for a BYE
            if closing:  # (its reply may have completed the last handle already)
                self._send_cond.wait_for(lambda: not self._sending, FRAME_S)
            self._goodbye = closing and not self._sending
        if self._goodbye:  # wake the reader (recv sees EOF); keep the way out open
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RD)
        else:
            shut(self._sock)
        self._queue.put(None)
        self._free.put(-1)

    def _release(self) -> None:
        if self._goodbye and not self._unsettled and not self._threads[0].is_alive():
            say_bye(self._sock)
        self._sock.close()
        if self._stuck or self._threads[0].is_alive():
            log.warning("%s: keeping %d staging buffers out of the pool (an engine write "
                        "into them may still be running)", self.name, len(self._bufs))
        else:
            self._pool.give_back(self._bufs)
        self._bufs = []


def say_bye(sock: socket.socket) -> None:
    """Send BYE and end the stream (before ``sock.close()``), without ever blocking:
    if the socket cannot take the frame now, no BYE (the receiver then quarantines)."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        if sock.send(BYE) == len(BYE):
            sock.shutdown(socket.SHUT_WR)
        for _ in range(64):  # replies left unread would make close() send a reset
            if not sock.recv(1 << 16):
                break
