"""The agent: one per rank. It owns the rank's Layout, its transport, its control socket
and the threads that serve them; its role's desk routes control messages to per-request
:class:`~kvhandoff.session.request.sender.Sender` /
:class:`~kvhandoff.session.request.receiver.Receiver`.

Lifecycle (a context manager; :meth:`close` is idempotent and leaves no thread, socket,
transport peer or bootstrap registration behind)::

    with PrefillAgent(layout, bootstrap_url="http://10.0.0.3:8998", dp_rank=0) as agent:
        s = Sender(agent, request_id)      # see sender.py
    with DecodeAgent(layout) as agent:
        r = Receiver(agent, "10.0.0.3:8998", request_id)   # see receiver.py

A role is a type: :class:`PrefillAgent` and :class:`DecodeAgent` share the core
:class:`AgentCore` (through :class:`Agent`, their common base and factory), and what
belongs to one role is a method of that class only (``handshake`` and ``groups`` on
decode; ``notice``, ``defer_write`` and ``write_failed`` on prefill). A :class:`Sender`
takes a prefill agent and a :class:`Receiver` a decode agent, so a role-wrong call is
refused by the type checker. ``Agent(layout, role=...)``, ``Agent.prefill(...)`` and
``Agent.decode(...)`` are factories that return the role's class (typed as such when the
role is a literal).

Construction registers the layout with the transport, binds the control socket, starts
the threads and — on prefill — registers the rank with the bootstrap server (bounded
retries with backoff; :class:`BootstrapFailed` if it cannot). A decode agent finds prefill
ranks lazily, per bootstrap address, when the first Receiver needs them.

One agent, two parts. The shared core is role-neutral: its transport, control socket
and threads (:mod:`~kvhandoff.session.rank.io`, also on the deployment secret),
heartbeats and lost peers (:mod:`~kvhandoff.session.rank.liveness.heartbeats`), where each message
goes (:mod:`~kvhandoff.session.rank.dispatch`), its counters
(:mod:`~kvhandoff.session.rank.stats`) and the
:class:`~kvhandoff.session.request.host.RankHost` its requests see. A role is a desk
(:class:`~kvhandoff.session.rank.desk.Desk`), which takes every control message but
heartbeats: :class:`~kvhandoff.session.rank.prefill_desk.PrefillDesk`
(bootstrap registration, decode peers, Senders) or
:class:`~kvhandoff.session.rank.decode_desk.DecodeDesk` (prefill groups, Receivers). A decode
rank whose handshake reaches a prefill rank without the same secret fails it at once.

Thread-safety: every public method may be called from any thread. Internally the agent
lock and the desk's lock guard only their own tables and are never held while calling
into a request (each request has its own lock), so the two never deadlock.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import ClassVar, Literal, Self, overload

from kvhandoff.layout import Layout
from kvhandoff.observe.report import Reporter, process_metrics
from kvhandoff.observe.trace import TraceWriter
from kvhandoff.protocol import Message, RankId, TransferStatus
from kvhandoff.session.config import SessionConfig
from kvhandoff.session.control.channel import ControlChannel, Origin
from kvhandoff.session.control.completion import Callback
from kvhandoff.session.control.post_batch import PostBatcher
from kvhandoff.session.control.write_batch import BatchedWrite
from kvhandoff.session.errors import AgentClosed, SessionError
from kvhandoff.session.peers.decode_ranks import DecodePeer, DecodePeers
from kvhandoff.session.peers.prefill_groups import PrefillGroups
from kvhandoff.session.rank.decode_desk import DecodeDesk
from kvhandoff.session.rank.desk import Desk
from kvhandoff.session.rank.dispatch import deliver
from kvhandoff.session.rank.io import RankIO
from kvhandoff.session.rank.liveness.heartbeats import Heartbeats
from kvhandoff.session.rank.prefill_desk import PrefillDesk
from kvhandoff.session.rank.stats import agent_stats
from kvhandoff.session.request.components import Components
from kvhandoff.session.request.host import Backlog, Request
from kvhandoff.session.request.host import Role as Role  # re-exported: its historical home
from kvhandoff.session.request.receiver import Receiver
from kvhandoff.session.request.sender import Sender
from kvhandoff.session.request.views import TensorViews
from kvhandoff.transport.base import Handle, Transport

PrefillRole = Literal[Role.PREFILL, "prefill"]
DecodeRole = Literal[Role.DECODE, "decode"]


class AgentCore:
    """One rank's session endpoint, the core both roles share; see the module docstring.
    Use :class:`Agent` (or a role's class), never this directly."""

    _role: ClassVar[Role]
    _desk: Desk | None

    def __init__(self, layout: Layout, *, role: Role | str | None = None,
                 config: SessionConfig | None = None, transport: Transport | None = None,
                 own_transport: bool = True, bootstrap_url: str | None = None,
                 dp_rank: int = 0, dp_size: int = 1, name: str = "") -> None:
        if role is not None and Role(role) is not self._role:
            raise ValueError(f"a {type(self).__name__} is a {self._role.value} agent, "
                             f"not a {Role(role).value} one")
        self.layout = layout
        self.config = config if config is not None else SessionConfig.from_env()
        if self._role is Role.PREFILL and not bootstrap_url:
            raise ValueError("a prefill agent needs bootstrap_url (where it registers)")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside dp_size {dp_size}")
        self.name = name or f"{self.role.value}-tp{layout.tp_rank}-pp{layout.pp_rank}"
        parts = Components.of(layout)
        self.kv_name, self.aux_name, self.aux_tensor = parts.kv, parts.aux, parts.aux_tensor
        self.state_names, self.kv_repageable = parts.states, parts.kv_repageable
        self.views = TensorViews(layout)
        self._bootstrap_url = bootstrap_url.rstrip("/") if bootstrap_url else None
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._beats = Heartbeats(self.config, name=self.name, post=self.post)
        self._posts = PostBatcher(self._post_now)  # decode's, per engine step
        self._io: RankIO | None = None
        self._desk = None
        metrics, cfg = process_metrics(), self.config
        metrics.watch(self)
        self._live = metrics.live.labels(self.role.value)
        self._report = Reporter(role=self.role.value, transport=cfg.transport, rank=self.name,
                                metrics=metrics if cfg.metrics else None,
                                trace=TraceWriter(cfg.trace) if cfg.trace else None)
        try:
            self._start(transport, own_transport, dp_rank, dp_size)
        except BaseException:
            self.close()
            raise

    def _start(self, transport: Transport | None, own_transport: bool, dp_rank: int,
               dp_size: int) -> None:
        beats, cfg, lay = self._beats, self.config, self.layout
        self._io = io = RankIO(
            lay, cfg, name=self.name, transport=transport, own_transport=own_transport,
            on_message=self._on_message, on_tick=lambda now: beats.tick(now, self._desk),
            on_undeliverable=lambda ep, why: beats.peer_lost(ep, why, self._desk),
            on_unauthenticated=self._unauthenticated, on_drained=self._drained)
        beats.control = io.control
        self.rank_id = RankId(instance=cfg.instance, dp_rank=dp_rank, tp_rank=lay.tp_rank,
                              tp_size=lay.tp_size, pp_rank=lay.pp_rank, pp_size=lay.pp_size)
        self._open_desk(io, dp_rank, dp_size)

    # --- what each role's class provides --------------------------------------------------

    def _open_desk(self, io: RankIO, dp_rank: int, dp_size: int) -> None:
        """Make this role's desk (and, on prefill, register with the bootstrap server)."""
        raise NotImplementedError  # never reached: Agent(...) makes a role's class

    def batched_writes(self) -> contextlib.AbstractContextManager[None]:
        """An engine step's handovers, together (see each role's class). Nothing held
        leaves before the block exits: never wait on one of its requests inside it."""
        raise NotImplementedError  # never reached: Agent(...) makes a role's class

    def _drained(self) -> None:
        """Every control message that was ready has been handled (I/O thread)."""

    def _unauthenticated(self, endpoint: str, reason: str) -> None:
        """A peer this rank dialed failed authentication (I/O thread)."""

    def _leave(self) -> None:
        """Closing, before the threads stop: say goodbye where the role registered."""

    # --- public surface --------------------------------------------------------------

    @property
    def role(self) -> Role:
        """Which side of the handoff this agent is on (fixed by its class)."""
        return self._role

    @property
    def transport(self) -> Transport:
        assert self._io is not None
        return self._io.transport

    @property
    def endpoint(self) -> str:
        """This agent's control endpoint (``tcp://host:port``)."""
        assert self._io is not None
        return self._io.control.endpoint

    @property
    def transport_endpoint(self) -> bytes:
        """What a peer's transport dials to reach this agent (its Hello names it)."""
        assert self._io is not None
        return self._io.transport_endpoint

    @property
    def closed(self) -> bool:
        return self._closed

    def live(self) -> Sequence[Sender | Receiver]:
        """The requests not yet finished here (settled on prefill, released on decode)."""
        return []

    @property
    def live_requests(self) -> int:
        """Requests not yet finished here (settled on prefill, released on decode)."""
        return len(self.live())

    @property
    def stats(self) -> dict[str, int]:
        """This agent's counters, by name (:mod:`~kvhandoff.session.rank.stats`)."""
        return agent_stats(self._desk, self._io, self._beats.watch)

    def close(self) -> None:
        """Fail live requests (telling their peers), deregister, stop every thread, close
        the sockets and (if owned) the transport. Idempotent; bounded in time."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        desk = self._desk
        for r in desk.close_requests() if desk is not None else []:
            r.on_agent_closed()
        self._leave()
        if self._io is not None:
            self._io.stop()
        if desk is not None:
            desk.close()
        if self._io is not None:
            self._io.close_transport()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        ep = self._io.control.endpoint if self._io is not None else "?"
        return f"<{type(self).__name__} {self.name} {ep}{' closed' if self._closed else ''}>"

    # --- the RankHost its requests see (any thread; see session/host.py) ----------------

    def attach(self, side: Request) -> Backlog:
        if self._desk is None:
            raise AgentClosed(f"agent {self.name} is closed")
        backlog = self._desk.attach(side)
        self._live.inc()
        return backlog

    def finished(self, side: Request) -> None:
        if self._desk is not None:
            self._desk.finished(side)
        self._live.dec()
        self._report.finished(side)

    def post(self, endpoint: str, msg: Message) -> None:
        """Send a control message (at the end of the calling thread's ``batched_writes``
        block on decode), unless ``endpoint`` was recently declared lost."""
        if not self._posts.hold(endpoint, msg):
            self._post_now(endpoint, msg)

    def _post_now(self, endpoint: str, msg: Message) -> None:
        if self._io is not None and not self._beats.watch.is_lost(endpoint):
            self._io.control.send(endpoint, msg)

    def track(self, handle: Handle, callback: Callback) -> None:
        assert self._io is not None
        self._io.track(handle, callback)

    def spawn(self, job: Callable[[], None]) -> None:
        if self._io is not None:
            self._io.spawn(job)

    # --- the old private attributes, still read by tests --------------------------------

    @property
    def _control(self) -> ControlChannel | None:
        return self._io.control if self._io is not None else None

    # --- control messages and timers (I/O thread) ----------------------------------------

    def _on_message(self, origin: Origin, msg: Message) -> None:
        """Heartbeats, then the desk; what neither takes is refused (session/dispatch.py)."""
        deliver(origin, msg, beats=self._beats, desk=self._desk, role=self.role, name=self.name,
                control=self._io.control if self._io is not None else None)


class Agent(AgentCore):
    """A rank's agent: calling ``Agent(layout, role=...)`` makes the role's class
    (:class:`PrefillAgent` or :class:`DecodeAgent`, typed so when ``role`` is a literal);
    a role's class may also be called directly, without ``role``. The arguments are
    :class:`AgentCore`'s."""

    @overload
    def __new__(cls, layout: Layout, *, role: PrefillRole, config: SessionConfig | None = None,
                transport: Transport | None = None, own_transport: bool = True,
                bootstrap_url: str | None = None, dp_rank: int = 0, dp_size: int = 1,
                name: str = "") -> PrefillAgent: ...

    @overload
    def __new__(cls, layout: Layout, *, role: DecodeRole, config: SessionConfig | None = None,
                transport: Transport | None = None, own_transport: bool = True,
                bootstrap_url: str | None = None, dp_rank: int = 0, dp_size: int = 1,
                name: str = "") -> DecodeAgent: ...

    @overload
    def __new__(cls, layout: Layout, *, role: Role | str | None = None,
                config: SessionConfig | None = None, transport: Transport | None = None,
                own_transport: bool = True,
                bootstrap_url: str | None = None, dp_rank: int = 0, dp_size: int = 1,
                name: str = "") -> Self: ...

    def __new__(cls, layout: Layout, *, role: Role | str | None = None,
                config: SessionConfig | None = None, transport: Transport | None = None,
                own_transport: bool = True,
                bootstrap_url: str | None = None, dp_rank: int = 0, dp_size: int = 1,
                name: str = "") -> Agent:
        del config, transport, own_transport, bootstrap_url, dp_rank, dp_size, name
        if cls is Agent:
            if role is None:
                raise TypeError("Agent(...) needs role= ('prefill' or 'decode'), or use "
                                "PrefillAgent / DecodeAgent")
            cls = PrefillAgent if Role(role) is Role.PREFILL else DecodeAgent
        return object.__new__(cls)

    @classmethod
    def prefill(cls, layout: Layout, *, bootstrap_url: str, dp_rank: int = 0, dp_size: int = 1,
                config: SessionConfig | None = None, transport: Transport | None = None,
                own_transport: bool = True) -> PrefillAgent:
        return PrefillAgent(layout, bootstrap_url=bootstrap_url, dp_rank=dp_rank,
                            dp_size=dp_size, config=config, transport=transport,
                            own_transport=own_transport)

    @classmethod
    def decode(cls, layout: Layout, *, dp_rank: int = 0, dp_size: int = 1,
               config: SessionConfig | None = None, transport: Transport | None = None,
               own_transport: bool = True) -> DecodeAgent:
        return DecodeAgent(layout, dp_rank=dp_rank, dp_size=dp_size, config=config,
                           transport=transport, own_transport=own_transport)


class PrefillAgent(Agent):
    """A prefill rank: registers with the bootstrap server, serves decode ranks' indices
    to its :class:`Sender` s (a :class:`~kvhandoff.session.request.host.PrefillHost`)."""

    _role = Role.PREFILL
    _desk: PrefillDesk | None

    def _open_desk(self, io: RankIO, dp_rank: int, dp_size: int) -> None:
        assert self._bootstrap_url is not None  # checked in __init__
        self._desk = desk = PrefillDesk(self, io.control, name=self.name)
        desk.register(self._bootstrap_url, dp_rank, dp_size, self._beats.probe)

    def batched_writes(self) -> contextlib.AbstractContextManager[None]:
        """The writes the calling thread's Senders decide are held, then submitted
        batched per decode rank when it exits (one submit and one in-band notice for all;
        :mod:`~kvhandoff.session.control.write_batch`); writes decided on the control
        thread are always batched per burst of messages. Nothing held leaves before the
        block exits: never wait on one of its requests inside it."""
        return self._posts.held() if self._desk is None else self._desk.writes.held()

    def live(self) -> list[Sender]:
        return [] if self._desk is None else self._desk.live()

    def notice(self, peer: DecodePeer, status: TransferStatus) -> bytes | None:
        return None if self._desk is None else self._desk.notice(peer, status)

    def defer_write(self, write: BatchedWrite) -> bool:
        return self._desk is not None and self._desk.writes.defer(write)

    def write_failed(self, peer: DecodePeer) -> None:
        """A write to ``peer`` failed (any thread). Its requests fail by themselves, but
        a dead rank must not linger once no request is left to watch it: the endpoint is
        probed by heartbeat until it answers, or is declared lost and dropped."""
        with self._lock:
            if not self._closed:
                self._beats.watch.suspect(peer.endpoint)

    def _drained(self) -> None:
        """Submit the writes the burst of messages produced, batched
        (:mod:`~kvhandoff.session.control.write_batch`)."""
        if self._desk is not None:
            self._desk.writes.flush()

    def _leave(self) -> None:
        if self._desk is not None:
            self._desk.leave()

    @property
    def _peers(self) -> DecodePeers | None:  # still read by tests
        return self._desk.peers if self._desk is not None else None


class DecodeAgent(Agent):
    """A decode rank: finds prefill ranks through the bootstrap server, per address, for
    its :class:`Receiver` s (a :class:`~kvhandoff.session.request.host.DecodeHost`)."""

    _role = Role.DECODE
    _desk: DecodeDesk | None

    def _open_desk(self, io: RankIO, dp_rank: int, dp_size: int) -> None:
        self._desk = DecodeDesk(self, name=self.name, control_endpoint=io.control.endpoint,
                                transport_endpoint=io.transport_endpoint, stop=self._stop)

    def batched_writes(self) -> contextlib.AbstractContextManager[None]:
        """The calling thread's Receivers' indices go out as one message per prefill rank
        when it exits (:mod:`~kvhandoff.session.control.post_batch`). Nothing held leaves
        before the block exits: never wait on one of its requests inside it."""
        return self._posts.held()

    def live(self) -> list[Receiver]:
        return [] if self._desk is None else self._desk.live()

    def handshake(self, bootstrap_addr: str, *, instance: str | None = None,
                  timeout: float | None = None) -> SessionError | None:
        """Look up and handshake prefill instance ``instance`` (DP rank 0) at
        ``bootstrap_addr`` now instead of on the first request, so an incompatible pair
        surfaces at start-up. Returns None once handshaken, else why not (a
        :class:`~kvhandoff.session.errors.HandshakeError` names every incompatibility; a
        :class:`BootstrapFailed` may only mean prefill is not up yet). A failed attempt is
        forgotten: the first request tries again."""
        desk = self._desk
        if desk is None:
            raise AgentClosed(f"agent {self.name} did not start")
        return desk.handshake(bootstrap_addr, instance or self.config.instance,
                              self.config.bootstrap_timeout if timeout is None else timeout)

    @property
    def groups(self) -> PrefillGroups:
        """The prefill groups this rank found (shared by its Receivers)."""
        if self._desk is None:
            raise AgentClosed(f"agent {self.name} did not start")
        return self._desk.groups

    def _unauthenticated(self, endpoint: str, reason: str) -> None:
        """A handshake waiting for ``endpoint`` fails now, with ``reason``."""
        if self._desk is not None:
            self._desk.groups.refuse(endpoint, reason)


def as_prefill(agent: Agent) -> PrefillAgent:
    """``agent``, typed as the prefill agent it is: for code whose role is a run-time
    value (an adapter configured by its engine). Raises ``TypeError`` naming the agent
    when it is a decode agent."""
    if not isinstance(agent, PrefillAgent):
        raise TypeError(f"a prefill agent is needed here, got {agent!r}")
    return agent


def as_decode(agent: Agent) -> DecodeAgent:
    """``agent``, typed as the decode agent it is (see :func:`as_prefill`)."""
    if not isinstance(agent, DecodeAgent):
        raise TypeError(f"a decode agent is needed here, got {agent!r}")
    return agent
