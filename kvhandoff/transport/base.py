"""The transport contract: register memory, exchange endpoints, submit plans, poll handles.

A transport moves the bytes of a :class:`~kvhandoff.plan.Plan` from memory registered
in *this* process (the plan's source side) into memory a *peer* registered (the
destination side), with RDMA-write semantics: the initiator pushes, the target
takes no call per transfer.

Call order (one Transport per process/rank and engine; use it as a context manager)::

    with TcpTransport() as t:                    # or create_transport("tcp", ...)
        t.register(layout)                       # Layout | Region | TensorSpec | ndarray, or
                                                 # an iterable of those; both sides register
        ep = t.endpoint()                        # bytes; send to the peer out of band
        peer = t.connect(peer_ep)                # blocking, bounded by the connect timeout
        h = t.submit(peer, plan)                 # non-blocking; plan.dst_* are peer addresses
        state = t.wait(h, timeout=10.0)          # or poll(h) -> TransferState, non-blocking
        h.release()                              # idempotent; frees per-transfer resources
        peer.close()                             # idempotent

Contract every transport keeps (the conformance suite in ``tests/conformance`` checks it):

* **Threads.** ``register``, ``endpoint``, ``connect``, ``submit``, ``poll`` and ``wait``
  may be called from any thread. ``close`` is idempotent; after it ``register``,
  ``endpoint``, ``connect`` and ``submit`` raise :class:`TransportClosed` and every
  pending handle fails (``poll``/``wait`` still report final states).
* **Errors.** Engine error codes are mapped to :mod:`kvhandoff.transport.errors` once,
  here at the boundary. ``submit`` raises (synchronously) only for caller bugs:
  :class:`~kvhandoff.errors.OutOfBounds` for a source byte outside this side's registered
  memory, :class:`TransportClosed` (transport or peer closed by its owner), ``TypeError``
  for a peer made by another transport. Everything that happens on the wire or at the peer is
  reported through the handle: ``poll`` → ``FAILED`` and ``handle.error`` holds a
  :class:`TransportError` (``PeerLost``, ``RemoteOutOfBounds``, ...).
* **Write safety.** A destination byte outside the peer's registered memory is refused
  for the whole submit *before* anything is written (``RemoteOutOfBounds``).
* **Bounded.** No call blocks forever: ``connect`` and in-flight transfers obey the
  transport's timeouts; a vanished peer turns pending handles ``FAILED`` with
  ``PeerLost``. An idle transport uses no CPU (no busy polling).
* **Ordering.** Register memory, *then* call ``endpoint()``, *then* the peer
  ``connect()``s: an endpoint may carry registration metadata (NIXL agent metadata),
  so a peer is only guaranteed to see the registrations made before the ``endpoint()``
  it connected with. After registering more destination memory, hand out a fresh
  endpoint and reconnect (tcp and memory also see later registrations; don't rely on it).
* **Completion callbacks.** ``handle.add_done_callback(fn)`` calls ``fn(handle)`` once
  when the handle becomes final, from the thread that completed it (or at once if it
  already is), so a caller can react without a thread of its own waiting.
* **Timing.** ``handle.started`` is when the transport began moving the bytes (the first
  byte to the socket, the first copy, the engine's post; :meth:`Handle.mark_started`),
  ``handle.finished`` when the handle became final — the span NIXL's xferDuration covers
  for its own transfers. A submit's checks and descriptors come before ``started``.
* **Notices** (``capabilities.notices``). ``submit(peer, plan, notice=b"...")`` hands
  ``notice`` (at most :data:`MAX_NOTICE` bytes) to the handler the *receiving*
  transport set with :meth:`Transport.on_notice`, on one of its threads, after every
  byte of the plan has landed, before the sender's handle is ``DONE`` or, on ``cma``,
  just after (it answers first, keeping the handler off the sender's latency path); a
  refused or failed write delivers nothing. The session layer sends a request's status this way,
  in band, instead of over its control socket. Transports without it raise
  ``ValueError`` for a notice.
* **Empty plans** complete ``DONE`` at once. Zero-length registrations are accepted and
  address nothing.

Adding a transport: subclass :class:`Transport` in ``kvhandoff/transport/<name>.py``, set
``name`` and ``capabilities``, override :meth:`Transport.usable` to say why it cannot run
here (without raising, without side effects), take options as keyword-only ``__init__``
arguments, and list it in ``kvhandoff/transport/registry.py`` (already listed:
``kvhandoff.transport.engines.mooncake:MooncakeTransport``,
``kvhandoff.transport.engines.nixl:NixlTransport``).
The conformance suite builds every available transport with ``create_transport(name)``
(plus short ``io_timeout``/``connect_timeout`` options listed in
``tests/conformance/kvh_conformance.py``), in the test process and in ``multiprocessing``
spawn children, so the defaults must work on one host over 127.0.0.1. Engines that need the
caller to drive progress override ``poll``/``wait``; others complete handles from their
own threads with :meth:`Handle.set_done` / :meth:`Handle.set_failed`.
"""

from __future__ import annotations

import abc
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import ClassVar, NamedTuple, Self, TypeVar

import numpy as np

from kvhandoff.errors import OutOfBounds
from kvhandoff.layout import Layout, MemoryKind, Region, TensorSpec
from kvhandoff.memory import raw_view
from kvhandoff.plan.model import Plan
from kvhandoff.transport.errors import (
    TransferCancelled,
    TransportClosed,
    TransportError,
)
from kvhandoff.transport.regions import U8, RegionTable, plan_side_problem
from kvhandoff.transport.small import plan_views

log = logging.getLogger("kvhandoff.transport")

MAX_NOTICE = 64 << 10
"""The largest notice ``submit`` carries (bytes)."""

NoticeHandler = Callable[[bytes], None]
"""What :meth:`Transport.on_notice` takes: called with each notice's bytes."""

Registrable = Layout | Region | TensorSpec | np.ndarray
"""What ``register`` accepts (or an iterable of these)."""


class TransferState(enum.Enum):
    """Where one submitted transfer stands. ``DONE`` and ``FAILED`` are final."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class Availability(NamedTuple):
    """Whether a transport can run here, and if not, why (a sentence a user can act on)."""

    ok: bool
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """What a transport can do, so the session layer can choose one.

    ``strided``: executes factored pieces (head slices) natively, without flattening
    to one request per segment. ``cross_process`` / ``cross_host``: where peers may
    live. ``needs_allocate``: destinations must come from :meth:`Transport.allocate`
    (shared-memory arenas), not arbitrary registered memory. ``self_completing``: the
    transport finishes every handle from its own threads (done-callbacks fire without
    anyone calling :meth:`Transport.poll` or :meth:`Transport.wait`), so a caller
    tracking many handles need not poll them. ``notices``: ``submit`` can carry a
    notice delivered to the receiver after the plan's bytes landed (module docstring).
    """

    memory: frozenset[MemoryKind] = field(default=frozenset({MemoryKind.HOST}))
    strided: bool = False
    cross_process: bool = True
    cross_host: bool = True
    needs_allocate: bool = False
    self_completing: bool = False
    notices: bool = False


class Handle:
    """Completion of one ``submit``. Thread-safe; waiting uses a condition variable.

    The transport completes it once with :meth:`set_done` or :meth:`set_failed` (the
    first call wins; later ones are ignored and return False). The owner calls
    :meth:`release` when done with it (idempotent): a still-pending transfer is
    cancelled (``FAILED`` with :class:`TransferCancelled`; bytes already on the wire
    may still land) and the transport's ``on_release`` callback runs exactly once.
    """

    __slots__ = ("_callbacks", "_cond", "_error", "_on_release", "_released", "_state",
                 "finished", "moved", "moving", "nbytes", "peer", "started")

    def __init__(self, *, nbytes: int, peer: str = "",
                 on_release: Callable[[Handle], None] | None = None) -> None:
        self.nbytes = nbytes
        self.peer = peer
        self._cond = threading.Condition(threading.Lock())
        self._state = TransferState.PENDING
        self._error: TransportError | None = None
        self._released = False
        self._on_release = on_release
        self._callbacks: list[Callable[[Handle], None]] | None = None
        self.started: float | None = None
        """When the transport began moving the bytes (``time.monotonic()``): the first
        byte written to a socket, the first copy, the engine's post. None until then, and
        for transports that do not say (the caller's submit time is then the best
        guess)."""
        self.finished: float | None = None
        """When the handle became final (``time.monotonic()``)."""
        self.moving: float | None = None
        self.moved: float | None = None
        """When the bytes began and ended moving, timed where they moved, on this
        process's ``time.monotonic()``: set before completion by a transport whose
        receiver moves them (cma's pull; its span leaves out the wake-ups that carry the
        request there and the answer back). None: ``started`` and ``finished`` are that
        span."""

    @classmethod
    def completed(cls, *, nbytes: int = 0, peer: str = "") -> Handle:
        """A handle that is already ``DONE`` (empty plans, synchronous engines)."""
        h = cls(nbytes=nbytes, peer=peer)
        h.set_done()
        return h

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def error(self) -> TransportError | None:
        """Why the transfer failed; None unless ``state`` is ``FAILED``."""
        return self._error

    @property
    def released(self) -> bool:
        return self._released

    def mark_started(self) -> None:
        """The transport is about to move the first byte (the first call counts)."""
        if self.started is None:
            self.started = time.monotonic()

    def set_done(self, at: float | None = None) -> bool:
        """Complete the handle; ``at``: when the transport learnt the bytes had landed
        (``time.monotonic()``), if that was earlier than now."""
        return self._finish(TransferState.DONE, None, at)

    def set_failed(self, error: TransportError) -> bool:
        return self._finish(TransferState.FAILED, error)

    def _finish(self, state: TransferState, error: TransportError | None,
                at: float | None = None) -> bool:
        with self._cond:
            if self._state is not TransferState.PENDING:
                return False
            self._state, self._error = state, error
            self.finished = time.monotonic() if at is None else at
            callbacks, self._callbacks = self._callbacks, None
            self._cond.notify_all()
        for fn in callbacks or ():
            self._run_callback(fn)
        return True

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call ``fn(handle)`` once, when the state becomes final (``DONE`` or ``FAILED``,
        including a cancelling :meth:`release`).

        It runs in the thread that completes the handle (a transport thread, or the
        thread polling an engine in ``wait``), after waiters were woken and outside the
        handle's lock; if the handle is already final it runs now, in this thread.
        Callbacks run in the order they were added. Keep them short and non-blocking:
        they delay the transport's thread. An exception from ``fn`` is logged and
        swallowed (it never breaks the transport)."""
        with self._cond:
            if self._state is TransferState.PENDING:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        self._run_callback(fn)

    def _run_callback(self, fn: Callable[[Handle], None]) -> None:
        try:
            fn(self)
        except Exception:
            log.exception("done-callback %r of %r raised; ignored", fn, self)

    def wait(self, timeout: float) -> TransferState:
        """Block until final or ``timeout`` seconds pass; returns the state then."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while self._state is TransferState.PENDING:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._state

    def result(self, timeout: float) -> None:
        """Wait, then raise the transfer's error if it failed, or ``TimeoutError`` if it is
        still pending after ``timeout`` seconds."""
        state = self.wait(timeout)
        if state is TransferState.FAILED:
            assert self._error is not None
            raise self._error
        if state is TransferState.PENDING:
            raise TimeoutError(f"transfer to {self.peer or 'peer'} still pending after {timeout}s")

    def release(self) -> None:
        with self._cond:
            if self._released:
                return
            self._released = True
            cb, self._on_release = self._on_release, None
        self.set_failed(
            TransferCancelled(f"transfer to {self.peer or 'peer'} released while pending"))
        if cb is not None:
            cb(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<Handle {self._state.value} {self.nbytes} B to {self.peer or '?'}>"


class Peer(abc.ABC):
    """A connection to one remote transport, made by :meth:`Transport.connect`.

    ``close`` is idempotent; transfers still pending to this peer fail with
    :class:`TransportClosed`. A peer is only valid with the transport that made it.
    """

    def __init__(self, endpoint: bytes, name: str) -> None:
        self.endpoint = endpoint
        self.name = name

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}{' closed' if self.closed else ''}>"


PeerT = TypeVar("PeerT", bound=Peer)


class Transport(abc.ABC):
    """Base of every transport; see the module docstring for the contract.

    Subclasses implement :meth:`endpoint`, :meth:`connect`, :meth:`submit`,
    :meth:`_close`, and optionally :meth:`_register_regions` (engine registration).
    The base keeps ``self.local``, a :class:`RegionTable` of the host memory registered
    here, for source bounds checks and numpy views.
    """

    name: ClassVar[str] = "?"
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self) -> None:
        self._reg_lock = threading.Lock()
        self._keepalive: list[np.ndarray] = []
        self._closed = False
        self.local = RegionTable()
        self._notice_handler: NoticeHandler | None = None

    # --- discovery -----------------------------------------------------------------

    @classmethod
    def usable(cls) -> Availability:
        """Whether this transport can run here; never raises, has no side effects."""
        return Availability(True, "built in")

    # --- registration --------------------------------------------------------------

    def register(self, memory: Registrable | Iterable[Registrable]) -> list[Region]:
        """Register memory that plans may read from (sources) or peers may write into
        (destinations). Returns the regions added. Zero-length items are accepted and
        ignored. ndarrays are kept alive by the transport until ``close``; the caller
        keeps raw regions (``Region``/``TensorSpec``) alive. Raises ``ValueError`` for a
        memory kind this transport does not support."""
        self._check_open()
        blocks = list(_blocks(memory))
        for r, _ in blocks:
            if r.memory not in self.capabilities.memory:
                raise ValueError(
                    f"{self.name} transport cannot register {r.memory.value} memory at "
                    f"{r.ptr:#x}; it supports {sorted(m.value for m in self.capabilities.memory)}"
                )
        blocks = [(r, b) for r, b in blocks if r.nbytes > 0]
        regions = [r for r, _ in blocks]
        with self._reg_lock:
            self._register_regions(regions)
            host = [(r, raw_view(r.ptr, r.nbytes) if b is None else b)
                    for r, b in blocks if r.memory is MemoryKind.HOST]
            self.local = self.local.with_regions(host)
            self._keepalive.extend(b for _, b in blocks if b is not None)
        return regions

    def _register_regions(self, regions: list[Region]) -> None:
        """Engine hook: register these (non-empty) regions with the engine. Called under
        the registration lock, before the regions become visible in ``self.local``."""
        del regions  # host-only transports read and write through ``self.local``

    def allocate(self, nbytes: int) -> np.ndarray:
        """A zeroed uint8 host buffer of ``nbytes``, registered here. Transports with
        ``needs_allocate`` return memory peers can map (shared-memory arenas)."""
        buf = np.zeros(nbytes, np.uint8)
        self.register(buf)
        return buf

    # --- the data path -------------------------------------------------------------

    @abc.abstractmethod
    def endpoint(self) -> bytes:
        """What a peer passes to ``connect`` to reach this transport."""

    @abc.abstractmethod
    def connect(self, peer_endpoint: bytes) -> Peer:
        """Connect to a peer (blocking, bounded by the connect timeout). Raises
        :class:`ConnectError` if it cannot be reached or is not a matching transport."""

    @abc.abstractmethod
    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        """Start writing ``plan`` into ``peer``; returns at once. ``notice``: see
        *Notices* in the module docstring. See the class contract."""

    # --- notices -------------------------------------------------------------------

    def on_notice(self, handler: NoticeHandler | None) -> None:
        """Receiving side: call ``handler(notice)`` for every notice a peer's ``submit``
        carried here (from a transport thread, after the plan's bytes landed; keep it
        short: it holds up that connection). ``None`` drops notices. An exception in
        the handler is logged, never raised into the transport. ``ValueError`` when the
        transport has no ``notices`` capability."""
        if not self.capabilities.notices:
            raise ValueError(f"{self.name} transport does not deliver notices")
        self._notice_handler = handler

    def _admit(self, peer: Peer, notice: bytes | None, peer_type: type[PeerT]) -> PeerT:
        """The checks every ``submit`` starts with: the transport is open (else
        ``TransportClosed``), ``notice`` is one it can carry (else ``ValueError``) and
        ``peer`` is one of its own (else ``TypeError``). Returns ``peer`` as its type."""
        self._check_open()
        self._check_notice(notice)
        if not isinstance(peer, peer_type):
            raise TypeError(f"{self.name} transport cannot submit to {peer!r}")
        return peer

    def _check_notice(self, notice: bytes | None) -> None:
        """``ValueError`` unless ``notice`` is None or one this transport can carry."""
        if notice is None:
            return
        if not self.capabilities.notices:
            raise ValueError(f"{self.name} transport does not deliver notices "
                             f"(capabilities.notices is False)")
        if len(notice) > MAX_NOTICE:
            raise ValueError(f"a notice of {len(notice)} B exceeds the {MAX_NOTICE} B limit")

    def _deliver_notice(self, notice: bytes) -> None:
        """Hand a received notice to the handler (never raises)."""
        handler = self._notice_handler
        if handler is None:
            log.debug("%s: notice of %d B dropped: no handler", self.name, len(notice))
            return
        try:
            handler(notice)
        except Exception:
            log.exception("%s: notice handler failed", self.name)

    def poll(self, handle: Handle) -> TransferState:
        """The handle's state now; never blocks."""
        return handle.state

    @property
    def staging_slots_in_use(self) -> int:
        """Slots of this side's staging arena leased to senders or quarantined (0 for a
        transport that does not stage)."""
        return 0

    def wait(self, handle: Handle, timeout: float) -> TransferState:
        """Block until the handle is final or ``timeout`` seconds pass."""
        return handle.wait(timeout)

    def check_sources(self, plan: Plan) -> None:
        """Raise OutOfBounds unless every source byte of ``plan`` is registered here."""
        small = plan_views(plan, self.local, "src", make=False)  # a tiny plan: no numpy
        problem = small if isinstance(small, str) else (
            None if small is not None else plan_side_problem(plan, self.local, "src"))
        if problem is not None:
            raise OutOfBounds(f"{self.name}: {problem} of this transport")

    # --- lifecycle -----------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close peers, stop threads, fail pending handles. Idempotent."""
        with self._reg_lock:
            if self._closed:
                return
            self._closed = True
        self._close()
        self._keepalive.clear()

    @abc.abstractmethod
    def _close(self) -> None:
        """Engine hook for ``close``; runs once."""

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"{self.name} transport is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _blocks(memory: Registrable | Iterable[Registrable]) -> Iterable[tuple[Region, U8 | None]]:
    """Normalise what ``register`` accepts into (Region, keep-alive uint8 view or None)."""
    if isinstance(memory, Layout):
        for r in memory.regions:
            yield r, None
    elif isinstance(memory, Region):
        yield memory, None
    elif isinstance(memory, TensorSpec):
        yield Region(ptr=memory.ptr, nbytes=memory.nbytes, memory=memory.memory,
                     device=memory.device), None
    elif isinstance(memory, np.ndarray):
        if not memory.flags.c_contiguous:
            raise ValueError("register needs C-contiguous arrays")
        raw = memory.reshape(-1).view(np.uint8)
        yield Region(ptr=int(raw.ctypes.data), nbytes=raw.nbytes), raw
    else:
        for m in memory:
            yield from _blocks(m)
