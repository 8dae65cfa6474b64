"""Staging: fragmented plans through request-rate-bound engines, in a few large writes.

Engines pay per request (Mooncake TCP ~36 µs, NIXL ``cma`` ~3 µs), so a plan made of
1 KiB head slices or scattered 4 KiB pages crawls through them. When a plan is
fragmented, the engine adapters (``mooncake``, ``nixl``) route it through this module
instead, and the session layer sees the same contract (one handle, DONE once the
bytes are in place, refused writes write nothing):

    sender                                         receiver
    ------                                         --------
    gather a frame of the plan into one of its     owns an *arena* of slots registered
    registered outbound buffers (numpy)            with the engine at its first
    engine write: buffer → a slot of the peer's    ``endpoint()``, and a small control
    arena (one large request)                      server (TCP) advertised in it
    COMMIT(slot, destination records) ─────────▶   bounds-check the records against its
                                                   registered memory, scatter the slot
                                        ◀───────── (numpy views), REPLY OK / refused
    handle DONE after the last frame's REPLY

* **Authentication.** The control connection opens with the mutual challenge–response
  of :mod:`~kvhandoff.transport.framing.handshake`, keyed with the staging option's token
  (or HMAC(``data_secret``, token) with the deployment secret's data-plane key); the
  token never travels on the socket, the server reads no frame and leases nothing before
  the sender proved the key, and the sender commits nothing to a server that did not
  prove it. Connections from one address are capped
  (``StagingConfig.max_connections_per_host``). The engine writes into the slots are the
  engine's own data plane, not authenticated by kvhandoff: the slots are registered
  memory that only the leased, authenticated sender's COMMITs make the receiver scatter.
* **Slots.** At ``connect`` the sender dials the control server, passes the handshake
  and is *leased* up to ``slots_per_peer`` slots for the life of the connection
  (fewer, or 0, when the arena is short: that peer then goes direct). Only the lease
  holder commits a slot. A sender that closes with no engine write into its slots
  possibly still running (its threads exited, every write it posted completed) says
  BYE before closing; the receiver then returns the slots to the back of the free list
  at once. A connection that ends any other way (EOF, error, a malformed frame, a
  sender killed, or a close that abandoned a write) may still have a late write on its
  way into those slots, which must not land in a frame of the next lease holder: they
  are *quarantined* for ``quarantine`` seconds (default ``max(io_timeout, 30 s)``, see
  :class:`StagingConfig`) and only then return to the free list, lazily, when a later
  HELLO leases (no timer thread). A goodbye that does not arrive only delays reuse.
* **Write safety.** A multi-frame plan's whole destination side is sent first as a
  CHECK (like tcp's); the receiver refuses it, and every COMMIT of that plan, before
  scattering anything. Each COMMIT is bounds-checked again before its scatter. The
  adapters also refuse destinations outside the peer's advertised table at submit.
* **Frames** are :func:`kvhandoff.transport.framing.cut.split` frames (factored chunks of
  at most ``slot_bytes``); their destination records travel in the COMMIT, so gather
  and scatter are one numpy call per chunk, never a Python call per page or row.
* **Bounded.** Every wait (a free slot, an engine write, a reply) is bounded by
  ``io_timeout``; whatever goes wrong fails the handle (``PeerLost`` for the wire or an
  engine write that never completes, ``RemoteOutOfBounds`` for a refusal) and nothing
  is leaked: buffers return to the pool, slots to the receiver.
* **Host memory only**: plans touching device memory, and peers without staging, go
  direct.

The control protocol reuses the tcp transport's frame header and record tables
(:mod:`kvhandoff.transport.framing.wire`), after the handshake: HELLO (empty) → REPLY OK
carrying the leased slots as JSON; WRITE(desc = ``<q job, q slot>`` + records), with
``FLAG_CHECK`` for a whole-plan check (slot -1) → REPLY; BYE (nothing else in the frame,
no reply), then the sender closes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import queue
import secrets
import socket
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhandoff.layout import MemoryKind, Region
from kvhandoff.memory import piece_view
from kvhandoff.plan.model import Plan
from kvhandoff.transport.base import Handle, Peer, TransferState
from kvhandoff.transport.errors import (
    ConnectError,
    PeerLost,
    ProtocolError,
    TransportClosed,
    TransportError,
)
from kvhandoff.transport.framing.cut import Chunk, dst_records, plan_records, split
from kvhandoff.transport.framing.handshake import derive_key, new_endpoint_id
from kvhandoff.transport.framing.io import recv_exact, recv_header
from kvhandoff.transport.framing.served import (
    MAX_PER_HOST,
    ThreadedServer,
    WorkerPeer,
    prove,
    shut,
)
from kvhandoff.transport.framing.wire import (
    FLAG_CHECK,
    HEADER,
    Header,
    Kind,
    Records,
    Status,
    reply_error,
)
from kvhandoff.transport.regions import U8, RegionTable, plan_side_problem
from kvhandoff.transport.views import as_rows, take_into, unit_contiguous

log = logging.getLogger("kvhandoff.transport")

_JOB = struct.Struct("<qq")  # job id, slot index (-1: a whole-plan CHECK)
_MAX_REPLY = 4096
_BYE = Header(Kind.BYE, 0, 0, 0, 0).pack()
_FRAME_S = 0.25  # how long a close lets a control frame being written finish (for BYE)
QUARANTINE_FLOOR = 30.0
"""The least default quarantine, in seconds (see :class:`StagingConfig`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StagingConfig:
    """When and how an engine adapter stages (keyword-only; frozen).

    A plan is staged when it has at least ``min_segments`` (estimated, coalesced)
    segments averaging under ``below`` bytes. ``slot_bytes``: one engine write (and one
    frame); ``slots``: the receiving arena (``slots × slot_bytes`` of virtual memory,
    touched only when used); ``slots_per_peer``: slots leased to one sender, i.e. how
    many frames it keeps in flight. ``enabled=False`` turns staging off both ways.

    ``quarantine``: seconds the slots of a sender that went away without a BYE stay out
    of the free list (see the module docstring); None: ``max(io_timeout, 30 s)``. The
    receiver cannot see the sender's engine, only that its control connection ended; a
    write posted before that can still land afterwards: the sender itself waits up to
    ``io_timeout`` for a write before giving up on it, an abandoned ``close`` leaves the
    engine's teardown running past ``close_timeout`` (5 s by default), and engines
    retransmit or drain a dead peer's connection for seconds. The default is a generous
    bound on that lateness, not a proof; 0 turns the quarantine off.

    ``max_connections_per_host``: control connections the receiver holds from one source
    address (each sending peer holds one); extras are refused with a logged reason."""

    enabled: bool = True
    below: int = 64 << 10
    min_segments: int = 64
    slot_bytes: int = 4 << 20
    slots: int = 16
    slots_per_peer: int = 4
    quarantine: float | None = None
    max_connections_per_host: int = MAX_PER_HOST

    def __post_init__(self) -> None:
        if (self.below < 1 or self.min_segments < 1 or self.slot_bytes < 4096
                or self.slots < 1 or self.slots_per_peer < 1
                or self.max_connections_per_host < 1
                or (self.quarantine is not None and not self.quarantine >= 0)):
            raise ValueError(f"invalid staging config: {self}")

    def quarantine_for(self, io_timeout: float) -> float:
        """The quarantine in seconds, with the default resolved against ``io_timeout``."""
        if self.quarantine is not None:
            return self.quarantine
        return max(io_timeout, QUARANTINE_FLOOR)

    def too_coarse(self, nbytes: int, segments: int) -> bool:
        """Whether ``nbytes`` in ``segments`` segments are not worth staging: fewer
        than ``min_segments``, or averaging ``below`` bytes or more. More segments never
        make a plan coarser, so an upper bound on its count can rule it out early."""
        return segments < self.min_segments or nbytes >= self.below * segments


def estimate_segments(plan: Plan) -> int:
    """An upper bound on the plan's coalesced segment count, without expanding it:
    whole-unit entries count their runs of consecutive indices; other entries one
    segment per unit for pieces contiguous on both sides, else one per row."""
    total = 0
    for e in plan.entries:
        n = len(e.src_idx)
        if not n:
            continue
        if e.whole_units:
            s, d = e.src_idx, e.dst_idx
            total += 1 + int(np.count_nonzero((np.diff(s) != 1) | (np.diff(d) != 1)))
            continue
        for _so, _do, ln, cnt, ss, ds in e.pieces.tolist():
            if ln and cnt:
                joint = unit_contiguous(cnt, ss, ln) and unit_contiguous(cnt, ds, ln)
                total += n * (1 if joint else cnt)
    return total


# --- the numpy side: gather a frame, scatter records -----------------------------------


def gather(chunks: list[Chunk], table: RegionTable, out: U8) -> int:
    """Copy the source bytes of ``chunks`` (validated against ``table``) into ``out``,
    in wire order; returns the bytes written."""
    pos = 0
    for c in chunks:
        n = c.nbytes
        if not n:
            continue
        view = piece_view(table.view(c.src_ptr), c.src_off, c.src_unit, c.count,
                          c.src_stride, c.length)
        dest = out[pos:pos + n].reshape(len(c.src_idx), c.count, c.length)
        take_into(as_rows(view), c.src_idx, as_rows(dest))
        pos += n
    return pos


def scatter(records: Records, table: RegionTable, src: U8) -> None:
    """Write ``src`` (the payload of ``records``, in wire order) to the destinations
    the records describe. The caller checked ``records.problem(table)`` first."""
    pos = 0
    for r in range(len(records)):
        ptr, unit, off, length, count, stride, idx = records.record(r)
        n = len(idx) * length * count
        if not n:
            continue
        view = piece_view(table.view(ptr), off, unit, count, stride, length)
        as_rows(view)[idx] = as_rows(src[pos:pos + n].reshape(len(idx), count, length))
        pos += n


# --- receiver: the arena and the control server --------------------------------------


class Arena:
    """``slots`` registered slots of ``slot_bytes``; leases slots to connections.
    Thread-safe. Freed slots go to the back of the queue (reused last); quarantined
    ones join it once their time has passed, checked when a lease is made (time is
    ``time.monotonic()``; nothing runs in between)."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.buf: U8 = np.zeros(slots * slot_bytes, np.uint8)  # pages appear when touched
        self.base = int(self.buf.ctypes.data)
        self._free: deque[int] = deque(range(slots))
        self._held: list[tuple[float, list[int]]] = []  # (release time, slots), in order
        self._lock = threading.Lock()

    def lease(self, want: int) -> list[int]:
        with self._lock:
            if self._held:
                now = time.monotonic()
                while self._held and self._held[0][0] <= now:
                    self._free.extend(self._held.pop(0)[1])
            return [self._free.popleft() for _ in range(min(want, len(self._free)))]

    def give_back(self, slots: Iterable[int]) -> None:
        """Slots no write can still reach: free at once."""
        with self._lock:
            self._free.extend(slots)

    def quarantine(self, slots: Iterable[int], seconds: float) -> None:
        """Slots a late engine write may still reach: free ``seconds`` from now."""
        held = list(slots)
        if not held:
            return
        with self._lock:
            until = time.monotonic() + seconds
            k = len(self._held)  # keep release order (periods may differ)
            while k and self._held[k - 1][0] > until:
                k -= 1
            self._held.insert(k, (until, held))

    @property
    def in_use(self) -> int:
        """Slots leased to senders or quarantined: not free for a new lease."""
        with self._lock:
            return self.slots - len(self._free)

    @property
    def quarantined(self) -> int:
        """Slots held back from the free list (including any whose time has passed but
        that no lease has released yet)."""
        with self._lock:
            return sum(len(s) for _, s in self._held)

    def slot(self, i: int) -> U8:
        return self.buf[i * self.slot_bytes:(i + 1) * self.slot_bytes]


class StagingServer(ThreadedServer):
    """The receiver's control server: leases slots, checks and scatters commits."""

    def __init__(self, *, host: str, key: bytes, endpoint_id: str, arena: Arena,
                 slots_per_peer: int, table: Callable[[], RegionTable], io_timeout: float,
                 quarantine: float, max_per_host: int = MAX_PER_HOST) -> None:
        self.arena, self.table = arena, table
        self.slots_per_peer, self.io_timeout = slots_per_peer, io_timeout
        self.quarantine = quarantine  # seconds; see StagingConfig
        listener = socket.create_server((host, 0), backlog=64)
        self.host, self.port = listener.getsockname()[:2]
        super().__init__(listener, f"staging-{self.port}", key=key, endpoint_id=endpoint_id,
                         max_per_host=max_per_host)

    def serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.io_timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        lease: list[int] = []
        link = _ServedLink(conn, self, lease)
        try:
            link.run()
        finally:
            if link.said_bye:  # no write of this sender can still land in its slots
                self.arena.give_back(lease)
            else:
                self.arena.quarantine(lease, self.quarantine)


@dataclass(eq=False)
class _ServedLink:
    """One authenticated sender's control connection, frame after frame (see the module
    docstring). ``greeted``: its HELLO leased the slots."""

    sock: socket.socket
    server: StagingServer
    lease: list[int]
    refused: int = -1  # the last job refused by a CHECK or a COMMIT
    greeted: bool = False
    said_bye: bool = False  # a well-formed BYE ended the connection

    def reply(self, seq: int, status: Status, message: str = "") -> None:
        body = message.encode()[:_MAX_REPLY]
        self.sock.sendall(Header(Kind.REPLY, status, seq, len(body), 0).pack() + body)

    def run(self) -> None:
        hdr = bytearray(HEADER.size)
        while not self.server.closing:
            if not recv_header(self.sock, memoryview(hdr), idle_ok=True):
                continue
            try:
                h = Header.unpack(hdr)
                if h.payload_len:
                    raise ProtocolError("staging control frames carry no payload")
                if not self.greeted and (h.kind is not Kind.HELLO or h.desc_len):
                    raise ProtocolError(f"unexpected {h.kind.name} frame of {h.desc_len} B "
                                        f"before HELLO (an empty HELLO comes first)")
            except ProtocolError as e:
                self.reply(0, Status.MALFORMED, str(e))
                raise
            desc = bytearray(h.desc_len)
            recv_exact(self.sock, memoryview(desc))
            if h.kind is Kind.HELLO and not self.greeted:
                self.hello(h.seq)
            elif h.kind is Kind.WRITE and self.greeted:
                self.write(h, desc)
            elif h.kind is Kind.BYE and self.greeted:
                if h.desc_len or h.code:
                    self.reply(h.seq, Status.MALFORMED, "a BYE frame carries nothing")
                    raise ProtocolError("staging BYE with a description or flags")
                self.said_bye = True
                return
            else:
                msg = f"unexpected {h.kind.name} frame" + ("" if self.greeted else " before HELLO")
                self.reply(h.seq, Status.MALFORMED, msg)
                raise ProtocolError(msg)

    def hello(self, seq: int) -> None:
        self.greeted = True
        arena = self.server.arena
        self.lease.extend(arena.lease(self.server.slots_per_peer))
        self.reply(seq, Status.OK, json.dumps({
            "slots": [[arena.base + i * arena.slot_bytes, arena.slot_bytes] for i in self.lease]}))

    def write(self, h: Header, desc: bytearray) -> None:
        try:
            if len(desc) < _JOB.size:
                raise ProtocolError(f"staging WRITE of {len(desc)} B has no job header")
            job, slot = _JOB.unpack_from(desc)
            records = Records.decode(memoryview(desc)[_JOB.size:])
            check = bool(h.code & FLAG_CHECK)
            if not check and not 0 <= slot < len(self.lease):
                raise ProtocolError(f"slot {slot} is not leased to this sender")
            if not check and records.nbytes > self.server.arena.slot_bytes:
                raise ProtocolError(f"records describe {records.nbytes} B, more than a slot")
        except ProtocolError as e:
            self.reply(h.seq, Status.MALFORMED, str(e))
            raise
        if job == self.refused:
            self.reply(h.seq, Status.OUT_OF_BOUNDS, f"job {job} was refused; nothing written")
            return
        table = self.server.table()
        problem = records.problem(table)
        if problem is not None:
            self.refused = job
            self.reply(h.seq, Status.OUT_OF_BOUNDS, problem)
            return
        if not check:
            scatter(records, table, self.server.arena.slot(self.lease[slot]))
        self.reply(h.seq, Status.OK)


# --- sender: outbound buffers and one link per peer ----------------------------------


class _Buffers:
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
                 bufs: list[U8], pool: _Buffers, *, write: Write, wait: Wait,
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
        job: _Job
        handle = StagedHandle(nbytes=plan.nbytes, peer=self._peer.name,
                              on_release=lambda h: self._forget(job))
        job = _Job(handle, plan, next(self._ids))
        self.submitted = job.id
        if self._track(job):
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
        desc = _JOB.pack(job.id, slot) + records.encode()
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
                self._send_cond.wait_for(lambda: not self._sending, _FRAME_S)
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


# --- the adapter-facing piece ----------------------------------------------------------


class Staging:
    """One per engine transport: the receiving arena and control server (started by
    the first :meth:`advertise`), the outbound buffers, and the links to peers.

    ``register(region)`` registers host memory with the engine *only* (it is neither a
    plan source nor a destination peers may name); ``write``/``wait`` move one segment
    between two registered host buffers; ``table()`` is the transport's registered host
    memory (sources to gather from, destinations to scatter into)."""

    OPTION = "staging"

    def __init__(self, name: str, config: StagingConfig, *, register: Callable[[Region], None],
                 write: Write, wait: Wait, table: Callable[[], RegionTable], host: str,
                 io_timeout: float, connect_timeout: float,
                 data_secret: bytes | None = None) -> None:
        self.name, self.config = name, config
        self._register, self._write, self._wait, self._table = register, write, wait, table
        self._host = host
        self._io_timeout, self._connect_timeout = io_timeout, connect_timeout
        self._token = secrets.token_hex(16)
        self._id = new_endpoint_id()
        self._data_secret = data_secret  # the deployment secret's data-plane key, if any
        self._lock = threading.Lock()
        self._server: StagingServer | None = None
        self._arena: Arena | None = None
        self._pool = _Buffers(config.slot_bytes, register)
        self._links: weakref.WeakSet[StagingLink] = weakref.WeakSet()

    @property
    def slots_in_use(self) -> int:
        """This side's arena slots leased or quarantined (0 before any peer staged)."""
        arena = self._arena
        return arena.in_use if arena is not None else 0

    def advertise(self) -> tuple[tuple[str, str], ...]:
        """Endpoint options that let a peer stage into this side (registers the arena
        and starts the control server on first use); empty when staging is off."""
        if not self.config.enabled:
            return ()
        with self._lock:
            if self._server is None:
                arena = Arena(self.config.slots, self.config.slot_bytes)
                self._register(Region(ptr=arena.base, nbytes=arena.buf.nbytes))
                self._arena = arena
                self._server = StagingServer(
                    host=self._host, key=derive_key(self._token.encode(), self._data_secret),
                    endpoint_id=self._id, arena=arena,
                    slots_per_peer=self.config.slots_per_peer, table=self._table,
                    io_timeout=self._io_timeout,
                    quarantine=self.config.quarantine_for(self._io_timeout),
                    max_per_host=self.config.max_connections_per_host)
            server = self._server
        return ((self.OPTION, json.dumps({"host": server.host, "port": server.port,
                                           "token": self._token, "id": self._id})),)

    def connect(self, options: dict[str, str], peer: Peer) -> StagingLink | None:
        """A link to the peer's staging server if it advertises one (None if it does
        not, or leased no slot). Blocking, bounded by the connect timeout; raises
        :class:`ConnectError`."""
        if not self.config.enabled or self.OPTION not in options:
            return None
        try:
            info: dict[str, Any] = json.loads(options[self.OPTION])
            host, port, token = str(info["host"]), int(info["port"]), str(info["token"])
            eid = str(info["id"])
        except (ValueError, KeyError, TypeError) as e:
            raise ConnectError(f"{self.name} endpoint has a malformed staging option") from e
        sock, slots = self._dial(host, port, derive_key(token.encode(), self._data_secret),
                                 eid)
        if not slots:
            log.info("%s: %s leased no staging slot; fragmented plans go direct",
                     self.name, peer.name)
            say_bye(sock)
            sock.close()
            return None
        try:
            bufs = self._pool.lease(len(slots))
        except BaseException:
            say_bye(sock)  # nothing was written into the slots
            sock.close()
            raise
        link = StagingLink(peer, sock, slots, bufs, self._pool, write=self._write,
                           wait=self._wait, table=self._table, io_timeout=self._io_timeout)
        with self._lock:
            self._links.add(link)
        return link

    def _dial(self, host: str, port: int, key: bytes, endpoint_id: str
              ) -> tuple[socket.socket, list[tuple[int, int]]]:
        try:
            sock = socket.create_connection((host, port), timeout=self._connect_timeout)
        except OSError as e:
            raise ConnectError(f"{self.name}: cannot reach the peer's staging server at "
                               f"{host}:{port}: {e}") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            prove(sock, key=key, endpoint_id=endpoint_id, timeout=self._connect_timeout,
                  peer=f"{self.name} staging server at {host}:{port}")
            sock.settimeout(self._connect_timeout)
            sock.sendall(Header(Kind.HELLO, 0, 0, 0, 0).pack())
            hdr = bytearray(HEADER.size)
            recv_exact(sock, memoryview(hdr))
            h = Header.unpack(hdr)
            body = bytearray(min(h.desc_len, 1 << 20))
            recv_exact(sock, memoryview(body))
            if h.kind is not Kind.REPLY or h.code != Status.OK:
                raise ConnectError(f"{self.name}: staging handshake refused: "
                                   f"{body.decode(errors='replace')}")
            slots = [(int(p), int(n)) for p, n in json.loads(body)["slots"]
                     if int(n) >= 4096]
            sock.settimeout(self._io_timeout)
            return sock, slots
        except ConnectError:
            sock.close()
            raise
        except (OSError, EOFError, ProtocolError, ValueError, KeyError, TypeError) as e:
            sock.close()
            raise ConnectError(f"{self.name}: staging handshake with {host}:{port} "
                               f"failed: {e}") from e

    def wants(self, plan: Plan, dst_host: RegionTable) -> bool:
        """Whether ``plan`` is fragmented enough to stage, and all host memory."""
        cfg = self.config
        most = plan.num_segments  # uncoalesced: at least the estimate below
        if cfg.too_coarse(plan.nbytes, most):
            return False  # decided without counting runs
        if cfg.too_coarse(plan.nbytes, estimate_segments(plan)):
            return False
        return (plan_side_problem(plan, self._table(), "src") is None
                and plan_side_problem(plan, dst_host, "dst") is None)

    def abandon(self, error: TransportError) -> None:
        """Fail every link's pending submits with ``error`` and wake its threads,
        without waiting for them (``close`` could not finish in time)."""
        with self._lock:
            links = list(self._links)
        for link in links:
            link.abandon(error)

    def close(self) -> None:
        """Close every link (failing its pending submits) and the control server."""
        with self._lock:
            links, self._links = list(self._links), weakref.WeakSet()
            server, self._server = self._server, None
        for link in links:
            link.close()
        if server is not None:
            server.close()


def say_bye(sock: socket.socket) -> None:
    """Send BYE and end the stream (before ``sock.close()``), without ever blocking:
    if the socket cannot take the frame now, no BYE (the receiver then quarantines)."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        if sock.send(_BYE) == len(_BYE):
            sock.shutdown(socket.SHUT_WR)
        for _ in range(64):  # replies left unread would make close() send a reset
            if not sock.recv(1 << 16):
                break


def host_regions(table: RegionTable) -> RegionTable:
    """The host-memory regions of an advertised table (what staging may scatter to)."""
    empty: U8 = np.zeros(0, np.uint8)
    return RegionTable((r, empty) for r in table.regions if r.memory is MemoryKind.HOST)


