"""The agent: one per rank. It owns the rank's Layout, its transport, its control socket
and the threads that serve them, and routes control messages to per-request
:class:`~kvhandoff.session.sender.Sender` / :class:`~kvhandoff.session.receiver.Receiver`.

Lifecycle (a context manager; :meth:`close` is idempotent and leaves no thread, socket,
transport peer or bootstrap registration behind)::

    with Agent.prefill(layout, bootstrap_url="http://10.0.0.3:8998", dp_rank=0) as agent:
        s = Sender(agent, request_id)      # see sender.py
    with Agent.decode(layout) as agent:
        r = Receiver(agent, "10.0.0.3:8998", request_id)   # see receiver.py

Construction registers the layout with the transport, binds the control socket, starts
the threads and — on prefill — registers the rank with the bootstrap server (bounded
retries with backoff; :class:`BootstrapFailed` if it cannot). A decode agent finds prefill
ranks lazily, per bootstrap address, when the first Receiver needs them.

Threads (all named ``kvh-*``): the control I/O thread (messages, timers, heartbeats;
:mod:`~kvhandoff.session.control`), the completion thread (deadlines and polling of
transfer handles, whose completions mostly arrive as done-callbacks on the transport's
own threads; :mod:`~kvhandoff.session.completion`) and ``config.workers`` worker
threads for blocking jobs (bootstrap lookups, handshakes, checksum checks), plus the
transport's own.

Thread-safety: every public method may be called from any thread. Internally the agent
lock guards only its tables and is never held while calling into a request (each
request has its own lock), so the two never deadlock.
"""

from __future__ import annotations

import collections
import enum
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import NamedTuple, Self

from kvhandoff.layout import Layout, RowKind, TensorSpec
from kvhandoff.protocol import (
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    ErrorCode,
    ErrorReply,
    Heartbeat,
    HeartbeatAck,
    Hello,
    HelloAck,
    HelloReject,
    Message,
    Outcome,
    RankId,
    RequestId,
    StatusNotice,
    TransferInit,
    TransferStatus,
    encode_notice,
    layout_to_msg,
)
from kvhandoff.session.bootstrap_client import (
    BootstrapError,
    RankRecord,
    RegistrationConflict,
    deregister,
    register,
)
from kvhandoff.session.bootstrap_client import RankId as BootstrapRankId
from kvhandoff.session.completion import Callback, Completions
from kvhandoff.session.config import SessionConfig
from kvhandoff.session.control import ControlChannel, Origin
from kvhandoff.session.errors import (
    AgentClosed,
    BootstrapFailed,
    PeerLost,
    RequestAborted,
    SessionError,
)
from kvhandoff.session.groups import GroupState, PrefillGroups
from kvhandoff.session.liveness import Liveness
from kvhandoff.session.memory import TensorViews
from kvhandoff.session.notices import NoticeRouter
from kvhandoff.session.peers import DecodePeer, DecodePeers
from kvhandoff.session.receiver import Receiver
from kvhandoff.session.sender import Sender
from kvhandoff.state_types import StateType
from kvhandoff.transport.base import MAX_NOTICE, Handle, Transport
from kvhandoff.transport.registry import create_transport

log = logging.getLogger("kvhandoff.session.agent")

_CHUNKED = (StateType.KV, StateType.MLA)
_MAX_TOMBSTONES = 65536
_LOST_MEMORY_S = 60.0  # messages to a peer declared lost are dropped this long


class _Tomb(NamedTuple):
    """A failed request, remembered for a while."""

    reason: str
    expires: float  # time.monotonic()
    unsafe: frozenset[str]  # decode endpoints a cancelled write may still reach
    lost: bool = False  # failed for an unreachable decode rank, not an abort

    def error(self) -> SessionError:
        return PeerLost(self.reason) if self.lost else RequestAborted(self.reason)


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class Agent:
    """One rank's session endpoint; see the module docstring."""

    def __init__(self, layout: Layout, *, role: Role | str, config: SessionConfig | None = None,
                 transport: Transport | None = None, own_transport: bool = True,
                 bootstrap_url: str | None = None, dp_rank: int = 0, dp_size: int = 1,
                 name: str = "") -> None:
        self.role = Role(role)
        self.layout = layout
        self.config = config if config is not None else SessionConfig.from_env()
        if self.role is Role.PREFILL and not bootstrap_url:
            raise ValueError("a prefill agent needs bootstrap_url (where it registers)")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside dp_size {dp_size}")
        self.name = name or f"{self.role.value}-tp{layout.tp_rank}-pp{layout.pp_rank}"
        self.kv_name, self.aux_name, self.aux_tensor, self.state_names = _classify(layout)
        self.kv_repageable = self.kv_name is not None and all(
            t.row_kind is RowKind.TOKEN and t.rows == layout.page_size
            for t in layout.component(self.kv_name).tensors if not t.elided)
        self.views = TensorViews(layout)
        self._bootstrap_url = bootstrap_url.rstrip("/") if bootstrap_url else None
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._senders: dict[RequestId, Sender] = {}
        self._receivers: dict[RequestId, Receiver] = {}
        self._inits: collections.OrderedDict[RequestId, list[tuple[str, TransferInit, float]]] = \
            collections.OrderedDict()
        self._tombstones: collections.OrderedDict[RequestId, _Tomb] = \
            collections.OrderedDict()
        self._lost: dict[str, float] = {}
        # decode endpoints a write to failed, watched by heartbeat until a HeartbeatAck to
        # a later ping (the value: the last ping seq before suspicion) or declared lost
        self._suspects: dict[str, int] = {}
        self._seq = itertools.count(1)
        self._probes: dict[int, threading.Event] = {}
        self._liveness = Liveness(interval=self.config.heartbeat_interval,
                                  timeout=self.config.heartbeat_timeout)
        self._record: RankRecord | None = None
        self._owns_transport = own_transport or transport is None
        self._transport: Transport | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._completions: Completions | None = None
        self._control: ControlChannel | None = None
        self._peers: DecodePeers | None = None
        self._groups: PrefillGroups | None = None
        self._router: NoticeRouter | None = None  # decode: in-band statuses come here
        self._in_band = 0  # statuses that arrived in band
        try:
            self._start(transport, dp_rank, dp_size)
        except BaseException:
            self.close()
            raise

    @classmethod
    def prefill(cls, layout: Layout, *, bootstrap_url: str, dp_rank: int = 0, dp_size: int = 1,
                config: SessionConfig | None = None, transport: Transport | None = None,
                own_transport: bool = True) -> Agent:
        return cls(layout, role=Role.PREFILL, bootstrap_url=bootstrap_url, dp_rank=dp_rank,
                   dp_size=dp_size, config=config, transport=transport,
                   own_transport=own_transport)

    @classmethod
    def decode(cls, layout: Layout, *, dp_rank: int = 0, dp_size: int = 1,
               config: SessionConfig | None = None, transport: Transport | None = None,
               own_transport: bool = True) -> Agent:
        return cls(layout, role=Role.DECODE, dp_rank=dp_rank, dp_size=dp_size, config=config,
                   transport=transport, own_transport=own_transport)

    def _start(self, transport: Transport | None, dp_rank: int, dp_size: int) -> None:
        cfg = self.config
        t = transport if transport is not None else create_transport(
            cfg.transport, **dict(cfg.transport_options))
        self._transport = t
        t.register(self.layout)
        transport_endpoint = t.endpoint()  # after registering: the endpoint may carry it
        self._pool = ThreadPoolExecutor(cfg.workers, thread_name_prefix=f"kvh-work-{self.name}")
        self._completions = Completions(t, timeout=cfg.transfer_timeout, name=self.name)
        self._control = ControlChannel(
            host=cfg.host, port=cfg.port, dial_host=cfg.dial_host, on_message=self._on_message,
            on_tick=self._on_tick, on_undeliverable=self._on_undeliverable, tick=cfg.tick,
            name=self.name)
        lay = self.layout
        self.rank_id = RankId(instance=cfg.instance, dp_rank=dp_rank, tp_rank=lay.tp_rank,
                              tp_size=lay.tp_size, pp_rank=lay.pp_rank, pp_size=lay.pp_size)
        if self.role is Role.PREFILL:
            self._peers = DecodePeers(layout=lay, transport=t, rank=self.rank_id, send=self._post)
            self._register(dp_rank, dp_size)
        else:
            self._router = NoticeRouter.of(t) if cfg.in_band_status else None
            if self._router is not None:
                self._router.add(self._control.endpoint, self._on_notice)
            hello = Hello(protocol_version=PROTOCOL_VERSION, rank=self.rank_id,
                          layout=layout_to_msg(lay), transport=t.name,
                          transport_endpoint=transport_endpoint,
                          control_endpoint=self._control.endpoint,
                          notices=self._router is not None)
            self._groups = PrefillGroups(hello=hello, timeout=cfg.bootstrap_timeout,
                                         send=self._post, spawn=self._spawn, stop=self._stop)

    def _register(self, dp_rank: int, dp_size: int) -> None:
        assert self._control is not None and self._transport is not None
        assert self._bootstrap_url is not None
        lay = self.layout
        rec = RankRecord(instance=self.config.instance, dp_size=dp_size, dp_rank=dp_rank,
                         tp_size=lay.tp_size, tp_rank=lay.tp_rank, pp_size=lay.pp_size,
                         pp_rank=lay.pp_rank, control_endpoint=self._control.endpoint,
                         transport=self._transport.name,
                         model_signature=lay.model_signature)
        url, what = self._bootstrap_url, f"prefill {self.rank_id}"
        for attempt in range(2):  # a second try only after removing a dead rank's record
            try:
                register(url, rec, retries=self.config.register_retries, backoff=0.2,
                         max_backoff=4.0, timeout=min(5.0, self.config.bootstrap_timeout))
                break
            except RegistrationConflict as e:
                stale = _stale_endpoint(e)
                if attempt or stale is None:
                    raise BootstrapFailed(f"{what} could not register: {e}") from e
                if self._probe(stale, timeout=min(2.0, self.config.heartbeat_timeout)):
                    raise BootstrapFailed(
                        f"{what} could not register: the slot is held by a live rank at "
                        f"{stale} (two processes configured as the same rank?)") from e
                log.warning("%s: replacing the registration of a dead rank at %s", what, stale)
                try:
                    deregister(url, BootstrapRankId(instance=rec.instance, dp_rank=dp_rank,
                                           tp_rank=lay.tp_rank, pp_rank=lay.pp_rank,
                                           control_endpoint=stale), retries=1)
                except BootstrapError as e2:
                    raise BootstrapFailed(f"{what} could not remove the dead rank's "
                                          f"registration at {stale}: {e2}") from e2
            except BootstrapError as e:
                raise BootstrapFailed(f"{what} could not register: {e}") from e
        self._record = rec

    def _probe(self, endpoint: str, timeout: float) -> bool:
        """Whether a control endpoint answers a Heartbeat within ``timeout`` seconds."""
        seq = next(self._seq)
        ev = threading.Event()
        self._probes[seq] = ev
        try:
            self._post(endpoint, Heartbeat(seq=seq, sender=self.endpoint))
            return ev.wait(timeout)
        finally:
            self._probes.pop(seq, None)
            assert self._control is not None
            self._control.forget(endpoint)

    # --- public surface --------------------------------------------------------------

    @property
    def transport(self) -> Transport:
        assert self._transport is not None
        return self._transport

    @property
    def endpoint(self) -> str:
        """This agent's control endpoint (``tcp://host:port``)."""
        assert self._control is not None
        return self._control.endpoint

    @property
    def closed(self) -> bool:
        return self._closed

    def handshake(self, bootstrap_addr: str, *, instance: str | None = None,
                  timeout: float | None = None) -> SessionError | None:
        """Decode: look up and handshake prefill instance ``instance`` (DP rank 0) at
        ``bootstrap_addr`` now instead of on the first request, so an incompatible pair
        surfaces at start-up. Returns None once handshaken, else why not (a
        :class:`~kvhandoff.session.errors.HandshakeError` names every incompatibility; a
        :class:`BootstrapFailed` may only mean prefill is not up yet). A failed attempt is
        forgotten: the first request tries again."""
        from kvhandoff.session.receiver import bootstrap_url

        if self._groups is None:
            raise RuntimeError("handshake() is for decode agents")
        group = self._groups.get((bootstrap_url(bootstrap_addr), instance or self.config.instance,
                                  0))
        group.wait(self.config.bootstrap_timeout if timeout is None else timeout)
        if group.state is GroupState.READY:
            return None
        return group.error or BootstrapFailed(
            f"prefill instance at {bootstrap_addr} not handshaken within the timeout")

    @property
    def live_requests(self) -> int:
        """Requests not yet finished here (settled on prefill, released on decode)."""
        with self._lock:
            return len(self._senders) + len(self._receivers)

    @property
    def stats(self) -> dict[str, int]:
        out = dict(self._control.stats) if self._control is not None else {}
        out["live_requests"] = self.live_requests
        out["decode_peers"] = len(self._peers) if self._peers is not None else 0
        out["in_band_statuses"] = self._in_band
        out["suspect_peers"] = len(self._suspects)  # a write to them was lost; being probed
        return out

    def close(self) -> None:
        """Fail live requests (telling their peers), deregister, stop every thread, close
        the sockets and (if owned) the transport. Idempotent; bounded in time."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live: list[Sender | Receiver] = [*self._senders.values(), *self._receivers.values()]
        self._stop.set()
        if self._router is not None and self._control is not None:
            self._router.remove(self._control.endpoint)
        for r in live:
            r._on_agent_closed()
        if self._record is not None and self._bootstrap_url is not None:
            try:
                deregister(self._bootstrap_url, self._record, retries=1, timeout=2.0)
            except BootstrapError as e:
                log.warning("deregistering %s failed: %s", self.rank_id, e)
            self._record = None
        if self._completions is not None:
            self._completions.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._control is not None:
            self._control.close()
        if self._peers is not None:
            self._peers.close()
        if self._transport is not None and self._owns_transport:
            self._transport.close()
        with self._lock:
            self._senders.clear()
            self._receivers.clear()
            self._inits.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        ep = self._control.endpoint if self._control is not None else "?"
        return f"<Agent {self.role.value} {self.name} {ep}{' closed' if self._closed else ''}>"

    # --- for Sender / Receiver ---------------------------------------------------------

    def _attach_sender(self, s: Sender) -> tuple[list[tuple[DecodePeer | str, TransferInit]],
                                                 SessionError | None]:
        """Register ``s``; returns the indices buffered for it (with their decode peer,
        or why that rank was dropped since) and why it already failed, if it did.
        Indices from a rank whose data connection closed are handed over once it is
        re-dialed."""
        with self._lock:
            self._check_open()
            if s.request_id in self._senders:
                raise ValueError(f"request id {s.request_id!r} is already live on this agent")
            self._senders[s.request_id] = s
            buffered = self._inits.pop(s.request_id, [])
            tomb = self._tombstones.pop(s.request_id, None)
        assert self._peers is not None
        ready: list[tuple[DecodePeer | str, TransferInit]] = []
        for ep, m, _ in buffered:
            p = self._peers.get(ep)
            if p is None:
                ready.append((self._peers.why_gone(ep), m))
            elif p.transport_peer.closed:
                self._spawn(functools.partial(self._redialed, p, m, deliver=True))
            else:
                ready.append((p, m))
        return ready, None if tomb is None else tomb.error()

    def _attach_receiver(self, r: Receiver) -> None:
        with self._lock:
            self._check_open()
            if r.request_id in self._receivers:
                raise ValueError(f"request id {r.request_id!r} is already live on this agent")
            self._receivers[r.request_id] = r

    def _check_open(self) -> None:
        if self._closed:
            raise AgentClosed(f"agent {self.name} is closed")

    def _finished(self, r: Sender | Receiver) -> None:
        unsafe = r._unsafe_endpoints() if isinstance(r, Sender) else frozenset()
        with self._lock:
            table: dict[RequestId, Sender] | dict[RequestId, Receiver] = (
                self._senders if isinstance(r, Sender) else self._receivers)
            if table.get(r.request_id) is r:
                del table[r.request_id]
            if isinstance(r, Sender) and r.reason is not None:
                self._tombstone(r.request_id, r.reason, unsafe)

    def _tombstone(self, rid: RequestId, reason: str,
                   unsafe: frozenset[str] = frozenset(), *, lost: bool = False) -> None:
        """Remember a failed request for a while, so late indices or aborts for it are
        answered; ``unsafe``: decode endpoints a cancelled write may still reach, never
        told "no write in flight" (caller holds the lock)."""
        self._tombstones[rid] = _Tomb(reason, time.monotonic() + self.config.indices_timeout,
                                      unsafe, lost)
        while len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _post(self, endpoint: str, msg: Message) -> None:
        """Queue a control message, unless ``endpoint`` was recently declared lost."""
        if endpoint in self._lost or self._control is None:
            return
        self._control.send(endpoint, msg)

    def _write_failed(self, peer: DecodePeer) -> None:
        """A write to ``peer`` failed (any thread). Its requests fail by themselves, but
        a dead rank must not linger once no request is left to watch it: the endpoint is
        probed by heartbeat until it answers, or is declared lost and dropped."""
        with self._lock:
            if not self._closed:
                self._suspects.setdefault(peer.endpoint, next(self._seq))

    def _notice(self, peer: DecodePeer, status: TransferStatus) -> bytes | None:
        """``status`` as the in-band notice of its chunk's writes to ``peer``, or None
        when it goes over the control socket (see :mod:`kvhandoff.session.notices`)."""
        if not (peer.notices and self.transport.capabilities.notices) or self._control is None:
            return None
        data = encode_notice(StatusNotice(to=peer.endpoint, sender=self._control.endpoint,
                                          status=status))
        return data if len(data) <= MAX_NOTICE else None

    def _on_notice(self, notice: StatusNotice) -> None:
        """An in-band status (a transport thread): as if it came over the control socket
        from ``notice.sender``."""
        with self._lock:
            self._in_band += 1
            r = self._receivers.get(notice.status.request_id)
        if r is not None:
            r._on_status(notice.sender, notice.status)

    def _track(self, handle: Handle, callback: Callback) -> None:
        assert self._completions is not None
        self._completions.track(handle, callback)

    def _spawn(self, job: Callable[[], None]) -> None:
        def run() -> None:
            try:
                job()
            except Exception:
                log.exception("agent %s: background job failed", self.name)
        if self._pool is None:
            return
        try:
            self._pool.submit(run)
        except RuntimeError:  # the pool is shut down: the agent is closing
            log.debug("agent %s closing; job dropped", self.name)

    # --- control messages (I/O thread) ---------------------------------------------------

    def _on_message(self, origin: Origin, msg: Message) -> None:
        now = time.monotonic()
        if origin.endpoint is not None:
            self._liveness.heard(origin.endpoint, now)
            self._lost.pop(origin.endpoint, None)
        assert self._control is not None
        match msg:
            case Heartbeat():
                self._control.reply(origin, HeartbeatAck(seq=msg.seq, sender=self.endpoint))
            case HeartbeatAck():
                if self._suspects and origin.endpoint in self._suspects:
                    with self._lock:  # an answer to a ping sent after the failed write
                        if msg.seq > self._suspects.get(origin.endpoint, msg.seq):
                            del self._suspects[origin.endpoint]
                probe = self._probes.get(msg.seq)
                if probe is not None:
                    probe.set()
            case ErrorReply():
                self._on_error_reply(origin, msg)
            case Abort():
                self._on_abort(origin, msg)
            case Hello() if self._peers is not None:
                peers = self._peers
                self._spawn(lambda: peers.answer(origin.endpoint, msg))
            case TransferInit() if self._peers is not None:
                self._on_init(origin, msg)
            case HelloAck() | HelloReject() if self._groups is not None and origin.endpoint:
                if not self._groups.on_reply(origin.endpoint, msg):
                    log.debug("unexpected handshake answer from %s", origin)
            case TransferStatus() if self._groups is not None and origin.endpoint:
                r = self._receiver(msg.request_id)
                if r is not None:
                    r._on_status(origin.endpoint, msg)
            case AbortAck() if self._groups is not None and origin.endpoint:
                r = self._receiver(msg.request_id)
                if r is not None:
                    r._on_abort_ack(origin.endpoint)
            case _:
                self._control.reply(origin, ErrorReply(
                    reason=f"a {self.role.value} agent does not accept {type(msg).__name__}"
                           + ("" if origin.endpoint else " from an unnamed client"),
                    request_id=getattr(msg, "request_id", None)))

    def _receiver(self, rid: RequestId) -> Receiver | None:
        with self._lock:
            return self._receivers.get(rid)

    def _on_init(self, origin: Origin, msg: TransferInit) -> None:
        assert self._peers is not None and self._control is not None
        peer = self._peers.get(origin.endpoint)
        if peer is None or peer.rank != msg.rank:
            why = "no accepted Hello from it" if peer is None else \
                f"it handshook as {peer.rank}, not {msg.rank}"
            self._control.reply(origin, ErrorReply(
                reason=f"unknown decode peer {origin} ({why}); handshake again",
                request_id=msg.request_id, code=ErrorCode.UNKNOWN_PEER))
            with self._lock:
                sender = self._senders.get(msg.request_id)
            if sender is not None and origin.endpoint is not None:
                sender._on_init_deferred(origin.endpoint)
            return
        now = time.monotonic()
        full = False
        with self._lock:
            sender = self._senders.get(msg.request_id)
            tomb = self._tombstones.get(msg.request_id)
            if sender is None and tomb is None:
                if len(self._inits) >= self.config.max_pending_inits and \
                        msg.request_id not in self._inits:
                    full = True
                else:
                    self._inits.setdefault(msg.request_id, []).append((peer.endpoint, msg, now))
        if peer.transport_peer.closed and tomb is None and not full:
            # its data connection broke: re-dial now; a Sender still to come gets the
            # buffered indices with the fresh peer (or re-dials itself, see above)
            self._spawn(functools.partial(self._redialed, peer, msg, deliver=sender is not None))
        elif sender is not None:
            sender._on_init(peer, msg)
        elif tomb is not None:
            self._post(peer.endpoint, TransferStatus(
                request_id=msg.request_id, rank=self.rank_id, chunk=0, last=True,
                outcome=Outcome.FAILED, reason=tomb.reason))
            if peer.endpoint not in tomb.unsafe:
                self._post(peer.endpoint, AbortAck(request_id=msg.request_id, rank=self.rank_id))
        elif full:
            self._control.reply(origin, ErrorReply(
                reason=f"prefill {self.rank_id} holds {self.config.max_pending_inits} requests' "
                       f"indices with no Sender yet (max_pending_inits); refused",
                request_id=msg.request_id))

    def _redialed(self, peer: DecodePeer, msg: TransferInit, *, deliver: bool) -> None:
        """Re-dial ``peer``'s broken data connection (a worker thread), then hand ``msg``
        to its Sender (``deliver``; else it waits in the buffer for one); if the rank
        cannot be reached, the request fails, naming why."""
        assert self._peers is not None
        got = self._peers.redial(peer)
        with self._lock:
            sender = self._senders.get(msg.request_id)
            if not deliver:
                if isinstance(got, str) and sender is None:
                    self._inits.pop(msg.request_id, None)
                    self._tombstone(msg.request_id, got, lost=True)  # its Sender fails on arrival
                return  # else the Sender's own attach re-dials (or finds the fresh peer)
        if sender is None:
            return
        if isinstance(got, str):
            sender._on_init_refused(f"request {msg.request_id!r}: {got}")
        else:
            sender._on_init(got, msg)

    def _on_abort(self, origin: Origin, msg: Abort) -> None:
        if self.role is Role.DECODE:
            r = self._receiver(msg.request_id)
            if r is not None:
                r._on_abort(str(msg.rank), msg.reason)
            return
        with self._lock:
            s = self._senders.get(msg.request_id)
            tomb = self._tombstones.get(msg.request_id)
            if s is None and tomb is None:
                self._inits.pop(msg.request_id, None)
                self._tombstone(msg.request_id, f"aborted by decode {msg.rank}: {msg.reason}")
        if s is not None:
            s._on_abort(origin.endpoint, str(msg.rank), msg.reason)
        elif tomb is not None and origin.endpoint in tomb.unsafe:
            log.info("request %r: decode %s aborted; a cancelled write to it may still land, "
                     "so no AbortAck (it waits out its release_timeout)", msg.request_id,
                     msg.rank)
        else:  # no Sender, or its writes to this rank are all over
            ack = AbortAck(request_id=msg.request_id, rank=self.rank_id)
            if origin.endpoint is not None:
                self._post(origin.endpoint, ack)
            else:
                assert self._control is not None
                self._control.reply(origin, ack)

    def _on_error_reply(self, origin: Origin, msg: ErrorReply) -> None:
        log.warning("agent %s: %s answered with an error: %s", self.name, origin, msg.reason)
        if origin.endpoint is None or msg.request_id is None:
            return
        if self._groups is not None:
            unknown = msg.code is ErrorCode.UNKNOWN_PEER
            # a prefill rank that forgot our handshake (it restarted): forget the groups
            # that handshook with it before; one connecting now is already a fresh start
            self._groups.drop_endpoint(origin.endpoint, ready_only=unknown)
            r = self._receiver(msg.request_id)
            if r is not None and unknown:
                r._on_unknown_peer(origin.endpoint, msg.reason)
            elif r is not None:
                r._on_rejected(origin.endpoint, msg.reason)

    def _on_undeliverable(self, endpoint: str, reason: str) -> None:
        self._peer_lost(endpoint, reason)

    # --- timers (I/O thread) ------------------------------------------------------------

    def _on_tick(self, now: float) -> None:
        with self._lock:
            live: list[Sender | Receiver] = [*self._senders.values(), *self._receivers.values()]
            for rid in [k for k, t in self._tombstones.items() if t.expires < now]:
                del self._tombstones[rid]
            stale = [k for k, v in self._inits.items()
                     if now - v[0][2] > self.config.indices_timeout]
            for rid in stale:
                del self._inits[rid]
            watched = set(self._suspects)
        for r in live:
            r._on_tick(now)
        for r in live:
            watched |= r._peer_endpoints()
        ping, lost = self._liveness.tick(watched, now)
        for ep in ping:
            self._post(ep, Heartbeat(seq=next(self._seq), sender=self.endpoint))
        for ep, quiet in lost:
            self._peer_lost(ep, f"peer {ep} silent for {quiet:.1f} s (heartbeat_timeout "
                                f"{self.config.heartbeat_timeout:g} s)")
        for ep in [e for e, t in self._lost.items() if now - t > _LOST_MEMORY_S]:
            del self._lost[ep]

    def _peer_lost(self, endpoint: str, reason: str) -> None:
        log.warning("agent %s: %s", self.name, reason)
        self._lost[endpoint] = time.monotonic()
        with self._lock:
            self._suspects.pop(endpoint, None)  # lost: nothing left to suspect
            live: list[Sender | Receiver] = [*self._senders.values(), *self._receivers.values()]
        for r in live:
            r._on_peer_lost(endpoint, reason)
        if self._groups is not None:
            self._groups.drop_endpoint(endpoint)
        if self._peers is not None:
            self._peers.drop(endpoint, reason=reason)
        if self._control is not None:
            self._control.forget(endpoint)


def _stale_endpoint(e: RegistrationConflict) -> str | None:
    """The registered control endpoint, when it is the only thing the refused record
    disagrees on: the slot's previous holder (maybe a crashed process)."""
    fields = {c.field for c in e.conflicts}
    if fields != {"control_endpoint"}:
        return None
    old = e.conflicts[0].existing
    return old if isinstance(old, str) else None


def _classify(layout: Layout) -> tuple[str | None, str | None, TensorSpec | None, tuple[str, ...]]:
    """``(KV component, aux component, aux tensor, state components)`` of a layout."""
    kv = [c for c in layout.components if c.type in _CHUNKED]
    ax = [c for c in layout.components if c.type is StateType.AUX]
    if len(kv) > 1 or len(ax) > 1:
        raise ValueError(f"a layout may hold at most one KV/MLA component and one aux component; "
                         f"got {[c.name for c in kv]} and {[c.name for c in ax]}")
    aux_tensor = None
    if ax:
        live = [t for t in ax[0].tensors if not t.elided]
        if len(live) != 1:
            raise ValueError(f"aux component {ax[0].name!r} must hold one tensor, has {len(live)}")
        aux_tensor = live[0]
    special = {c.name for c in kv + ax}
    return (kv[0].name if kv else None, ax[0].name if ax else None, aux_tensor,
            tuple(c.name for c in layout.components if c.name not in special))
