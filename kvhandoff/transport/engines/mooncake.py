"""Mooncake Transfer Engine: TCP here, RDMA where the hardware exists; P2P handshake.

Install (``make venv`` picks the wheel by host, ``make system-deps`` the Debian packages):

* without an NVIDIA GPU: ``pip install 'kvhandoff[mooncake]'``, the
  ``mooncake-transfer-engine-non-cuda`` wheel, whose ``engine.so`` links only
  ``libibverbs.so.1``, ``libnuma.so.1`` and ``libcurl.so.4`` (Debian main: ``libibverbs1
  libnuma1 libcurl4``, ``libcurl4t64`` on Debian 13);
* with one: ``pip install 'kvhandoff[mooncake-cuda]'``, the ``mooncake-transfer-engine``
  wheel, which also links ``libmlx5.so.1`` (``ibverbs-providers``), ``libcuda.so.1`` (the
  NVIDIA driver's) and ``libcudart.so.12``; that comes from the
  ``nvidia-cuda-runtime-cu12`` wheel and this module preloads it, so no
  ``LD_LIBRARY_PATH`` is needed.

Both wheels install the same ``mooncake`` package: one per environment.

How the engine is driven, and why (measured in ``reference/baselines.md``):

* One ``TransferEngine`` per transport, ``initialize(host, "P2PHANDSHAKE", protocol,
  device)``: no metadata service; a peer is addressed by its session ``host:rpc_port``.
* The TCP transport holds at most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` requests
  (+ as many pending admissions) per peer; one more and the request is rejected *and
  the engine stays broken for that peer*. The env is read when the engine is built, so
  it is set (under a lock) around construction, and this module never has more than
  ``max_inflight`` requests outstanding per peer, at most that queue size.
* The sync calls and ``get_batch_transfer_status`` busy-poll a core. Instead every
  coalesced segment is its own one-request async batch, and a progress thread checks
  the oldest ones with ``transfer_check_status`` (non-blocking; it only looks at task 0,
  which is why batches hold one request), sleeping 50 µs..2 ms between rounds and not
  at all (blocked on a condition) when idle. The engine runs ~28 k requests/s over
  TCP whatever their size, so coalescing is what makes it fast.
* Engine results are negative ints; they are mapped to :mod:`kvhandoff.transport.errors`
  in :func:`_error` and nowhere else.

* The engine's first contact with a peer's segment (a handshake) blocks *holding the
  GIL* until the peer answers, ~60 s for a frozen peer, stalling every thread of the
  process. ``connect`` therefore opens the segment itself, right after the peer
  answered a probe (which releases the GIL and is bounded), so ``submit``, the
  progress thread and ``close`` never make that first contact.
* ``close`` is bounded by ``close_timeout`` (default 5 s): the engine's destructor joins
  threads that may be blocked on TCP to a frozen peer; past the timeout it is left to
  a daemon thread (see :mod:`kvhandoff.transport.engines.common`).

The endpoint carries the session and the registered region table; ``submit`` refuses a
plan with any destination byte outside the peer's advertised regions before anything
is sent. (The TCP server checks again on its side.) Regions the peer registers after
handing out its endpoint are unknown here until ``connect`` is called again.

Authentication: Mooncake's own data plane (its engine's TCP or RDMA connections) is not
authenticated by kvhandoff. What protects it is that only memory registered with the
engine is reachable, and that the descriptors naming it (the endpoint, each request's
destinations) travel over the authenticated control plane. The staging channel is
kvhandoff's, and authenticated like tcp's data plane: a mutual challenge–response keyed
with its endpoint token, or with HMAC(``data_secret``, token) when the deployment
secret's data-plane key is given (:mod:`kvhandoff.transport.staging`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import shutil
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from kvhandoff.layout import MemoryKind, Region
from kvhandoff.plan.model import Segments
from kvhandoff.transport.base import Availability, Capabilities, Handle, TransferState
from kvhandoff.transport.engines.common import (
    CachedAvailability,
    EngineEndpoint,
    EnginePeer,
    EngineTransport,
    Progress,
    applied_env,
    probe_package,
)
from kvhandoff.transport.engines.cudart import preload_cudart
from kvhandoff.transport.errors import (
    ConnectError,
    PeerLost,
    TransportClosed,
    TransportError,
    TransportUnavailable,
)
from kvhandoff.transport.regions import RegionTable
from kvhandoff.transport.staging import StagingConfig

__all__ = ["MooncakeTransport", "available"]

CPU_DIST = "mooncake-transfer-engine-non-cuda"
CUDA_DIST = "mooncake-transfer-engine"
CPU_HINT = ("pip install 'kvhandoff[mooncake]' (mooncake-transfer-engine-non-cuda) and run "
            "`make system-deps` (scripts/system-deps.sh: Debian main libibverbs1 libnuma1 "
            "libcurl4, libcurl4t64 on Debian 13)")
CUDA_HINT = ("pip install 'kvhandoff[mooncake-cuda]' (mooncake-transfer-engine, "
             "nvidia-cuda-runtime-cu12) and run `make system-deps` (scripts/system-deps.sh: "
             "Debian libibverbs1 ibverbs-providers libnuma1 libcurl4; libcuda.so.1 from the "
             "NVIDIA driver, else Debian non-free libcuda1)")
_SWITCH_HINT = ("; this host has no NVIDIA GPU, so use the non-CUDA wheel instead: `make venv` "
                "switches .venv (or pip uninstall mooncake-transfer-engine "
                "nvidia-cuda-runtime-cu12, then " + CPU_HINT + ")")

# Mooncake's error.h, for messages. Any other negative value is reported as is.
_CODES: dict[int, str] = {
    -1: "invalid argument", -2: "too many requests", -3: "address not registered",
    -4: "batch busy", -6: "device not found", -7: "address overlapped",
    -8: "not a local segment", -101: "DNS failure", -102: "socket error",
    -103: "malformed JSON", -104: "handshake rejected", -200: "metadata error",
    -201: "endpoint error", -202: "context error", -300: "NUMA error", -301: "clock error",
    -302: "memory error", -303: "not implemented",
}
_TCP_QUEUE_MAX = 65535  # the engine rejects larger queue sizes
_SCAN = 128  # in-flight requests checked per progress round
_ACCEPT_TIMEOUT_US = 100_000  # see _quick_teardown

log = logging.getLogger("kvhandoff.transport")


def _describe(code: int) -> str:
    return f"{code} ({_CODES.get(code, 'engine error')})"


def _status_error(rc: int, session: str) -> TransportError:
    """The one place a request's engine status becomes an error (``transfer_check_status``
    -1 FAILED, -2 TIMEOUT). Destinations were bounds-checked against the peer's table
    before sending, so a failure is its connection going away (the engine does not say
    which; its log does)."""
    what = "timed out" if rc == -2 else "failed"
    return PeerLost(f"mooncake write to {session} {what} (status {rc}: connection lost or "
                    f"the peer refused the write)")


def _gpu_host() -> bool:
    """Whether this host has an NVIDIA GPU: the test scripts/mooncake-wheel.sh makes (for
    the Makefile) when KVHANDOFF_MOONCAKE_WHEEL does not override it."""
    return Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None


def _installed() -> list[str]:
    """The Mooncake wheels installed here (normally one; empty for none or a source build)."""
    found = []
    for dist in (CPU_DIST, CUDA_DIST):
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.append(dist)
    return found


def _load(dist: str | None) -> None:
    """Import the engine; the CUDA wheel's (or a source build's) needs libcudart first."""
    if dist != CPU_DIST:
        problem = preload_cudart()
        if problem is not None and dist == CUDA_DIST:
            raise ImportError(problem)
    import mooncake.engine  # noqa: F401


def _probe() -> Availability:
    wheels = _installed()
    if len(wheels) > 1:
        return Availability(False, f"{CPU_DIST} and {CUDA_DIST} are both installed; they "
                            f"install the same `mooncake` package, so keep one: `make -B venv` "
                            f"reinstalls the right one for this host")
    gpu = _gpu_host()
    dist = wheels[0] if wheels else None
    if dist == CPU_DIST:
        hint = CPU_HINT
    elif dist == CUDA_DIST:
        hint = CUDA_HINT if gpu else CUDA_HINT + _SWITCH_HINT
    else:  # nothing installed (or a source build): what this host should get
        hint = CUDA_HINT if gpu else CPU_HINT
    wanted = dist or (CUDA_DIST if gpu else CPU_DIST)
    return probe_package(module="mooncake", distribution=wanted, hint=hint,
                         load=lambda: _load(dist))


available = CachedAvailability(_probe)
"""Whether the engine imports here, and if not, how to install it. Cached; the only
side effect is loading the shared libraries (no engine, thread or socket)."""


def _quick_teardown(session: str, port: int, probe: Callable[[str], int]) -> None:
    """Make the engine's destructor take ~0.1 s instead of ~1 s.

    Its handshake daemon blocks in ``accept`` with a 1 s ``SO_RCVTIMEO`` and the
    destructor joins it, holding the GIL (measured: 1.0 s per engine, every thread of
    the process stalled). Lowering the listening socket's timeout to 100 ms and
    waking the daemon once with a probe to itself (so its next ``accept`` uses the new
    value) bounds that. Costs ten ``accept`` wake-ups per second while idle. Best
    effort: any surprise leaves the engine as it was."""
    timeo = struct.pack("ll", 0, _ACCEPT_TIMEOUT_US)
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = os.dup(int(name))
        except (OSError, ValueError):
            continue
        try:
            s = socket.socket(fileno=fd)
        except OSError:  # not a socket
            os.close(fd)
            continue
        with s:
            try:
                if (s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM
                        and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                        and s.getsockname()[1] == port):
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeo)
                    probe(session)
                    return
            except OSError:
                continue


@dataclass(slots=True, eq=False)
class _Job:
    """One submit: its segments, how many are sent, how many are still in flight."""

    handle: Handle
    peer: MooncakePeer
    src: list[int]
    dst: list[int]
    length: list[int]
    sent: int = 0
    outstanding: int = 0
    stopped: bool = False  # failed, cancelled or closed: send nothing more

    def finish_if_done(self) -> None:
        if not self.stopped and self.sent == len(self.src) and self.outstanding == 0:
            self.stopped = True
            self.handle.set_done()

    def fail(self, error: TransportError) -> None:
        if not self.stopped:
            self.stopped = True
            self.handle.set_failed(error)


@dataclass(slots=True, eq=False)
class _Lane:
    """Everything in flight to one peer session (the engine's per-peer queue)."""

    session: str
    queue: deque[_Job] = field(default_factory=deque)
    inflight: list[tuple[int, _Job]] = field(default_factory=list)
    last_progress: float = 0.0
    lost: PeerLost | None = None


class MooncakePeer(EnginePeer):
    def __init__(self, endpoint: bytes, session: str, table: RegionTable,
                 on_close: Callable[[EnginePeer], None]) -> None:
        super().__init__(endpoint, f"mooncake:{session}", table, on_close)
        self.session = session


class MooncakeTransport(EngineTransport):
    """Mooncake TE adapter. Thread-safe (one lock around engine state; one progress
    thread). Options (keyword-only):

    ``protocol``: ``"tcp"`` (default) or ``"rdma"``; ``host``: the address peers use to
    reach this side (default 127.0.0.1); ``device``: RDMA NIC names, comma-separated
    (``""`` = auto); ``max_inflight``: requests outstanding per peer (default 1024, the
    engine's default queue; raised up to 65535 together with the engine env);
    ``io_timeout``: seconds without a completion before a peer is declared lost
    (default 30); ``connect_timeout`` (default 5); ``env``: extra ``MC_*`` variables
    for the engine (e.g. ``MC_TCP_LANES_PER_PEER``), applied around its construction;
    ``close_timeout``: seconds ``close`` waits for the engine's teardown (default 5);
    ``cuda``: also accept CUDA memory (registered as ``cuda:<device>``; untested here);
    ``staging``: see :class:`~kvhandoff.transport.engines.common.EngineTransport` (over TCP
    the engine runs ~28 k requests/s whatever their size, so plans averaging under
    128 KiB per segment are staged; over RDMA under 16 KiB); ``data_secret``: the
    deployment secret's data-plane key, keying the staging channel's handshake (see the
    module docstring; :func:`~kvhandoff.transport.registry.create_transport` passes it).
    """

    name: ClassVar[str] = "mooncake"
    capabilities: ClassVar[Capabilities] = Capabilities(  # strided by staging
        strided=True, self_completing=True)
    peer_type = MooncakePeer
    staging_defaults = StagingConfig(below=128 << 10)

    def __init__(self, *, protocol: str = "tcp", host: str = "127.0.0.1", device: str = "",
                 max_inflight: int = 1024, io_timeout: float = 30.0,
                 connect_timeout: float = 5.0, env: Mapping[str, str] | None = None,
                 cuda: bool = False, staging: StagingConfig | bool = True,
                 close_timeout: float = 5.0, data_secret: bytes | None = None) -> None:
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if not 1 <= max_inflight <= _TCP_QUEUE_MAX or io_timeout <= 0 or connect_timeout <= 0:
            raise ValueError(
                f"mooncake needs 1 <= max_inflight <= {_TCP_QUEUE_MAX} and positive timeouts; "
                f"got max_inflight={max_inflight}, io_timeout={io_timeout}, "
                f"connect_timeout={connect_timeout}")
        ok, reason = available()
        if not ok:
            raise TransportUnavailable(reason)
        if protocol == "rdma" and staging is True:
            staging = StagingConfig(below=16 << 10)
        super().__init__(host=host, io_timeout=io_timeout, connect_timeout=connect_timeout,
                         staging=staging, close_timeout=close_timeout,
                         data_secret=data_secret)
        if cuda:  # per instance: whether device memory is wanted is the caller's choice
            self.capabilities = replace(  # type: ignore[misc]
                self.capabilities, memory=frozenset(MemoryKind))
        self._protocol, self._host = protocol, host
        self._te, self._window = self._make_engine(protocol, host, device, max_inflight,
                                                   dict(env or {}))
        self._session = f"{host}:{self._te.get_rpc_port()}"
        with contextlib.suppress(Exception):  # best effort; see the function
            _quick_teardown(self._session, self._te.get_rpc_port(), self._te.send_probe)
        self._lock = threading.Lock()
        self._lanes: dict[str, _Lane] = {}
        self._registered: list[int] = []
        self._progress = Progress(f"kvhandoff-mooncake-{self._session}", self._step,
                                  self._crashed)

    @classmethod
    def usable(cls) -> Availability:
        return available()

    @staticmethod
    def _make_engine(protocol: str, host: str, device: str, max_inflight: int,
                     extra: dict[str, str]) -> tuple[Any, int]:
        """Build and initialize the engine with its env set; returns it and the window."""
        from mooncake.engine import TransferEngine

        env = dict(extra)
        user_q = env.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER",
                         os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"))
        try:  # a queue configured by the user bounds our window; otherwise we size it
            window = min(max_inflight, int(user_q)) if user_q else max_inflight
        except ValueError:
            window = min(max_inflight, 1024)
        env.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", str(window))
        env.setdefault("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", str(window))
        with applied_env(env):
            te = TransferEngine()
            rc = te.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransportUnavailable(
                f"mooncake engine initialize({host!r}, P2PHANDSHAKE, {protocol!r}, "
                f"{device!r}) failed: {_describe(rc)}")
        return te, window

    # --- registration & endpoints ---------------------------------------------------

    def _engine_register(self, regions: list[Region]) -> None:
        for r in regions:
            location = f"cuda:{r.device}" if r.memory is MemoryKind.CUDA else "cpu:0"
            rc = self._te.register_memory(r.ptr, r.nbytes, location)
            if rc != 0:
                raise ValueError(
                    f"mooncake could not register {r.memory.value} memory [{r.ptr:#x}, "
                    f"+{r.nbytes}): {_describe(rc)}")
            self._registered.append(r.ptr)

    def _describe(self) -> tuple[str, bytes, tuple[tuple[str, str], ...]]:
        return self._session, b"", (("protocol", self._protocol),)

    def _connect_engine(self, ep: EngineEndpoint, raw: bytes) -> MooncakePeer:
        theirs = dict(ep.options).get("protocol")
        if theirs != self._protocol:
            raise ConnectError(
                f"mooncake peer {ep.address} speaks {theirs!r}, this side {self._protocol!r}")
        table = ep.table()
        self._probe(ep.address)
        self._open_segment(ep.address)
        with self._lock:
            lane = self._lanes.get(ep.address)
            if lane is not None and lane.lost is not None:
                lane.lost = None  # reconnect after a loss: accept work again
                lane.last_progress = time.monotonic()
        return MooncakePeer(raw, ep.address, table, self._peer_closed)

    def _peer_closed(self, peer: EnginePeer) -> None:
        """Fail what is pending to ``peer``; requests already in the engine run out."""
        assert isinstance(peer, MooncakePeer)
        error = TransportClosed(f"peer {peer.name} was closed")
        with self._lock:
            lane = self._lanes.get(peer.session)
            if lane is None:
                return
            for job in lane.queue:
                if job.peer is peer:
                    job.fail(error)
            for _, job in lane.inflight:
                if job.peer is peer:
                    job.fail(error)

    def _probe(self, session: str) -> None:
        """Check the peer answers its handshake port, bounded by ``connect_timeout``."""
        probe = getattr(self._te, "send_probe", None)
        if probe is None:
            return  # older engines: the first transfer does the handshake
        result: list[int] = []
        t = threading.Thread(target=lambda: result.append(probe(session)), daemon=True,
                             name=f"kvhandoff-mooncake-probe-{session}")
        t.start()
        t.join(self._connect_timeout)
        if not result:
            raise ConnectError(f"mooncake peer {session} did not answer within "
                               f"{self._connect_timeout}s")
        if result[0] != 0:
            raise ConnectError(f"mooncake peer {session} unreachable: {_describe(result[0])}")

    def _open_segment(self, session: str) -> None:
        """Have the engine fetch (and cache) the peer's segment now, while the probe
        that just answered says the peer is alive: this call holds the GIL until the
        peer replies (see the module docstring), so it must not happen in ``submit``."""
        opener = getattr(self._te, "get_first_buffer_address", None)
        if opener is None:
            return  # older engines: the first transfer opens it
        with self._lock:
            self._check_open()
            try:
                opener(session)  # returns 0 when the peer registered nothing yet: fine
            except Exception as e:  # the engine raises its own types
                raise ConnectError(f"mooncake could not open {session}'s segment: {e!r}"
                                   ) from e

    # --- the data path ---------------------------------------------------------------

    def _submit_segments(self, peer: EnginePeer, segs: Segments, nbytes: int, *,
                         host_only: bool) -> Handle:
        assert isinstance(peer, MooncakePeer)
        handle = Handle(nbytes=nbytes, peer=peer.name)  # release: _fill sees it final
        job = _Job(handle, peer, segs.src.tolist(), segs.dst.tolist(), segs.length.tolist())
        with self._lock:
            self._check_open()
            lane = self._lanes.setdefault(peer.session, _Lane(peer.session))
            if lane.lost is not None:
                job.fail(PeerLost(f"{peer.name}: {lane.lost}"))
                return handle
            if not lane.inflight:
                lane.last_progress = time.monotonic()
            lane.queue.append(job)
            self._fill(lane, limit=64)  # start at once; the progress thread sends the rest
        self._progress.kick()
        return handle

    def _fill(self, lane: _Lane, limit: int) -> bool:
        """Send queued segments while the lane has room (caller holds the lock)."""
        sent = 0
        te, session = self._te, lane.session
        while lane.queue and len(lane.inflight) < self._window and sent < limit:
            job = lane.queue[0]
            if job.stopped or job.handle.state is not TransferState.PENDING or job.peer.closed:
                if job.peer.closed:
                    job.fail(TransportClosed(f"peer {job.peer.name} was closed"))
                job.stopped = True
                lane.queue.popleft()
                continue
            i = job.sent
            job.handle.mark_started()
            bid = te.batch_transfer_async_write(session, [job.src[i]], [job.dst[i]],
                                                [job.length[i]])
            if not 0 < bid < 1 << 63:  # 0 / -1: opening the peer's segment or submit failed
                job.fail(PeerLost(f"mooncake could not submit to {session} (segment open or "
                                  f"submit refused; the engine log says why)"))
                lane.queue.popleft()
                continue
            lane.inflight.append((bid, job))
            job.sent += 1
            job.outstanding += 1
            sent += 1
            if job.sent == len(job.src):
                lane.queue.popleft()
        return sent > 0

    def _reap(self, lane: _Lane, now: float) -> bool:
        """Collect finished requests among the oldest ``_SCAN`` in flight (caller holds
        the lock). Requests spread over several TCP lanes, so they finish roughly but
        not exactly in order: looking past the first pending one keeps the window full."""
        check = self._te.transfer_check_status
        head = lane.inflight[:_SCAN]
        keep: list[tuple[int, _Job]] = []
        for bid, job in head:
            rc = check(bid)  # frees the batch once it is final: never ask about it again
            if rc == 0:
                keep.append((bid, job))
                continue
            job.outstanding -= 1
            if rc == 1:
                job.finish_if_done()
            else:
                job.fail(_status_error(rc, lane.session))
        done = len(head) - len(keep)
        if done:
            lane.inflight[:len(head)] = keep
            lane.last_progress = now
        elif lane.inflight and now - lane.last_progress > self._io_timeout:
            self._lose(lane, f"no completion from {lane.session} in {self._io_timeout}s")
        return done > 0

    def _lose(self, lane: _Lane, why: str) -> None:
        """Give up on a lane: fail everything queued or in flight, and refuse new work
        until the peer is connected again. Requests already in the engine stay listed
        (they still occupy its per-peer queue) and are reaped whenever the lane is
        polled again, so a reconnect never overfills that queue."""
        lane.lost = PeerLost(why)
        lane.last_progress = time.monotonic()
        for _, job in lane.inflight:
            job.fail(PeerLost(why))
        for job in lane.queue:
            job.fail(PeerLost(why))
        lane.queue.clear()

    def _step(self) -> tuple[bool, bool]:
        now = time.monotonic()
        progressed = busy = False
        with self._lock:
            if self._te is None:
                return False, False
            for lane in list(self._lanes.values()):
                progressed |= self._reap(lane, now)
                progressed |= self._fill(lane, limit=self._window)
                # a lost lane's leftovers are reaped when new work kicks the thread
                busy |= bool(lane.queue or (lane.inflight and lane.lost is None))
        return progressed, busy

    def _crashed(self, exc: BaseException) -> None:
        with self._lock:
            for lane in self._lanes.values():
                self._lose(lane, f"mooncake progress thread crashed: {exc!r}")

    # --- lifecycle ---------------------------------------------------------------------

    def _fail_pending(self, error: TransportError) -> None:
        with self._lock:  # stop sending; fail what is pending
            self._fail_lanes(list(self._lanes.values()), error)

    @staticmethod
    def _fail_lanes(lanes: list[_Lane], error: TransportError) -> None:
        for lane in lanes:
            queued, lane.queue = list(lane.queue), deque()
            for job in queued:
                job.fail(error)
            for _, job in list(lane.inflight):
                job.fail(error)

    def _abandon(self, error: TransportError) -> list[str]:
        locked = self._lock.acquire(timeout=0.2)  # a thread may be stuck in the engine
        try:
            lanes = list(self._lanes.values())
            busy = [lane.session for lane in lanes if lane.inflight or lane.queue]
            self._fail_lanes(lanes, error)
        finally:
            if locked:
                self._lock.release()
        return busy

    def _close_engine(self) -> None:
        deadline = time.monotonic() + min(self._io_timeout, 2.0)
        self._fail_pending(TransportClosed("mooncake transport closed"))
        # let requests already in the engine finish before it is destroyed
        while time.monotonic() < deadline:
            with self._lock:
                for lane in self._lanes.values():
                    self._reap(lane, time.monotonic())
                pending = any(lane.inflight for lane in self._lanes.values())
            if not pending:
                break
            time.sleep(0.001)
        self._progress.stop()
        with self._lock:
            for lane in self._lanes.values():
                lane.inflight.clear()
            for ptr in self._registered:
                self._te.unregister_memory(ptr)
            self._registered.clear()
            self._te = None  # the engine's destructor closes its sessions and threads
