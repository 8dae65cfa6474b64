"""What the engine adapters (``mooncake``, ``nixl``) share.

* :class:`EngineTransport` / :class:`EnginePeer`: the contract around an engine, once:
  source and destination bounds checks at submit, endpoints and connects, the choice
  between the engine's own path and staging (:mod:`kvhandoff.transport.staging`) for
  fragmented plans, and close order. Adapters implement the engine calls.
* :class:`EngineEndpoint`: the bytes one side hands the other, versioned, carrying the
  engine address and the table of regions the side registered, so the *initiator*
  refuses a write outside the peer's memory before the engine sees it.
* :func:`engine_segments`: a plan as the fewest ``(src, dst, length)`` requests that
  each lie inside one registered region on both sides (engines address memory
  region by region; RDMA keys and NIXL descriptors cannot span two).
* :class:`Progress`: polls an engine with backoff sleeps, from a daemon thread or
  from the thread waiting on a handle; an idle transport uses no CPU and a busy one
  never spins a core.

``close`` is bounded by the ``close_timeout`` option (default 5 s): it fails every
pending handle first, then tears down staging and the engine on a daemon thread. That
teardown can wait on peers (posted requests are given a moment to run out, staging's
threads wait on engine writes, an engine's destructor may wait on its connections);
if it has not finished in time, ``close`` finishes this side anyway
(pending handles failed, progress thread stopped), logs a warning naming the peers that
still had work in the engine, and leaves the engine's teardown running on that daemon
thread (arrays registered with the transport stay alive until it ends; memory the
caller registered as raw regions must, too). What no timeout here can bound: an
engine call that blocks while holding the GIL (Mooncake's first contact with a
segment); the Mooncake adapter makes that call in ``connect``, right after the peer
answered a probe, not in ``submit`` or ``close``.
"""

from __future__ import annotations

import abc
import base64
import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from kvhandoff.errors import OutOfBounds
from kvhandoff.layout import MemoryKind, Region
from kvhandoff.plan.model import Plan, Segments
from kvhandoff.transport.base import Availability, Handle, Peer, TransferState, Transport
from kvhandoff.transport.errors import (
    ConnectError,
    RemoteOutOfBounds,
    TransportClosed,
    TransportError,
)
from kvhandoff.transport.regions import RegionTable, plan_side_problem
from kvhandoff.transport.staging import (
    StagedHandle,
    Staging,
    StagingConfig,
    StagingLink,
    host_regions,
)

log = logging.getLogger("kvhandoff.transport")

ENDPOINT_VERSION = 1
_NOBUF = np.zeros(0, np.uint8)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineEndpoint:
    """What a peer needs to reach and address an engine transport.

    ``address`` is the engine's own name for the side (Mooncake session
    ``host:port``, NIXL agent name); ``blob`` is opaque engine metadata (NIXL's agent
    metadata); ``regions`` are ``(ptr, nbytes, memory)`` of every registered block
    at the time :meth:`Transport.endpoint` was called."""

    kind: str
    address: str
    regions: tuple[tuple[int, int, str], ...]
    options: tuple[tuple[str, str], ...] = ()
    blob: bytes = b""
    version: int = ENDPOINT_VERSION

    def encode(self) -> bytes:
        return json.dumps({
            "kind": self.kind,
            "version": self.version,
            "address": self.address,
            "regions": [list(r) for r in self.regions],
            "options": dict(self.options),
            "blob": base64.b64encode(self.blob).decode("ascii"),
        }, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, kind: str) -> EngineEndpoint:
        """Parse and validate; raises :class:`ConnectError` naming what is wrong."""
        try:
            d = json.loads(data)
            ep = cls(
                kind=str(d["kind"]),
                version=int(d["version"]),
                address=str(d["address"]),
                regions=tuple((int(p), int(n), str(MemoryKind(m)))
                              for p, n, m in d["regions"]),
                options=tuple(sorted((str(k), str(v)) for k, v in d["options"].items())),
                blob=base64.b64decode(d["blob"], validate=True),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConnectError(f"not a {kind} transport endpoint: {bytes(data[:80])!r}") from e
        if ep.kind != kind:
            raise ConnectError(f"endpoint is for the {ep.kind!r} transport, not {kind!r}")
        if ep.version != ENDPOINT_VERSION:
            raise ConnectError(
                f"{kind} endpoint version {ep.version}; this kvhandoff speaks {ENDPOINT_VERSION}")
        if any(p < 0 or n < 0 for p, n, _ in ep.regions):
            raise ConnectError(f"{kind} endpoint advertises a negative region: {ep.regions}")
        return ep

    def table(self) -> RegionTable:
        """The advertised regions as a table (bounds checks only: no views)."""
        try:
            return RegionTable((Region(ptr=p, nbytes=n, memory=MemoryKind(m)), _NOBUF)
                               for p, n, m in self.regions)
        except ValueError as e:  # overlapping regions: a malformed endpoint
            raise ConnectError(f"{self.kind} endpoint {self.address}: {e}") from e


def add_regions(table: RegionTable, regions: Iterable[Region]) -> RegionTable:
    """``table`` plus ``regions`` (any memory kind), for bounds checks only."""
    return table.with_regions((r, _NOBUF) for r in regions)


def describe_regions(regions: Iterable[Region]) -> tuple[tuple[int, int, str], ...]:
    return tuple((r.ptr, r.nbytes, str(r.memory)) for r in regions)


def _inside(addr: np.ndarray, length: np.ndarray, table: RegionTable) -> np.ndarray:
    """Per segment: does ``[addr, addr+length)`` lie inside one region of ``table``?"""
    if not len(table):
        return np.zeros(len(addr), bool)
    starts = np.array([r.ptr for r in table.regions], np.int64)
    ends = starts + np.array([r.nbytes for r in table.regions], np.int64)
    i = np.searchsorted(starts, addr, side="right") - 1
    ok: np.ndarray = (i >= 0) & (addr + length <= ends[np.maximum(i, 0)])
    return ok


def engine_segments(plan: Plan, src: RegionTable, dst: RegionTable) -> Segments:
    """The plan's bytes as coalesced, non-empty segments, each inside one region on
    both sides. The caller has already bounds-checked both sides of the plan (so every
    tensor's segments lie in one region each side).

    Coalescing across tensors (a layer's K and V contiguous on both sides) is kept
    unless a merged segment would straddle two adjacent registered regions."""
    parts = plan.entry_runs()
    segs = parts[0] if len(parts) == 1 else Segments.concat(parts)
    if len(parts) > 1:
        merged = segs.coalesce()
        if len(merged) == len(segs) or (_inside(merged.src, merged.length, src).all()
                                        and _inside(merged.dst, merged.length, dst).all()):
            segs = merged
    keep = segs.length > 0
    if not keep.all():
        segs = Segments(segs.src[keep], segs.dst[keep], segs.length[keep])
    return segs


class Progress:
    """Drives an engine that needs polling, without spinning a core.

    ``step() -> (progressed, busy)`` polls the engine once (thread-safe; it takes the
    transport's lock): ``busy`` means work is still in flight. A daemon thread calls it
    while work is in flight, sleeping ``min_sleep`` after a round that made progress
    and growing by half up to ``max_sleep`` after one that did not; with nothing in
    flight it blocks on a condition until :meth:`kick` (an idle transport uses no CPU).
    While a caller is in :meth:`wait`, that caller polls instead (a completion is seen
    without a thread hand-off) and the thread stands back. If ``step`` raises,
    ``on_crash(exc)`` fails every pending handle and the thread exits, loudly.
    """

    def __init__(self, name: str, step: Callable[[], tuple[bool, bool]],
                 on_crash: Callable[[BaseException], None], *,
                 min_sleep: float = 20e-6, max_sleep: float = 1e-3, spin: float = 200e-6) -> None:
        self._step = step
        self._on_crash = on_crash
        self._min, self._max, self._spin = min_sleep, max_sleep, spin
        self._cond = threading.Condition(threading.Lock())
        self._kicked = False
        self._stopping = False
        self._waiters = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def kick(self) -> None:
        """New work: poll now (wakes an idle or backing-off thread)."""
        with self._cond:
            self._kicked = True
            self._cond.notify()

    def wait(self, handle: Handle, timeout: float) -> TransferState:
        """Poll from this thread until ``handle`` is final or ``timeout`` passes:
        back-to-back for the first ``spin`` seconds (a sleep costs ~100 µs on a VM),
        then with the same backoff as the thread."""
        start = time.monotonic()
        deadline = start + max(0.0, timeout)
        delay = self._min
        busy = True  # unknown until polled
        with self._cond:
            self._waiters += 1
        try:
            while handle.state is TransferState.PENDING and not self._stopping:
                progressed, busy = self._step()
                now = time.monotonic()
                if handle.state is not TransferState.PENDING or now >= deadline:
                    break
                if now - start < self._spin:
                    time.sleep(0)
                    continue
                delay = self._min if progressed else min(delay * 1.5, self._max)
                time.sleep(min(delay, deadline - now))
        finally:
            with self._cond:
                self._waiters -= 1
                if busy:  # the thread resumes polling what is left (if nothing is left,
                    self._kicked = True  # waking it only contends for the lock and GIL)
                    self._cond.notify()
        if handle.state is TransferState.PENDING and self._stopping:
            return handle.wait(max(0.0, deadline - time.monotonic()))
        return handle.state

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        delay, busy = self._min, False
        try:
            while True:
                with self._cond:
                    if (busy or self._waiters) and not self._kicked:
                        self._cond.wait(delay if not self._waiters else self._max)
                    while not busy and not self._kicked and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                    kicked, self._kicked = self._kicked, False
                    if self._waiters and not kicked:
                        continue  # a waiter is polling
                progressed, busy = self._step()
                delay = self._min if (progressed or kicked) else min(delay * 1.5, self._max)
        except BaseException as e:  # report, never die silently
            log.exception("transport progress thread %s crashed", self._thread.name)
            self._on_crash(e)


_env_lock = threading.Lock()


@contextlib.contextmanager
def applied_env(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` around an engine's construction (engines read their environment
    then), under one process-wide lock, and restore the previous values afterwards."""
    with _env_lock:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def probe_package(*, module: str, distribution: str, hint: str, load: Callable[[], None],
                  detail: str = "") -> Availability:
    """Whether ``module`` (from the ``distribution`` wheel) is installed and ``load()``
    (which imports it, raising ImportError with the reason) succeeds: the reason names
    the version when it does, what is missing and ``hint`` (how to install) when not."""
    if importlib.util.find_spec(module) is None:
        return Availability(False, f"{distribution} is not installed: {hint}")
    try:
        load()
    except ImportError as e:
        return Availability(False, f"{module} does not load ({e}): {hint}")
    try:
        v = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        v = "?"
    return Availability(True, f"{distribution} {v}{detail}")


class CachedAvailability:
    """``probe()`` run once, on first use, then remembered (thread-safe)."""

    def __init__(self, probe: Callable[[], Availability]) -> None:
        self._probe = probe
        self._value: Availability | None = None
        self._lock = threading.Lock()

    def __call__(self) -> Availability:
        with self._lock:
            if self._value is None:
                self._value = self._probe()
            return self._value


class EnginePeer(Peer):
    """A connection to one engine transport: the regions it advertised (destinations
    are checked against them here, before the engine sees a request) and its staging
    link (None: every plan goes through the engine directly). ``close`` is
    idempotent: it closes the link, then lets the transport fail what is pending."""

    def __init__(self, endpoint: bytes, name: str, table: RegionTable,
                 on_close: Callable[[EnginePeer], None]) -> None:
        super().__init__(endpoint, name)
        self.table = table
        self.host_table = host_regions(table)
        self.link: StagingLink | None = None
        self._closed = False
        self._on_close = on_close

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.link is not None:
            self.link.close()
        self._on_close(self)


class EngineTransport(Transport):
    """Base of the engine adapters. Subclasses implement the engine calls
    (``_engine_register``, ``_describe``, ``_connect_engine``, ``_submit_segments``,
    ``_step``, ``_crashed``, ``_close_engine``), set ``peer_type``, and start
    ``self._progress`` (a :class:`Progress` over ``_step``) once the engine exists.

    ``self._all`` holds every region registered through :meth:`register` (device
    memory included), for source checks and the endpoint's region table; memory that
    staging registers with the engine is in neither. Options every engine takes:
    ``host`` (the address peers reach this side's control channel at), ``io_timeout``,
    ``connect_timeout``, ``close_timeout`` (seconds ``close`` waits for the engine's
    own teardown before leaving it to a daemon thread; see the module docstring),
    ``staging`` (``True``: :attr:`staging_defaults`; ``False``: off; or a
    :class:`~kvhandoff.transport.staging.StagingConfig`) and ``data_secret`` (the
    deployment secret's data-plane key: staging's control channel is then keyed with
    HMAC(``data_secret``, token), as tcp's is; None: the token alone)."""

    peer_type: ClassVar[type[EnginePeer]]
    staging_defaults: ClassVar[StagingConfig] = StagingConfig()
    _progress: Progress  # started by the subclass once its engine exists

    def __init__(self, *, host: str, io_timeout: float, connect_timeout: float,
                 staging: StagingConfig | bool, close_timeout: float = 5.0,
                 data_secret: bytes | None = None) -> None:
        if not close_timeout > 0:
            raise ValueError(f"{self.name} needs a positive close_timeout, got {close_timeout}")
        super().__init__()
        self._io_timeout, self._connect_timeout = io_timeout, connect_timeout
        self._close_timeout = close_timeout
        self._all = RegionTable()  # every registered region, device memory included
        config = staging if isinstance(staging, StagingConfig) else replace(
            self.staging_defaults, enabled=bool(staging))
        if not config.enabled:  # head slices would go one request per row
            self.capabilities = replace(self.capabilities, strided=False)  # type: ignore[misc]
        self._staging = Staging(self.name, config, register=self._register_staging,
                                write=self._write, wait=self.wait, table=lambda: self.local,
                                host=host, io_timeout=io_timeout,
                                connect_timeout=connect_timeout, data_secret=data_secret)

    # --- what an adapter implements -------------------------------------------------

    @abc.abstractmethod
    def _engine_register(self, regions: list[Region]) -> None:
        """Register these regions with the engine (raise ValueError naming the region
        if it refuses); they are deregistered by ``_close_engine``."""

    @abc.abstractmethod
    def _describe(self) -> tuple[str, bytes, tuple[tuple[str, str], ...]]:
        """``(address, blob, options)`` for this side's endpoint (after staging
        registered its arena, so engine metadata in ``blob`` includes it)."""

    @abc.abstractmethod
    def _connect_engine(self, ep: EngineEndpoint, raw: bytes) -> EnginePeer:
        """Reach the peer through the engine (bounded; ConnectError if it cannot)."""

    @abc.abstractmethod
    def _submit_segments(self, peer: EnginePeer, segs: Segments, nbytes: int, *,
                         host_only: bool) -> Handle:
        """Start writing ``segs`` (validated; each inside one region both sides) to
        ``peer``. ``host_only``: both sides are staging buffers (host memory outside
        ``self._all`` and ``peer.table``)."""

    @abc.abstractmethod
    def _step(self) -> tuple[bool, bool]:
        """Poll the engine once: ``(progressed, busy)`` (see :class:`Progress`)."""

    @abc.abstractmethod
    def _crashed(self, exc: BaseException) -> None:
        """The progress thread died: fail everything pending."""

    @abc.abstractmethod
    def _fail_pending(self, error: TransportError) -> None:
        """Fail every pending handle with ``error`` and send nothing more; requests
        already in the engine may run out (``_close_engine`` reaps them)."""

    @abc.abstractmethod
    def _abandon(self, error: TransportError) -> list[str]:
        """``close`` gave up waiting for the engine: fail every pending handle with
        ``error`` without waiting for the engine (nor for a lock a thread stuck in it
        may hold); returns the names of the peers that still had work in the engine."""

    @abc.abstractmethod
    def _close_engine(self) -> None:
        """Fail what is pending, let posted requests finish (bounded), stop the
        progress thread, deregister memory and drop the engine."""

    # --- registration & endpoints ---------------------------------------------------

    def _register_regions(self, regions: list[Region]) -> None:
        self._engine_register(regions)
        self._all = add_regions(self._all, regions)

    def _register_staging(self, region: Region) -> None:
        with self._reg_lock:
            self._check_open()
            self._engine_register([region])

    def check_sources(self, plan: Plan) -> None:
        problem = plan_side_problem(plan, self._all, "src")
        if problem is not None:
            raise OutOfBounds(f"{self.name}: {problem} of this side")

    def endpoint(self) -> bytes:
        self._check_open()
        staging = self._staging.advertise()
        address, blob, options = self._describe()
        return EngineEndpoint(kind=self.name, address=address,
                              regions=describe_regions(self._all.regions),
                              options=options + staging, blob=blob).encode()

    def connect(self, peer_endpoint: bytes) -> EnginePeer:
        self._check_open()
        ep = EngineEndpoint.decode(peer_endpoint, self.name)
        peer = self._connect_engine(ep, peer_endpoint)
        try:
            peer.link = self._staging.connect(dict(ep.options), peer)
        except BaseException:
            peer.close()
            raise
        return peer

    # --- the data path ---------------------------------------------------------------

    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        peer = self._admit(peer, notice, self.peer_type)
        if peer.closed:
            raise TransportClosed(f"peer {peer.name} is closed")
        self.check_sources(plan)
        nbytes = plan.nbytes
        if not nbytes:
            return Handle.completed(peer=peer.name)
        problem = plan_side_problem(plan, peer.table, "dst")
        if problem is not None:
            h = Handle(nbytes=nbytes, peer=peer.name)
            h.set_failed(RemoteOutOfBounds(f"{peer.name} refused the write: {problem}"))
            return h
        if peer.link is not None and self._staging.wants(plan, peer.host_table):
            return peer.link.submit(plan)
        return self._submit_segments(peer, engine_segments(plan, self._all, peer.table),
                                     nbytes, host_only=False)

    def _write(self, peer: Peer, src: int, dst: int, nbytes: int) -> Handle:
        """One engine write between two staging buffers (for :class:`StagingLink`)."""
        assert isinstance(peer, EnginePeer)
        one = np.array([nbytes], np.int64)
        return self._submit_segments(peer, Segments(np.array([src], np.int64),
                                                    np.array([dst], np.int64), one),
                                     nbytes, host_only=True)

    @property
    def staging_slots_in_use(self) -> int:
        return self._staging.slots_in_use

    def wait(self, handle: Handle, timeout: float) -> TransferState:
        """Block until final or ``timeout``, polling the engine from this thread
        (staged handles complete from the link's threads: just wait)."""
        if isinstance(handle, StagedHandle):
            return handle.wait(timeout)
        return self._progress.wait(handle, timeout)

    @property
    def staging(self) -> StagingConfig:
        return self._staging.config

    def _close(self) -> None:
        """Bounded by ``close_timeout`` (see the module docstring)."""
        closed = TransportClosed(f"{self.name} transport closed")
        finished = threading.Event()
        keep = list(self._keepalive)  # registered arrays outlive the engine, even abandoned

        def teardown() -> None:
            try:
                self._staging.abandon(closed)  # staged submits fail as closed, not lost
                self._fail_pending(closed)  # staging's engine writes fail: its threads exit
                self._staging.close()
                self._close_engine()
            except Exception:
                log.exception("%s: closing the engine failed", self.name)
            finally:
                finished.set()
                keep.clear()

        threading.Thread(target=teardown, name=f"kvhandoff-{self.name}-close",
                         daemon=True).start()
        if finished.wait(self._close_timeout):
            return
        peers = self._abandon(closed)
        self._staging.abandon(closed)
        self._progress.stop(timeout=0.5)
        log.warning("%s: the engine's teardown did not finish within close_timeout=%ss "
                    "(peers with work in flight: %s; a frozen or unreachable peer?); every "
                    "pending handle failed and the teardown goes on in a daemon thread",
                    self.name, self._close_timeout, ", ".join(peers) or "none")
