"""The decode desk: the part of a decode agent that knows prefill groups and Receivers.

It finds and handshakes prefill ranks, per bootstrap address, when the first Receiver
needs them (:class:`~kvhandoff.session.peers.prefill_groups.PrefillGroups`, shared by
every request of the rank), and routes prefill ranks' answers to this rank's
:class:`~kvhandoff.session.request.receiver.Receiver` of the request: chunk statuses (over the
control socket, or in band with the writes through the transport's notices,
:mod:`~kvhandoff.session.rank.notices`), aborts, abort acks and error replies.

Authorization: a message about a request is taken only from that request's own prefill
ranks (the ranks of its prefill group, as handshaken, or those its indices went to): an
``Abort``, a ``TransferStatus`` or an ``ErrorReply`` naming a request from any other
endpoint changes nothing, and is counted in :attr:`DecodeDesk.not_request_peer`. (With
the deployment secret, the endpoint is authenticated; without, it is only what the
peer claims.) A reason a prefill rank gives (abort, failed status, error reply) is cut to
``MAX_REASON`` characters before a Receiver keeps it.

The agent owns the sockets, threads and liveness and hands the desk every control
message it does not handle itself; the desk reaches the agent through the same
:class:`~kvhandoff.session.request.host.RankHost` its Receivers use.

Thread-safety: the desk lock guards only the Receivers table and is never held while
calling into a Receiver, which may call :meth:`attach`/:meth:`finished` under its own
lock. In-band statuses arrive on a transport thread.
"""

from __future__ import annotations

import logging
import threading

import msgspec

from kvhandoff.observe.report import process_metrics
from kvhandoff.protocol import (
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    ErrorCode,
    ErrorReply,
    Hello,
    HelloAck,
    HelloReject,
    Message,
    RequestId,
    StatusNotice,
    TransferStatus,
    layout_to_msg,
)
from kvhandoff.session.control.channel import Origin
from kvhandoff.session.errors import AgentClosed, BootstrapFailed, SessionError
from kvhandoff.session.peers.prefill_groups import GroupState, PrefillGroups
from kvhandoff.session.rank.backlog import MAX_REASON
from kvhandoff.session.rank.notices import NoticeRouter
from kvhandoff.session.request.host import NO_BACKLOG, Backlog, RankHost, Request
from kvhandoff.session.request.receiver import Receiver, bootstrap_url
from kvhandoff.transport.throttle import Throttle

log = logging.getLogger("kvhandoff.session.rank.agent")  # the agent's voice: one logger per agent
_foreign = Throttle(log)


class DecodeDesk:
    """See the module docstring."""

    def __init__(self, host: RankHost, *, name: str, control_endpoint: str,
                 transport_endpoint: bytes, stop: threading.Event) -> None:
        cfg, t = host.config, host.transport
        self._name = name
        self._control_endpoint = control_endpoint
        self._lock = threading.Lock()
        self._closed = False
        self.receivers: dict[RequestId, Receiver] = {}
        self.in_band = 0  # statuses that arrived in band
        self.not_request_peer = 0  # request messages from an endpoint not its peer
        self._router = NoticeRouter.of(t) if cfg.in_band_status else None
        if self._router is not None:
            self._router.add(control_endpoint, self._on_notice)
        hello = Hello(protocol_version=PROTOCOL_VERSION, rank=host.rank_id,
                      layout=layout_to_msg(host.layout), transport=t.name,
                      transport_endpoint=transport_endpoint, control_endpoint=control_endpoint,
                      notices=self._router is not None)
        self.groups = PrefillGroups(hello=hello, timeout=cfg.bootstrap_timeout,
                                    send=host.post, spawn=host.spawn, stop=stop,
                                    on_setup=process_metrics().peer_setup)

    # --- for Receivers (any thread) -------------------------------------------------------

    def attach(self, side: Request) -> Backlog:
        """Register a new Receiver (nothing waits for one: its backlog is empty)."""
        assert isinstance(side, Receiver)
        with self._lock:
            if self._closed:
                raise AgentClosed(f"agent {self._name} is closed")
            if side.request_id in self.receivers:
                raise ValueError(f"request id {side.request_id!r} is already live on this agent")
            self.receivers[side.request_id] = side
        return NO_BACKLOG

    def finished(self, side: Request) -> None:
        """Forget a released Receiver."""
        with self._lock:
            if self.receivers.get(side.request_id) is side:
                del self.receivers[side.request_id]

    def live(self) -> list[Receiver]:
        with self._lock:
            return [*self.receivers.values()]

    def handshake(self, bootstrap_addr: str, instance: str, timeout: float
                  ) -> SessionError | None:
        """Look up and handshake DP rank 0 of prefill ``instance`` at ``bootstrap_addr``,
        waiting up to ``timeout`` seconds; None once handshaken, else why not."""
        group = self.groups.get((bootstrap_url(bootstrap_addr), instance, 0))
        group.wait(timeout)
        if group.state is GroupState.READY:
            return None
        return group.error or BootstrapFailed(
            f"prefill instance at {bootstrap_addr} not handshaken within the timeout")

    def _receiver(self, rid: RequestId) -> Receiver | None:
        with self._lock:
            return self.receivers.get(rid)

    # --- prefill ranks' messages (I/O thread; in-band statuses: a transport thread) --------

    def on_message(self, origin: Origin, msg: Message) -> bool:
        """Handle a message the agent passed on; False when a decode rank takes none
        such (from this origin)."""
        match msg:
            case Abort():
                r = self._peer_of(origin, msg.request_id, "Abort")
                if r is not None:
                    r.on_abort(str(msg.rank), msg.reason[:MAX_REASON])
            case ErrorReply():
                self._on_error_reply(origin, msg)
            case HelloAck() | HelloReject() if origin.endpoint:
                if not self.groups.on_reply(origin.endpoint, msg):
                    log.debug("unexpected handshake answer from %s", origin)
            case TransferStatus() if origin.endpoint:
                r = self._peer_of(origin, msg.request_id, "TransferStatus")
                if r is not None:
                    if len(msg.reason) > MAX_REASON:
                        msg = msgspec.structs.replace(msg, reason=msg.reason[:MAX_REASON])
                    r.on_status(origin.endpoint, msg)
            case AbortAck() if origin.endpoint:
                r = self._receiver(msg.request_id)
                if r is not None:
                    r.on_abort_ack(origin.endpoint)
            case _:
                return False
        return True

    def _peer_of(self, origin: Origin, rid: RequestId, what: str) -> Receiver | None:
        """The Receiver of ``rid`` if ``origin`` is one of its prefill ranks; else None
        (counted, and logged at a bounded rate, when the request is live here)."""
        r = self._receiver(rid)
        if r is None:
            return None
        ep = origin.endpoint
        if ep is not None and (ep in r.peer_endpoints() or ep in self._group_of(r)):
            return r
        with self._lock:
            self.not_request_peer += 1
        _foreign("agent %s: ignored %s for request %r from %s: not one of its prefill "
                 "ranks", self._name, what, rid, origin)
        return None

    def _group_of(self, r: Receiver) -> frozenset[str]:
        """The control endpoints of the prefill group ``r`` was routed to (empty before
        it is routed, or once the group is forgotten)."""
        if r.dp_rank is None:
            return frozenset()
        key = (r.url, r.instance, r.dp_rank)
        for g in self.groups.groups():
            if g.key == key:
                return g.endpoints
        return frozenset()

    def _on_notice(self, notice: StatusNotice) -> None:
        """An in-band status (a transport thread): as if it came over the control socket
        from ``notice.sender``."""
        statuses = notice.statuses  # a batched write's notice carries several
        with self._lock:
            self.in_band += len(statuses)
            found = [(self.receivers.get(st.request_id), st) for st in statuses]
        for r, st in found:
            if r is not None:
                r.on_status(notice.sender, st)

    def _on_error_reply(self, origin: Origin, msg: ErrorReply) -> None:
        if origin.endpoint is None or msg.request_id is None:
            return
        r = self._peer_of(origin, msg.request_id, "ErrorReply")
        if r is None:  # about no request of ours, or from a rank it did not go to
            return
        unknown = msg.code is ErrorCode.UNKNOWN_PEER
        # a prefill rank that forgot our handshake (it restarted): forget the groups
        # that handshook with it before; one connecting now is already a fresh start
        self.groups.drop_endpoint(origin.endpoint, ready_only=unknown)
        if unknown:
            r.on_unknown_peer(origin.endpoint, msg.reason[:MAX_REASON])
        else:
            r.on_rejected(origin.endpoint, msg.reason[:MAX_REASON])

    # --- lost peers, closing ----------------------------------------------------------------

    def on_tick(self, now: float, in_use: set[str]) -> None:
        """Nothing of the decode desk's own runs on the tick (its Receivers' timers do, from
        the heartbeats)."""

    def counters(self) -> dict[str, int]:
        """Statuses received in band, handshaken prefill ranks, messages from a non-peer."""
        ready = sum(len(g.ranks) for g in self.groups.groups() if g.state is GroupState.READY)
        return {"in_band_statuses": self.in_band, "prefill_peers": ready,
                "not_request_peer": self.not_request_peer}

    def peer_lost(self, endpoint: str, reason: str) -> None:
        """Forget the groups that held the prefill rank at ``endpoint`` (after its
        requests heard of it)."""
        del reason
        self.groups.drop_endpoint(endpoint)

    def close_requests(self) -> list[Request]:
        """Take no more Receivers and no more in-band statuses; returns the live
        Receivers (to fail)."""
        with self._lock:
            self._closed = True
            live: list[Request] = [*self.receivers.values()]
        if self._router is not None:
            self._router.remove(self._control_endpoint)
        return live

    def close(self) -> None:
        """Forget every request."""
        with self._lock:
            self.receivers.clear()
