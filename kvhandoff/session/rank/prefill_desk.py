"""The prefill desk: the part of a prefill agent that knows decode ranks and Senders.

It registers the rank with the bootstrap server (and deregisters it on close), answers
decode ranks' handshakes (:class:`~kvhandoff.session.peers.decode_ranks.DecodePeers`), and routes
their ``TransferInit`` and ``Abort`` messages to this rank's
:class:`~kvhandoff.session.request.sender.Sender` of the request. What arrives before a request
has a Sender, and the tombstones of requests that failed here, are kept, bounded, in a
:class:`~kvhandoff.session.rank.backlog.PrefillBacklog`; whose indices a Sender takes (by
its request's key, :mod:`kvhandoff.binding`, or the rule against a second set of
indices), and which endpoints may abort a request, is :mod:`~kvhandoff.session.rank.claims`.
What the desk answers for a request itself is :mod:`~kvhandoff.session.rank.prefill_answers`:
only a handshaken decode rank is ever dialed, anyone else is answered on the connection
it came from.

The agent hands the desk every control message it does not handle itself; the desk
reaches the agent through the :class:`~kvhandoff.session.request.host.RankHost` its Senders
use, plus the control channel (to answer an unnamed client).

Thread-safety: the desk lock guards only its tables and is never held while calling
into a Sender, which may call :meth:`attach`/:meth:`finished` under its own lock.
"""

from __future__ import annotations

import functools
import logging
import threading
import time

from kvhandoff.bootstrap.registration import Probe, Registration, prefill_record
from kvhandoff.observe.report import process_metrics
from kvhandoff.protocol import (
    Abort,
    ErrorReply,
    Hello,
    Message,
    RequestId,
    TransferInit,
    TransferInits,
    TransferStatus,
)
from kvhandoff.session.control.channel import ControlChannel, Origin
from kvhandoff.session.control.write_batch import WriteBatcher
from kvhandoff.session.errors import AgentClosed, SessionError, TransferFailed
from kvhandoff.session.peers.decode_ranks import DecodePeer, DecodePeers
from kvhandoff.session.rank.backlog import MAX_REASON, Buffered, PrefillBacklog, Tomb, id_problem
from kvhandoff.session.rank.claims import (
    Buffering,
    Claims,
    Refused,
    abort_from,
    buffer,
    refusal,
    slot_of,
    two_endpoints,
)
from kvhandoff.session.rank.notices import in_band, in_band_all
from kvhandoff.session.rank.prefill_answers import ack_abort, tell_failed, unknown_peer
from kvhandoff.session.request.host import Backlog, RankHost, Request
from kvhandoff.session.request.sender import Sender
from kvhandoff.transport.throttle import Throttle

log = logging.getLogger("kvhandoff.session.rank.agent")  # the agent's voice: one logger per agent

_throttled = Throttle(log)
_refused = Throttle(log)  # indices refused as not the request's decode's: apart from the rest


class PrefillDesk:
    """See the module docstring."""

    def __init__(self, host: RankHost, control: ControlChannel, *, name: str) -> None:
        self._host = host
        self._control = control
        self._name = name
        self._lock = threading.Lock()
        self._closed = False
        self.senders: dict[RequestId, Sender] = {}
        self.backlog = PrefillBacklog(hold=host.config.indices_timeout,
                                      max_requests=host.config.max_pending_inits,
                                      who=f"prefill {host.rank_id}")
        self.claims = Claims()  # whose indices each live Sender took, per decode rank
        self.not_request_peer = 0  # aborts from an endpoint not the request's peer
        self.refused_claims = 0  # indices refused as not the request's decode's
        self._refused_metric = process_metrics().refused_claims
        self._registration: Registration | None = None
        self.peers = DecodePeers(layout=host.layout, transport=host.transport,
                                 rank=host.rank_id, send=host.post)
        self.writes = WriteBatcher(  # the Senders' writes, batched per burst (write_batch.py)
            transport=host.transport, track=host.track, on_io_thread=control.in_io_thread,
            notice=lambda p, sts: in_band_all(sts, to=p.endpoint, sender=control.endpoint,
                                              transport=host.transport, accepted=p.notices))

    # --- bootstrap registration ---------------------------------------------------------

    def register(self, url: str, dp_rank: int, dp_size: int, probe: Probe) -> None:
        """Register this rank at the bootstrap server ``url`` (see
        :mod:`~kvhandoff.bootstrap.registration`)."""
        h = self._host
        rec = prefill_record(h.config, h.layout, dp_rank=dp_rank, dp_size=dp_size,
                             control_endpoint=self._control.endpoint, transport=h.transport.name)
        self._registration = Registration.make(url, rec, config=h.config, probe=probe,
                                               what=f"prefill {h.rank_id}")

    def leave(self) -> None:
        """Deregister from the bootstrap server (once; a failure is only logged)."""
        if self._registration is not None:
            self._registration.leave()

    # --- for Senders (any thread) ---------------------------------------------------------

    def attach(self, side: Request) -> Backlog:
        """Register a new Sender; returns the indices buffered for it that it takes (with
        their decode peer, or why that rank was dropped since) and why it already failed,
        if it did. Buffered indices it does not take (:mod:`~kvhandoff.session.rank.claims`)
        are refused here. Indices from a rank whose data connection closed are handed
        over once it is re-dialed."""
        assert isinstance(side, Sender)
        with self._lock:
            if self._closed:
                raise AgentClosed(f"agent {self._name} is closed")
            if side.request_id in self.senders:
                raise ValueError(f"request id {side.request_id!r} is already live on this agent")
            self.senders[side.request_id] = side
            buffered, tomb = self.backlog.take(side.request_id)
        taken, failed = self._sort(side, buffered)
        ready: list[tuple[DecodePeer | str, TransferInit]] = []
        for b in taken:
            p = self.peers.get(b.endpoint)
            if p is None:
                ready.append((self.peers.why_gone(b.endpoint), b.msg))
            elif p.transport_peer.closed:
                self._host.spawn(functools.partial(self._redialed, p, b.msg, deliver=True))
            else:
                ready.append((p, b.msg))
        return Backlog(ready, tomb.error() if tomb is not None else failed)

    def _sort(self, side: Sender, buffered: list[Buffered]
              ) -> tuple[list[Buffered], SessionError | None]:
        """The buffered indices ``side`` takes, and why it fails (two endpoints for one
        decode rank: both are told, nothing was written to either). Those it may not
        take are refused."""
        taken: list[Buffered] = []
        for b in buffered:
            bad = refusal(side.key, b.msg, b.endpoint, b.transport)
            if bad is not None:
                self._refuse(b.endpoint, b.msg, *bad)
            else:
                taken.append(b)
        with self._lock:
            firsts = [self.claims.take(side.request_id, slot_of(b.msg.rank), b.endpoint)
                      for b in taken]
        twice = [(f, b) for f, b in zip(firsts, taken, strict=True) if f is not None]
        if not twice:
            return taken, None
        first, b = twice[0]
        why = two_endpoints(side.request_id, b.msg.rank, first, b.endpoint)
        _throttled("prefill %s: %s", self._host.rank_id, why)
        for ep in {x.endpoint for x in taken}:
            tell_failed(self._host, ep, side.request_id, why, ack=True)
        return [], TransferFailed(why)

    def finished(self, side: Request) -> None:
        """Forget a settled Sender; a failed one is remembered as a tombstone."""
        assert isinstance(side, Sender)
        unsafe = side.unsafe_endpoints()
        with self._lock:
            if self.senders.get(side.request_id) is side:
                del self.senders[side.request_id]
                self.claims.drop(side.request_id)
            if side.reason is not None:
                self.backlog.tombstone(side.request_id, side.reason, time.monotonic(), unsafe)

    def notice(self, peer: DecodePeer, status: TransferStatus) -> bytes | None:
        """``status`` as the in-band notice of its chunk's writes to ``peer``, or None
        when it goes over the control socket (see :mod:`kvhandoff.session.rank.notices`)."""
        return in_band(status, to=peer.endpoint, sender=self._control.endpoint,
                       transport=self._host.transport, accepted=peer.notices)

    def live(self) -> list[Sender]:
        with self._lock:
            return [*self.senders.values()]

    # --- control messages (I/O thread) ----------------------------------------------------

    def on_message(self, origin: Origin, msg: Message) -> bool:
        """Handle a message the agent passed on; False when a prefill rank takes none such."""
        match msg:
            case Hello() if origin.endpoint is None:
                self._control.reply(origin, self.peers.refuse_unnamed(msg))
            case Hello():
                self.peers.offer(origin.endpoint, msg)
            case TransferInit():
                self._on_init(origin, msg)
            case TransferInits():  # one engine step's, packed: each as if alone
                for m in msg.inits:
                    self._on_init(origin, m)
            case Abort():
                self._on_abort(origin, msg)
            case ErrorReply():
                pass  # logged by the agent; no Sender waits on a decode rank's answer
            case _:
                return False
        return True

    def _on_init(self, origin: Origin, msg: TransferInit) -> None:
        peer = self.peers.get(origin.endpoint)
        if peer is None or peer.rank != msg.rank:
            self._control.reply(origin, unknown_peer(origin, msg, peer))
            with self._lock:
                sender = self.senders.get(msg.request_id)
            if sender is not None and origin.endpoint is not None:
                sender.on_init_deferred(origin.endpoint)
            return
        bad = id_problem(msg.request_id)
        if bad is not None:
            self._control.reply(origin, ErrorReply(reason=f"TransferInit refused: {bad}"))
            return
        self.peers.touch(peer.endpoint)
        rid, ep = msg.request_id, peer.endpoint
        got, what = Buffering.BUFFERED, None
        with self._lock:
            sender = self.senders.get(rid)
            if sender is None:
                got, what = buffer(self.backlog, msg, ep, peer.transport_endpoint,
                                   time.monotonic())
        if sender is not None:
            self._offer(sender, peer, msg)
        elif got is Buffering.REPEAT:
            _throttled("request %r: decode %s sent its indices again before the Sender "
                       "started; the first set stands", rid, msg.rank)
        elif isinstance(what, Tomb):
            tell_failed(self._host, ep, rid, what.reason, ack=ep not in what.unsafe)
        elif isinstance(what, str):
            self._control.reply(origin, ErrorReply(reason=what, request_id=rid))
        elif peer.transport_peer.closed:
            # its data connection broke: re-dial now; the Sender to come gets the
            # buffered indices with the fresh peer (or re-dials itself, see attach)
            self._host.spawn(functools.partial(self._redialed, peer, msg, deliver=False))

    def _offer(self, sender: Sender, peer: DecodePeer, msg: TransferInit) -> None:
        """Indices for a live Sender: refused unless they are its request's decode's; a
        second endpoint for one decode rank fails the request (the second is told)."""
        bad = refusal(sender.key, msg, peer.endpoint, peer.transport_endpoint)
        if bad is not None:
            self._refuse(peer.endpoint, msg, *bad)
            return
        rid, ep = msg.request_id, peer.endpoint
        with self._lock:
            first = self.claims.take(rid, slot_of(msg.rank), ep)
        if first is not None:
            why = two_endpoints(rid, msg.rank, first, ep)
            _throttled("prefill %s: %s", self._host.rank_id, why)
            sender.on_init_refused(why)
            tell_failed(self._host, ep, rid, why, ack=True)
        elif peer.transport_peer.closed:  # its data connection broke: re-dial, then hand over
            self._host.spawn(functools.partial(self._redialed, peer, msg, deliver=True))
        else:
            sender.on_init(peer, msg)

    def _refuse(self, endpoint: str, msg: TransferInit, kind: Refused, why: str) -> None:
        """Refuse indices that are not the request's decode's (nothing was planned or
        written for them): counted, logged at a bounded rate, and the sender told —
        unless it is one of the request's own decode ranks (someone spoke under its
        name: its request goes on)."""
        rid = msg.request_id
        with self._lock:
            self.refused_claims += 1
            ours = self.claims.is_peer(rid, endpoint)
        self._refused_metric.labels(kind.value).inc()
        _refused("prefill %s: %s", self._host.rank_id, why)
        if not ours:
            tell_failed(self._host, endpoint, rid, why, ack=True)

    def _redialed(self, peer: DecodePeer, msg: TransferInit, *, deliver: bool) -> None:
        """Re-dial ``peer``'s broken data connection (a worker thread), then hand ``msg``
        to its Sender (``deliver``; else it waits in the buffer for one); if the rank
        cannot be reached, the request fails, naming why."""
        got = self.peers.redial(peer)
        with self._lock:
            sender = self.senders.get(msg.request_id)
            if not deliver:
                # an unreachable claimant's indices go; the last one's fail the request
                if isinstance(got, str) and sender is None and \
                        not self.backlog.drop_from(msg.request_id, peer.endpoint):
                    self.backlog.fail(msg.request_id, got, time.monotonic(), lost=True)
                return  # else the Sender's own attach re-dials (or finds the fresh peer)
        if sender is None:
            return
        if isinstance(got, str):
            sender.on_init_refused(f"request {msg.request_id!r}: {got}")
        else:
            sender.on_init(got, msg)

    def _on_abort(self, origin: Origin, msg: Abort) -> None:
        bad = id_problem(msg.request_id)
        if bad is not None:
            _throttled("agent %s: ignored an Abort from %s: %s", self._name, origin, bad)
            self._control.reply(origin, ErrorReply(reason=f"Abort refused: {bad}"))
            return
        reason = msg.reason[:MAX_REASON]
        rid, ep = msg.request_id, origin.endpoint
        with self._lock:
            s = self.senders.get(rid)
            tomb, ours = abort_from(self.claims, self.backlog, rid, ep,
                                    f"aborted by decode {msg.rank}: {reason}",
                                    time.monotonic(), has_sender=s is not None)
        if s is not None and not ours:
            ours = ep is not None and ep in s.peer_endpoints()  # asked to handshake again
        if not ours and tomb is None:
            with self._lock:
                self.not_request_peer += 1
            _throttled("agent %s: ignored an Abort of request %r from %s: not one of its "
                       "decode ranks", self._name, rid, origin)
        if s is not None and ours:
            s.on_abort(origin.endpoint, str(msg.rank), reason)
        elif tomb is not None and ep in tomb.unsafe:
            log.info("request %r: decode %s aborted; a cancelled write to it may still land, "
                     "so no AbortAck (it waits out its release_timeout)", rid, msg.rank)
        else:  # nothing of ours in flight to it: no Sender, its writes are over, or not a peer
            ack_abort(self._host, self._control, self.peers, origin, rid)

    # --- timers, lost peers, closing --------------------------------------------------------

    def on_tick(self, now: float, in_use: set[str]) -> None:
        """Forget expired tombstones and indices no Sender came for, and drop decode ranks
        idle for ``PEER_IDLE_S`` (I/O thread). ``in_use``: the live Senders' peer endpoints,
        which the agent gathered for its heartbeats (so a tick takes each Sender's lock once)."""
        with self._lock:
            self.backlog.expire(now)
            self.claims.keep_only(self.senders)
            busy = self.backlog.endpoints()
        for ep in self.peers.idle(now, busy | in_use):
            self._host.spawn(functools.partial(self.peers.drop_idle, ep))

    def counters(self) -> dict[str, int]:
        """Handshaken decode ranks, requests whose decode indices wait for their Sender
        (``early_inits``), messages from a non-peer, indices refused as not the request's
        decode's (:mod:`kvhandoff.binding`)."""
        return {"decode_peers": len(self.peers), "early_inits": len(self.backlog.inits),
                "not_request_peer": self.not_request_peer,
                "refused_claims": self.refused_claims}

    def peer_lost(self, endpoint: str, reason: str) -> None:
        """Drop the decode rank at ``endpoint`` (after its requests heard of it)."""
        self.peers.drop(endpoint, reason=reason)

    def close_requests(self) -> list[Request]:
        """Take no more Senders; returns the live ones (to fail)."""
        with self._lock:
            self._closed = True
            return [*self.senders.values()]

    def close(self) -> None:
        """Refuse unsent writes, close the decode peers' connections, forget requests."""
        self.writes.close()
        self.peers.close()
        with self._lock:
            self.senders.clear()
            self.backlog.clear_inits()
            self.claims.clear()

