"""NVIDIA NIXL over UCX: DRAM here (single-copy ``cma`` between processes on one host),
VRAM where CUDA is (opt-in, ``cuda=True``; UCX's CUDA modules need ``libcudart.so.12``,
which :mod:`kvhandoff.transport.engines.cudart` loads first, from ``nvidia-cuda-runtime-cu12``
where the host's CUDA is another version).

Install: ``pip install 'kvhandoff[nixl]'`` gives ``nixl-cu12``, whose metadata also
requires torch (~6 GB) although NIXL imports it only for type checking; add
``--no-deps`` (``make engines``) to skip it. No system packages: UCX is bundled.

How the agent is driven, and why (measured in ``reference/baselines.md`` §3-4):

* **No progress thread.** ``nixl_agent_config()``'s default thread busy-polls a core per
  agent even when idle. Here it is off; the initiator polls ``check_xfer_state`` with
  backoff sleeps (:class:`~kvhandoff.transport.engines.common.Progress`), and the target does
  nothing (single-copy ``cma`` and RDMA writes need no target progress).
* **UCX error handling ``none``**: with the default ``peer`` mode UCX drops the
  shared-memory transports for active messages, so wire-up goes over TCP and *hangs
  without target progress*. With ``none``, wire-up uses shared memory (~1 ms), the
  first transfer costs ~0.1 ms, and a dead peer still surfaces (``cma`` writes fail:
  ``PeerLost``). ``UCX_TLS`` / ``UCX_NET_DEVICES`` can be set through the options; they
  are applied around agent creation only.
* **Descriptors**: the plan's coalesced segments (NIXL never merges adjacent
  descriptors; coalescing is the caller's job and pays ~8×) become two N×3 lists and
  one WRITE (``initialize_xfer``). Prepared descriptor lists (``prep_xfer_dlist`` +
  index selection) pay only for fixed slot grids reused across transfers; plans here
  are arbitrary coalesced ranges, and the baseline measured fresh lists within 10% of
  prepared ones. The xfer handle of the last plan sent to a peer is kept and re-posted
  when the identical plan comes again (repeated handoffs into the same slots), and so
  are those of recent staging writes (the same buffer into the same slot).
* Small plans (<= ``inline_bytes``) are posted from ``submit``'s thread: a ``cma`` put
  completes inside the post call. Larger ones are posted by the progress thread so
  ``submit`` returns at once.
* NIXL's ``"DONE"/"PROC"/"ERR"`` strings and its exceptions are mapped to
  :class:`TransferState` and :mod:`kvhandoff.transport.errors` in :func:`_status` and
  :func:`_error`, nowhere else.

* ``close`` is bounded by ``close_timeout`` (default 5 s; see
  :mod:`kvhandoff.transport.engines.common`). Measured here with a SIGSTOPped peer, NIXL's own
  teardown does not wait on it (``cma`` writes land in a frozen process; releasing
  requests and the agent is local), so only staging's control channel could wait,
  and the shared bound covers it.

The endpoint carries the agent metadata and the registered region table; ``submit``
refuses a plan with any destination byte outside the peer's advertised regions before
anything is posted.

Authentication: NIXL's own data plane (UCX: ``cma``, TCP, RDMA) is not authenticated by
kvhandoff. What protects it is that only memory registered with the agent is reachable,
and that the descriptors naming it (the endpoint with the agent metadata, each
request's destinations) travel over the authenticated control plane. The staging
channel is kvhandoff's, and authenticated like tcp's data plane: a mutual
challenge–response keyed with its endpoint token, or with HMAC(``data_secret``, token)
when the deployment secret's data-plane key is given (:mod:`kvhandoff.transport.staging`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

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
    RemoteRefused,
    TransferFailed,
    TransportClosed,
    TransportError,
    TransportUnavailable,
)
from kvhandoff.transport.regions import RegionTable
from kvhandoff.transport.staging import StagingConfig

__all__ = ["NixlTransport", "available"]

INSTALL_HINT = ("pip install --no-deps nixl-cu12 (or `make engines`; plain "
                "`pip install 'kvhandoff[nixl]'` also pulls torch, which NIXL does not need)")

_MEM = {MemoryKind.HOST: "DRAM", MemoryKind.CUDA: "VRAM"}
_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.PENDING,
           "ERR": TransferState.FAILED}
_CACHE_STAGING = 32  # staging requests kept per peer (buffers × leased slots, usually 16)


def _status(s: str) -> TransferState:
    """The one place NIXL's status strings are read."""
    return _STATES.get(s, TransferState.FAILED)


def _error(exc: BaseException | None, what: str) -> TransportError:
    """The one place a NIXL failure (an exception, or an ``"ERR"`` status when ``exc``
    is None) becomes a kvhandoff error."""
    kind = type(exc).__name__ if exc is not None else "ERR"
    msg = f"{what}: NIXL {kind}" + (f" ({exc})" if exc is not None and str(exc) else "")
    if kind == "nixlRemoteDisconnectError":
        return PeerLost(msg)
    if kind == "nixlNotFoundError":  # no registration covers a descriptor
        return RemoteRefused(msg)
    return TransferFailed(msg)


def _load() -> None:
    import nixl_cu12  # noqa: F401


def _probe() -> Availability:
    return probe_package(module="nixl_cu12", distribution="nixl-cu12", hint=INSTALL_HINT,
                         load=_load, detail=" (UCX)")


available = CachedAvailability(_probe)
"""Whether NIXL imports here, and if not, how to install it. Cached; loads the shared
libraries but creates no agent."""


@dataclass(slots=True, eq=False)
class _Xfer:
    """One NIXL transfer request (one memory-type pair of a plan)."""

    handle: Any  # nixl_xfer_handle
    posted: float = 0.0
    done: bool = False


@dataclass(slots=True, eq=False)
class _Job:
    handle: Handle
    peer: NixlPeer
    xfers: list[_Xfer]
    key: bytes = b""  # identity of the plan's segments, for re-posting
    host_only: bool = False  # a staging write (cached apart from plans)
    stopped: bool = False
    landed: float | None = None  # when the last of its requests was seen done

    def fail(self, error: TransportError) -> None:
        if not self.stopped:
            self.stopped = True
            self.handle.set_failed(error)


class NixlPeer(EnginePeer):
    def __init__(self, endpoint: bytes, agent: str, table: RegionTable,
                 on_close: Callable[[EnginePeer], None]) -> None:
        super().__init__(endpoint, f"nixl:{agent}", table, on_close)
        self.agent = agent
        # finished requests kept for re-posting, by (staging write?, segments): the
        # last plan's, and the staging writes' (one per buffer × slot pair in use)
        self.cached: dict[tuple[bool, bytes], list[_Xfer]] = {}


class NixlTransport(EngineTransport):
    """NIXL/UCX adapter. Thread-safe: the agent is not (sync mode NONE), so one lock
    serialises every agent call. Options (keyword-only):

    ``ucx_tls`` / ``net_devices``: ``UCX_TLS`` / ``UCX_NET_DEVICES`` for this agent
    (default: UCX's choice; on one host that is ``cma`` for data); ``error_handling``:
    UCX ``ucx_error_handling_mode`` (default ``"none"``, see the module docstring);
    ``inline_bytes``: plans up to this size are posted from ``submit`` (default 4 MiB);
    ``io_timeout``: seconds a posted transfer may stay in progress before the peer is
    declared lost (default 30); ``connect_timeout`` (default 5); ``close_timeout``:
    seconds ``close`` waits for the agent's teardown (default 5); ``cuda``: also accept
    CUDA memory as VRAM (untested here); ``agent_name``: default
    ``kvh-<host>-<pid>-<random>``; ``host``: where peers reach the staging channel
    (default 127.0.0.1); ``staging``: see
    :class:`~kvhandoff.transport.engines.common.EngineTransport` (a ``cma`` descriptor costs
    ~3-5 µs, so plans averaging under 16 KiB per segment are staged; at 16 KiB the
    engine alone is already faster than gather + write + scatter on two cores);
    ``data_secret``: the deployment secret's data-plane key, keying the staging
    channel's handshake (see the module docstring;
    :func:`~kvhandoff.transport.registry.create_transport` passes it).
    """

    name: ClassVar[str] = "nixl"
    capabilities: ClassVar[Capabilities] = Capabilities(  # strided by staging
        strided=True, self_completing=True)
    peer_type = NixlPeer
    staging_defaults = StagingConfig(below=16 << 10)

    def __init__(self, *, ucx_tls: str | None = None, net_devices: str | None = None,
                 error_handling: str = "none", inline_bytes: int = 4 << 20,
                 io_timeout: float = 30.0, connect_timeout: float = 5.0, cuda: bool = False,
                 agent_name: str | None = None, env: Mapping[str, str] | None = None,
                 host: str = "127.0.0.1", staging: StagingConfig | bool = True,
                 close_timeout: float = 5.0, data_secret: bytes | None = None) -> None:
        if error_handling not in ("none", "peer"):
            raise ValueError(f"error_handling must be 'none' or 'peer', got {error_handling!r}")
        if inline_bytes < 0 or io_timeout <= 0 or connect_timeout <= 0:
            raise ValueError(
                f"nixl needs inline_bytes >= 0 and positive timeouts; got inline_bytes="
                f"{inline_bytes}, io_timeout={io_timeout}, connect_timeout={connect_timeout}")
        ok, reason = available()
        if not ok:
            raise TransportUnavailable(reason)
        super().__init__(host=host, io_timeout=io_timeout, connect_timeout=connect_timeout,
                         staging=staging, close_timeout=close_timeout,
                         data_secret=data_secret)
        if cuda:  # per instance: whether device memory is wanted is the caller's choice
            self.capabilities = replace(  # type: ignore[misc]
                self.capabilities, memory=frozenset(MemoryKind))
            problem = preload_cudart()  # before UCX starts, or it sees VRAM as host memory
            if problem is not None:
                raise TransportUnavailable(f"nixl cuda=True needs CUDA 12's runtime for "
                                           f"UCX's CUDA modules: {problem}")
        self._inline = inline_bytes
        self.agent_name = agent_name or (
            f"kvh-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")
        ucx_env = dict(env or {})
        if ucx_tls is not None:
            ucx_env["UCX_TLS"] = ucx_tls
        if net_devices is not None:
            ucx_env["UCX_NET_DEVICES"] = net_devices
        self._agent = self._make_agent(self.agent_name, error_handling, ucx_env)
        self._lock = threading.Lock()
        self._reg_descs: list[Any] = []
        self._to_post: deque[_Job] = deque()
        self._inflight: list[_Job] = []
        self._peers: list[NixlPeer] = []  # for their cached requests
        self._progress = Progress(f"kvhandoff-nixl-{self.agent_name}", self._step,
                                  self._crashed)

    @classmethod
    def usable(cls) -> Availability:
        return available()

    @staticmethod
    def _make_agent(name: str, error_handling: str, env: dict[str, str]) -> Any:
        from nixl_cu12 import nixl_agent, nixl_agent_config

        with applied_env(env):  # UCX reads its env when the backend is created
            try:
                agent = nixl_agent(name, nixl_agent_config(
                    enable_prog_thread=False, enable_listen_thread=False, backends=[]))
                if "UCX" not in agent.get_plugin_list():
                    raise TransportUnavailable(
                        f"NIXL has no UCX plugin (plugins: {agent.get_plugin_list()})")
                agent.create_backend("UCX", {"ucx_error_handling_mode": error_handling})
            except TransportUnavailable:
                raise
            except Exception as e:  # NIXL raises its own exception types
                raise TransportUnavailable(f"NIXL agent {name!r} could not start: {e!r}") from e
        return agent

    # --- registration & endpoints ---------------------------------------------------

    def _engine_register(self, regions: list[Region]) -> None:
        with self._lock:
            for r in regions:
                try:
                    self._reg_descs.append(self._agent.register_memory(
                        [(r.ptr, r.nbytes, r.device, "")], _MEM[r.memory]))
                except Exception as e:
                    raise ValueError(
                        f"nixl could not register {r.memory.value} memory [{r.ptr:#x}, "
                        f"+{r.nbytes}): {e!r}") from e

    def _describe(self) -> tuple[str, bytes, tuple[tuple[str, str], ...]]:
        with self._lock:
            md = self._agent.get_agent_metadata()  # carries the registrations
        return self.agent_name, bytes(md), ()

    def _connect_engine(self, ep: EngineEndpoint, raw: bytes) -> NixlPeer:
        table = ep.table()
        with self._lock:
            try:
                loaded = self._agent.add_remote_agent(ep.blob)
            except Exception as e:
                raise ConnectError(f"nixl could not load peer {ep.address}'s metadata: {e!r}"
                                   ) from e
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != ep.address:
                raise ConnectError(f"nixl endpoint names agent {ep.address!r} but its "
                                   f"metadata is for {name!r}")
            try:  # wire up now (~1 ms on one host) rather than in the first transfer
                self._agent.make_connection(name)
            except Exception as e:
                raise ConnectError(f"nixl could not connect to {name}: {e!r}") from e
            peer = NixlPeer(raw, name, table, self._peer_closed)
            self._peers.append(peer)
        return peer

    def _peer_closed(self, peer: EnginePeer) -> None:
        """Fail and release what is pending to ``peer``, and its cached requests."""
        assert isinstance(peer, NixlPeer)
        error = TransportClosed(f"peer {peer.name} was closed")
        with self._lock:
            if self._agent is None:
                return
            for job in [j for j in self._to_post if j.peer is peer]:
                self._to_post.remove(job)
                job.fail(error)
                _release(job.xfers)
            for job in [j for j in self._inflight if j.peer is peer]:
                self._drop(job, error)
            for xfers in peer.cached.values():
                _release(xfers)
            peer.cached.clear()
            if peer in self._peers:
                self._peers.remove(peer)

    # --- the data path ---------------------------------------------------------------

    def _submit_segments(self, peer: EnginePeer, segs: Segments, nbytes: int, *,
                         host_only: bool) -> Handle:
        assert isinstance(peer, NixlPeer)
        handle = Handle(nbytes=nbytes, peer=peer.name)
        key = _key(segs)
        with self._lock:
            self._check_open()
            job = _Job(handle, peer, [], key, host_only)
            try:
                job.xfers = self._xfers(peer, segs, key, host_only)
            except Exception as e:
                job.fail(_error(e, f"nixl could not build the transfer to {peer.name}"))
                return handle
            if nbytes <= self._inline:
                self._post(job, time.monotonic())
                if job.stopped:
                    _release(job.xfers)
                else:
                    self._inflight.append(job)
                    self._finish_if_done(job)
            else:
                self._to_post.append(job)
        if not job.stopped:
            self._progress.kick()
        return handle

    def _xfers(self, peer: NixlPeer, segs: Segments, key: bytes, host_only: bool
               ) -> list[_Xfer]:
        """Transfer requests for ``segs``: the peer's cached ones for an identical plan
        that is not in flight, else one new request per memory-type pair."""
        cached = peer.cached.pop((host_only, key), None)
        if cached is not None:
            for x in cached:
                x.done = False
            return cached
        out: list[_Xfer] = []
        a = self._agent
        host = ((MemoryKind.HOST, MemoryKind.HOST), np.arange(len(segs)))
        try:
            for (skind, dkind), idx in ([host] if host_only else
                                        _by_kinds(segs, self._all, peer.table)):
                n = len(idx)
                local = np.zeros((n, 3), np.uint64)
                remote = np.zeros((n, 3), np.uint64)
                local[:, 0], local[:, 1] = segs.src[idx], segs.length[idx]
                remote[:, 0], remote[:, 1] = segs.dst[idx], segs.length[idx]
                if not host_only:
                    local[:, 2] = _devices(segs.src[idx], self._all)
                    remote[:, 2] = _devices(segs.dst[idx], peer.table)
                out.append(_Xfer(a.initialize_xfer(
                    "WRITE", a.get_xfer_descs(local, _MEM[skind]),
                    a.get_xfer_descs(remote, _MEM[dkind]), peer.agent)))
        except BaseException:
            _release(out)
            raise
        return out

    def _post(self, job: _Job, now: float) -> None:
        """Post every request of ``job`` (caller holds the lock). The handle's start and
        (for a post that completes at once) its end are stamped right around the post,
        the span NIXL's own xferDuration covers."""
        for x in job.xfers:
            try:
                job.handle.mark_started()
                state = _status(self._agent.transfer(x.handle))
                job.landed = time.monotonic()  # the latest post's end, if all are done
            except Exception as e:
                job.fail(_error(e, f"nixl write to {job.peer.name} failed"))
                return
            if state is TransferState.FAILED:
                job.fail(_error(None, f"nixl write to {job.peer.name} failed"))
                return
            x.posted, x.done = now, state is TransferState.DONE

    def _finish_if_done(self, job: _Job) -> None:
        """Complete a job whose requests are all done; keep its requests for re-posting
        (caller holds the lock)."""
        if job.stopped or not all(x.done for x in job.xfers):
            return
        job.stopped = True
        job.handle.set_done(job.landed)
        self._inflight.remove(job)
        cached = job.peer.cached
        old = cached.pop((job.host_only, job.key), None)  # an identical plan ran meanwhile
        if old is not None and old is not job.xfers:
            _release(old)
        cached[job.host_only, job.key] = job.xfers
        keep = _CACHE_STAGING if job.host_only else 1
        mine = [k for k in cached if k[0] == job.host_only]
        for k in mine[:len(mine) - keep]:  # the oldest first
            _release(cached.pop(k))

    def _step(self) -> tuple[bool, bool]:
        progressed = False
        now = time.monotonic()
        with self._lock:
            if self._closed and not self._inflight:
                return False, False
            while self._to_post:  # large plans, posted here so submit returned at once
                job = self._to_post.popleft()
                if job.handle.state is not TransferState.PENDING or job.peer.closed:
                    self._drop(job, TransportClosed(f"peer {job.peer.name} was closed"))
                    continue
                self._post(job, now)
                progressed = True
                if job.stopped:
                    _release(job.xfers)
                else:
                    self._inflight.append(job)
                    self._finish_if_done(job)
            for job in list(self._inflight):
                progressed |= self._check(job, now)
            busy = bool(self._inflight or self._to_post)
        return progressed, busy

    def _check(self, job: _Job, now: float) -> bool:
        """Poll one job's requests (caller holds the lock); True if something finished."""
        if job.handle.state is not TransferState.PENDING or job.peer.closed:
            return self._drop(job, TransportClosed(f"peer {job.peer.name} was closed"))
        changed = False
        for x in job.xfers:
            if x.done:
                continue
            try:
                state = _status(self._agent.check_xfer_state(x.handle))
                error = None if state is not TransferState.FAILED else _error(
                    None, f"nixl write to {job.peer.name} failed")
            except Exception as e:
                error = _error(e, f"nixl write to {job.peer.name} failed")
                state = TransferState.FAILED
            if error is not None:
                job.fail(error)
                return self._drop(job, error)
            if state is TransferState.DONE:
                x.done = changed = True
                job.landed = time.monotonic()
            elif now - x.posted > self._io_timeout:
                error = PeerLost(f"nixl write to {job.peer.name} made no progress in "
                                 f"{self._io_timeout}s")
                job.fail(error)
                return self._drop(job, error)
        self._finish_if_done(job)
        return changed

    def _drop(self, job: _Job, error: TransportError) -> bool:
        """Stop tracking a failed or abandoned job and release its requests (releasing
        an active request asks NIXL to cancel it)."""
        job.fail(error)
        if job in self._inflight:
            self._inflight.remove(job)
        _release(job.xfers)
        return True

    def _crashed(self, exc: BaseException) -> None:
        with self._lock:
            for job in [*self._inflight, *self._to_post]:
                job.fail(TransferFailed(f"nixl progress thread crashed: {exc!r}"))

    # --- lifecycle ---------------------------------------------------------------------

    def _fail_pending(self, error: TransportError) -> None:
        with self._lock:
            for job in self._to_post:
                job.fail(error)
                _release(job.xfers)
            self._to_post.clear()
            for job in self._inflight:
                job.fail(error)

    def _abandon(self, error: TransportError) -> list[str]:
        locked = self._lock.acquire(timeout=0.2)  # a thread may be stuck in the agent
        try:
            jobs = [*list(self._to_post), *list(self._inflight)]
            for job in jobs:
                job.fail(error)
        finally:
            if locked:
                self._lock.release()
        return sorted({job.peer.name for job in jobs})

    def _close_engine(self) -> None:
        deadline = time.monotonic() + min(self._io_timeout, 2.0)
        self._fail_pending(TransportClosed("nixl transport closed"))
        while time.monotonic() < deadline:  # let posted requests finish before teardown
            _, busy = self._step()
            if not busy:
                break
            time.sleep(0.001)
        self._progress.stop()
        with self._lock:
            for job in self._inflight:
                _release(job.xfers)
            self._inflight.clear()
            for peer in self._peers:
                for xfers in peer.cached.values():
                    _release(xfers)
                peer.cached.clear()
            self._peers.clear()
            for descs in self._reg_descs:
                with contextlib.suppress(Exception):  # teardown: the agent goes next anyway
                    self._agent.deregister_memory(descs)
            self._reg_descs.clear()
            self._agent = None


def _key(segs: Segments) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for a in (segs.src, segs.dst, segs.length):
        h.update(np.ascontiguousarray(a).data)
    return h.digest()


def _release(xfers: list[_Xfer]) -> None:
    for x in xfers:
        with contextlib.suppress(Exception):  # an active request NIXL cannot cancel: kept
            x.handle.release()


def _locate(addr: np.ndarray, table: RegionTable) -> np.ndarray:
    starts = np.array([r.ptr for r in table.regions], np.int64)
    return np.maximum(np.searchsorted(starts, addr, side="right") - 1, 0)


def _devices(addr: np.ndarray, table: RegionTable) -> np.ndarray:
    if all(r.device == 0 for r in table.regions):
        return np.zeros(len(addr), np.uint64)
    dev = np.array([r.device for r in table.regions], np.uint64)
    out: np.ndarray = dev[_locate(addr, table)]
    return out


def _by_kinds(segs: Segments, src: RegionTable, dst: RegionTable
              ) -> list[tuple[tuple[MemoryKind, MemoryKind], np.ndarray]]:
    """Segment indices grouped by (source memory kind, destination memory kind)."""
    every = np.arange(len(segs))
    skinds = {r.memory for r in src.regions}
    dkinds = {r.memory for r in dst.regions}
    if len(skinds) <= 1 and len(dkinds) <= 1:
        return [((next(iter(skinds), MemoryKind.HOST), next(iter(dkinds), MemoryKind.HOST)),
                 every)]
    kinds = list(MemoryKind)
    code = {k: i for i, k in enumerate(kinds)}
    sk = np.array([code[r.memory] for r in src.regions])[_locate(segs.src, src)]
    dk = np.array([code[r.memory] for r in dst.regions])[_locate(segs.dst, dst)]
    pair = sk * len(kinds) + dk
    return [((kinds[p // len(kinds)], kinds[p % len(kinds)]), every[pair == p])
            for p in np.unique(pair).tolist()]
