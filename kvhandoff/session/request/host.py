"""The seam between a request and its rank: what each sees of the other.

A :class:`~kvhandoff.session.request.sender.Sender` or
:class:`~kvhandoff.session.request.receiver.Receiver`
sees its agent only as a :class:`RankHost`; the agent and its role's desk see a live
request only as a :class:`Request` (plus the role's own ``on_*`` entry points). Both are
protocols, so imports run one way only, and a request can be driven by a fake host::

    agent ──> prefill_desk ──> sender ────┐
      └─────> decode_desk ───> receiver ──┴─> request_side ──> host

    sender ──> send_core ──┐
    receiver ─> recv_core ─┴─> request_core  (request_side uses it too)

Around them, each one idea and none importing back up::

    agent ──> heartbeats ──> prefill_desk, decode_desk   (the tick, pings, lost peers)
      ├─────> dispatch ──> heartbeats   (where each control message goes)
      ├─────> agent_stats ──> prefill_desk, decode_desk, rank_io   (the counters)
      └─────> rank_io        (transport, control channel, threads)
    prefill_desk ──> claims ──> backlog <── decode_desk  (who may abort; what waits)
      └────────────> prefill_answers   (what it answers for a request itself)

Each shell (``sender``, ``receiver``) holds the request's lock and does the I/O; its
core (``send_core``, ``recv_core``, sharing ``request_core``) decides, with no host, no
lock, no clock and no socket: events in, effects out.

What a request asks of its host, all of it:

* facts about the rank: its :class:`Role`, layout and components, config, rank id,
  endpoints, tensor views and transport;
* :meth:`RankHost.attach` once, when it is created, and :meth:`RankHost.finished` once,
  when it is over (settled on prefill, released on decode);
* I/O it must not do itself: :meth:`~RankHost.post` a control message, :meth:`~RankHost.track`
  a transfer handle, :meth:`~RankHost.spawn` a blocking job;
* prefill only (:class:`PrefillHost`): :meth:`~PrefillHost.notice` (a chunk status as
  an in-band notice), :meth:`~PrefillHost.defer_write` and
  :meth:`~PrefillHost.write_failed`; decode only (:class:`DecodeHost`):
  :attr:`~DecodeHost.groups`. A Sender takes a ``PrefillHost`` and a Receiver a
  ``DecodeHost``, so handing one the other role's agent is a type error.

Threading: every method may be called from any thread, with the request's lock held.
A host takes its own locks only after the request's, never the other way round, and
calls no request's ``on_*`` entry point from inside these methods, so the two never
deadlock.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

from kvhandoff.layout import Layout, TensorSpec
from kvhandoff.observe.timeline import Timeline
from kvhandoff.protocol import Message, RankId, RequestId, TransferInit, TransferStatus
from kvhandoff.session.config import SessionConfig
from kvhandoff.session.control.completion import Callback
from kvhandoff.session.control.write_batch import BatchedWrite
from kvhandoff.session.errors import SessionError
from kvhandoff.session.peers.decode_ranks import DecodePeer
from kvhandoff.session.peers.prefill_groups import PrefillGroups
from kvhandoff.session.request.views import TensorViews
from kvhandoff.transport.base import Handle, Transport


class Role(enum.StrEnum):
    """Which side of the handoff a rank is on."""

    PREFILL = "prefill"
    DECODE = "decode"


class Backlog(NamedTuple):
    """What reached a rank for a request before the request existed there."""

    #: buffered indices, each with its decode peer, or why that rank was dropped since
    inits: list[tuple[DecodePeer | str, TransferInit]]
    #: why the request already failed here (an abort or a lost rank came first)
    failed: SessionError | None


NO_BACKLOG = Backlog([], None)


class Request(Protocol):
    """A live request, as its host sees it (calls come from the agent's threads)."""

    @property
    def request_id(self) -> RequestId: ...

    @property
    def reason(self) -> str | None: ...

    @property
    def failure(self) -> str | None:
        """The error class that failed it, or None (for reports)."""

    @property
    def timeline(self) -> Timeline: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def events(self) -> Mapping[str, int]:
        """Notable events while it ran ("rehandshake", "refused_write", …), for reports."""

    @property
    def component_bytes(self) -> Mapping[str, int]:
        """Bytes planned per component (prefill; empty on decode)."""

    @property
    def peers(self) -> list[str]:
        """The other side's ranks it dealt with, for reports."""

    def on_tick(self, now: float) -> None:
        """Timers: fail what waited too long (the control I/O thread, every tick)."""

    def on_peer_lost(self, endpoint: str, reason: str) -> None:
        """The control endpoint ``endpoint`` was declared lost."""

    def on_agent_closed(self) -> None:
        """The agent is closing: fail, and stop waiting for anything."""

    def peer_endpoints(self) -> set[str]:
        """Control endpoints whose liveness this request depends on now."""
        ...


class RankHost(Protocol):
    """A rank's agent, as a request sees it; see the module docstring."""

    @property
    def role(self) -> Role: ...

    @property
    def layout(self) -> Layout: ...

    @property
    def config(self) -> SessionConfig: ...

    @property
    def rank_id(self) -> RankId: ...

    @property
    def endpoint(self) -> str:
        """This rank's control endpoint (what its peers know it by)."""
        ...

    @property
    def transport_endpoint(self) -> bytes:
        """What a peer's transport dials to reach this rank (its handshake names it)."""
        ...

    @property
    def views(self) -> TensorViews: ...

    @property
    def transport(self) -> Transport: ...

    @property
    def kv_name(self) -> str | None: ...

    @property
    def aux_name(self) -> str | None: ...

    @property
    def aux_tensor(self) -> TensorSpec | None: ...

    @property
    def state_names(self) -> tuple[str, ...]: ...

    @property
    def kv_repageable(self) -> bool: ...

    def attach(self, side: Request) -> Backlog:
        """Register a new request (raises :class:`AgentClosed` once closed, ``ValueError``
        for a request id already live here); returns its backlog."""
        ...

    def finished(self, side: Request) -> None:
        """The request is over here: forget it (prefill: remember a failure a while)."""

    def post(self, endpoint: str, msg: Message) -> None:
        """Queue a control message for ``endpoint`` (dropped if it was declared lost)."""

    def track(self, handle: Handle, callback: Callback) -> None:
        """Call ``callback`` when the transfer ``handle`` completes, fails or times out."""

    def spawn(self, job: Callable[[], None]) -> None:
        """Run a blocking ``job`` on a worker thread (dropped once the agent closes)."""


class PrefillHost(RankHost, Protocol):
    """A prefill rank's agent, as its :class:`~kvhandoff.session.request.sender.Sender` sees it."""

    def notice(self, peer: DecodePeer, status: TransferStatus) -> bytes | None:
        """``status`` as the in-band notice of writes to ``peer``, or None when
        it must go over the control socket."""
        ...

    def defer_write(self, write: BatchedWrite) -> bool:
        """Take ``write`` into a batch (True): the control I/O thread's, submitted
        once it handled every message that is ready, or the calling thread's inside
        ``Agent.batched_writes()``, submitted when that exits. False when the caller must
        submit it now (neither, or closing). See :mod:`kvhandoff.session.control.write_batch`."""
        ...

    def write_failed(self, peer: DecodePeer) -> None:
        """A write to ``peer`` failed; watch that rank until it answers."""


class DecodeHost(RankHost, Protocol):
    """A decode rank's agent, as its :class:`~kvhandoff.session.request.receiver.Receiver`
    sees it."""

    @property
    def groups(self) -> PrefillGroups:
        """The prefill groups (shared by every request of this rank)."""
        ...
