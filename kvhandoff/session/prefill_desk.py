"""The prefill desk: the part of a prefill agent that knows decode ranks and Senders.

It registers the rank with the bootstrap server (and deregisters it on close), answers
decode ranks' handshakes (:class:`~kvhandoff.session.peers.DecodePeers`), and routes
their ``TransferInit`` and ``Abort`` messages to this rank's
:class:`~kvhandoff.session.sender.Sender` of the request. What arrives before a request
has a Sender waits in a buffer (indices: up to ``indices_timeout``, at most
``max_pending_inits`` requests); a request that failed here is remembered as a
tombstone for as long, so late indices or aborts for it are answered.

Authorization. A request's peers are the decode endpoints that sent its indices (buffered
or delivered) and those its Sender asked to handshake again. Only they may abort it: an
``Abort`` from anyone else changes nothing (it is answered ``AbortAck``, true for a rank
never written to, the same answer as for an id unknown here, so it reveals nothing) and
is counted in :attr:`PrefillDesk.not_request_peer`; so is an abort for an id with no
Sender and no indices here, which therefore leaves no tombstone. Each decode rank (tp,
pp) of a request sends its indices from one endpoint: indices for the same request and
rank from a second endpoint fail the request, loudly, on both (a rogue decode that sent
them first would otherwise get the KV and the real one starve, finding H2), and a
repeat from the same endpoint is ignored. With the deployment secret the endpoints are
authenticated (:mod:`~kvhandoff.session.control_auth`); without, they are only claimed.

Bounds. Nothing a peer sends may grow without bound or push out what a real request
left: a request id over ``MAX_ID_BYTES`` is refused; buffered indices are capped in bytes
(``MAX_INIT_BYTES``) and to one set per request and decode rank (a repeat is ignored, as
a live Sender does); an abort's reason is cut to ``MAX_REASON`` characters. Tombstones of
requests that had a Sender here are kept apart from those an ``Abort`` from a peer of a
request with no Sender yet creates (at most ``MAX_EARLY_ABORTS``, oldest forgotten
first), so aborts cannot evict a real one and the ``unsafe`` endpoints it remembers. Who
sent each rank's indices is kept only while the request has a Sender or buffered
indices. Only a handshaken decode rank is ever dialed: an answer to anyone else goes
back on the connection it came from.

The agent owns the sockets, threads and liveness and hands the desk every control
message it does not handle itself; the desk reaches the agent through the same
:class:`~kvhandoff.session.host.RankHost` its Senders use, plus the control channel (to
answer an unnamed client).

Thread-safety: the desk lock guards only its tables and is never held while calling
into a Sender, which may call :meth:`attach`/:meth:`finished` under its own lock.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from typing import NamedTuple

from kvhandoff.observe.report import metrics_url
from kvhandoff.protocol import (
    Abort,
    AbortAck,
    ErrorCode,
    ErrorReply,
    Hello,
    Message,
    Outcome,
    RequestId,
    StatusNotice,
    TransferInit,
    TransferStatus,
    encode_notice,
)
from kvhandoff.session.bootstrap_client import BootstrapError, RankRecord
from kvhandoff.session.control import ControlChannel, Origin
from kvhandoff.session.errors import (
    AgentClosed,
    PeerLost,
    RequestAborted,
    SessionError,
)
from kvhandoff.session.host import Backlog, RankHost, Request
from kvhandoff.session.peers import PEER_IDLE_S, DecodePeer, DecodePeers
from kvhandoff.session.registration import Probe, deregister_rank, register_rank
from kvhandoff.session.sender import Sender
from kvhandoff.transport.base import MAX_NOTICE
from kvhandoff.transport.throttle import Throttle

log = logging.getLogger("kvhandoff.session.agent")  # the agent's voice: one logger per agent

_MAX_TOMBSTONES = 65536  # requests that failed here (only local Senders make these)
MAX_EARLY_ABORTS = 4096
"""Aborts remembered for request ids with no Sender here (anyone can send these)."""
MAX_ID_BYTES = 1024
"""A request id longer than this (a ``str``'s UTF-8 bytes) is refused."""
MAX_REASON = 4096
"""Characters of an abort's reason that are kept."""
MAX_INIT_BYTES = 256 << 20
"""Bytes of index lists buffered for requests with no Sender yet, in all."""
_throttled = Throttle(log)


class _Tomb(NamedTuple):
    """A failed request, remembered for a while."""

    reason: str
    expires: float  # time.monotonic()
    unsafe: frozenset[str]  # decode endpoints a cancelled write may still reach
    lost: bool = False  # failed for an unreachable decode rank, not an abort

    def error(self) -> SessionError:
        return PeerLost(self.reason) if self.lost else RequestAborted(self.reason)


def _published(dial_host: str) -> dict[str, str]:
    """What a rank tells the bootstrap beyond its record: where its process serves its
    metrics, when it does (for ``kvhandoff status``)."""
    url = metrics_url(dial_host)
    return {"metrics": url} if url else {}


def id_problem(rid: RequestId) -> str | None:
    """Why a request id from the wire is refused (too long to keep), or None."""
    if isinstance(rid, str) and len(rid) * 4 > MAX_ID_BYTES and \
            len(rid.encode(errors="replace")) > MAX_ID_BYTES:
        return f"request id of {len(rid.encode(errors='replace'))} B (at most {MAX_ID_BYTES} B)"
    return None


def init_bytes(msg: TransferInit) -> int:
    """Bytes a buffered TransferInit holds in index lists (what its sender controls)."""
    return sum(len(m.items) + len(m.positions or b"") for m in msg.indices.values()
               if m is not None)


class PrefillDesk:
    """See the module docstring."""

    def __init__(self, host: RankHost, control: ControlChannel, *, name: str) -> None:
        self._host = host
        self._control = control
        self._name = name
        self._lock = threading.Lock()
        self._closed = False
        self.senders: dict[RequestId, Sender] = {}
        self._inits: collections.OrderedDict[RequestId, list[tuple[str, TransferInit, float]]] = \
            collections.OrderedDict()
        self._init_bytes = 0  # what the buffered index lists hold
        self._tombstones: collections.OrderedDict[RequestId, _Tomb] = \
            collections.OrderedDict()
        self._early: collections.OrderedDict[RequestId, _Tomb] = \
            collections.OrderedDict()  # aborts for ids no Sender here had
        # who sent each decode rank's indices, per request with a Sender or buffered
        # indices (at most one entry per handshaken decode rank: MAX_DECODE_PEERS)
        self._claims: dict[RequestId, dict[tuple[int, int], str]] = {}
        self.not_request_peer = 0  # aborts from an endpoint not the request's peer
        self._record: RankRecord | None = None
        self._url: str | None = None
        self.peers = DecodePeers(layout=host.layout, transport=host.transport,
                                 rank=host.rank_id, send=host.post)

    # --- bootstrap registration ---------------------------------------------------------

    def register(self, url: str, dp_rank: int, dp_size: int, probe: Probe) -> None:
        """Register this rank at the bootstrap server ``url`` (see
        :mod:`~kvhandoff.session.registration`)."""
        cfg, lay = self._host.config, self._host.layout
        rec = RankRecord(instance=cfg.instance, dp_size=dp_size, dp_rank=dp_rank,
                         tp_size=lay.tp_size, tp_rank=lay.tp_rank, pp_size=lay.pp_size,
                         pp_rank=lay.pp_rank, control_endpoint=self._control.endpoint,
                         transport=self._host.transport.name,
                         model_signature=lay.model_signature,
                         metadata=_published(cfg.dial_host))
        register_rank(url, rec, config=cfg, probe=probe, what=f"prefill {self._host.rank_id}")
        self._record, self._url = rec, url

    def leave(self) -> None:
        """Deregister from the bootstrap server (once; a failure is only logged)."""
        if self._record is not None and self._url is not None:
            try:
                deregister_rank(self._url, self._record, config=self._host.config)
            except BootstrapError as e:
                log.warning("deregistering %s failed: %s", self._host.rank_id, e)
            self._record = None

    # --- for Senders (any thread) ---------------------------------------------------------

    def attach(self, side: Request) -> Backlog:
        """Register a new Sender; returns the indices buffered for it (with their decode
        peer, or why that rank was dropped since) and why it already failed, if it did.
        Indices from a rank whose data connection closed are handed over once it is
        re-dialed."""
        assert isinstance(side, Sender)
        with self._lock:
            if self._closed:
                raise AgentClosed(f"agent {self._name} is closed")
            if side.request_id in self.senders:
                raise ValueError(f"request id {side.request_id!r} is already live on this agent")
            self.senders[side.request_id] = side
            buffered = self._take_inits(side.request_id)
            tomb = self._tombstones.pop(side.request_id, None)
            early = self._early.pop(side.request_id, None)
            tomb = tomb or early
        ready: list[tuple[DecodePeer | str, TransferInit]] = []
        for ep, m, _ in buffered:
            p = self.peers.get(ep)
            if p is None:
                ready.append((self.peers.why_gone(ep), m))
            elif p.transport_peer.closed:
                self._host.spawn(functools.partial(self._redialed, p, m, deliver=True))
            else:
                ready.append((p, m))
        return Backlog(ready, None if tomb is None else tomb.error())

    def finished(self, side: Request) -> None:
        """Forget a settled Sender; a failed one is remembered as a tombstone."""
        assert isinstance(side, Sender)
        unsafe = side.unsafe_endpoints()
        with self._lock:
            if self.senders.get(side.request_id) is side:
                del self.senders[side.request_id]
                self._claims.pop(side.request_id, None)
            if side.reason is not None:
                self._tombstone(side.request_id, side.reason, unsafe)

    def notice(self, peer: DecodePeer, status: TransferStatus) -> bytes | None:
        """``status`` as the in-band notice of its chunk's writes to ``peer``, or None
        when it goes over the control socket (see :mod:`kvhandoff.session.notices`)."""
        if not (peer.notices and self._host.transport.capabilities.notices):
            return None
        data = encode_notice(StatusNotice(to=peer.endpoint, sender=self._control.endpoint,
                                          status=status))
        return data if len(data) <= MAX_NOTICE else None

    def live(self) -> list[Sender]:
        with self._lock:
            return [*self.senders.values()]

    def _tombstone(self, rid: RequestId, reason: str,
                   unsafe: frozenset[str] = frozenset(), *, lost: bool = False) -> None:
        """Remember a failed request for a while, so late indices or aborts for it are
        answered; ``unsafe``: decode endpoints a cancelled write may still reach, never
        told "no write in flight" (caller holds the lock)."""
        self._early.pop(rid, None)
        self._tombstones[rid] = _Tomb(reason[:MAX_REASON],
                                      time.monotonic() + self._host.config.indices_timeout,
                                      unsafe, lost)
        while len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _early_abort(self, rid: RequestId, reason: str) -> None:
        """Remember an abort for a request with no Sender here, in its own bounded table
        (caller holds the lock)."""
        self._early[rid] = _Tomb(reason[:MAX_REASON],
                                 time.monotonic() + self._host.config.indices_timeout,
                                 frozenset())
        while len(self._early) > MAX_EARLY_ABORTS:
            self._early.popitem(last=False)

    def _tomb(self, rid: RequestId) -> _Tomb | None:
        """The tombstone of ``rid``, from either table (caller holds the lock)."""
        tomb = self._tombstones.get(rid)
        return tomb if tomb is not None else self._early.get(rid)

    def _take_inits(self, rid: RequestId) -> list[tuple[str, TransferInit, float]]:
        """Remove and return the indices buffered for ``rid`` (caller holds the lock)."""
        got = self._inits.pop(rid, [])
        self._init_bytes -= sum(init_bytes(m) for _, m, _ in got)
        return got

    def _buffer(self, endpoint: str, msg: TransferInit, now: float) -> str | None:
        """Buffer indices that arrived before their Sender; why not, if refused (None
        also when this rank already sent a set: the first one stands, as a live Sender
        keeps it). Caller holds the lock."""
        rid, cfg = msg.request_id, self._host.config
        entries = self._inits.get(rid)
        if entries is None and len(self._inits) >= cfg.max_pending_inits:
            return (f"prefill {self._host.rank_id} holds {cfg.max_pending_inits} requests' "
                    f"indices with no Sender yet (max_pending_inits); refused")
        if entries is not None and any(ep == endpoint for ep, _, _ in entries):
            _throttled("request %r: decode %s sent its indices again before the Sender "
                       "started; the first set stands", rid, msg.rank)
            return None
        size = init_bytes(msg)
        if self._init_bytes + size > MAX_INIT_BYTES:
            return (f"prefill {self._host.rank_id} buffers {self._init_bytes} B of indices "
                    f"with no Sender yet; {size} B more would pass MAX_INIT_BYTES "
                    f"({MAX_INIT_BYTES} B); refused")
        self._inits.setdefault(rid, []).append((endpoint, msg, now))
        self._init_bytes += size
        return None

    # --- control messages (I/O thread) ----------------------------------------------------

    def on_message(self, origin: Origin, msg: Message) -> bool:
        """Handle a message the agent passed on; False when a prefill rank takes none
        such."""
        match msg:
            case Hello() if origin.endpoint is None:
                self._control.reply(origin, self.peers.refuse_unnamed(msg))
            case Hello():
                self.peers.offer(origin.endpoint, msg)
            case TransferInit():
                self._on_init(origin, msg)
            case Abort():
                self._on_abort(origin, msg)
            case ErrorReply():
                pass  # logged by the agent; no Sender waits on a decode rank's answer
            case _:
                return False
        return True

    def _sender(self, rid: RequestId) -> Sender | None:
        with self._lock:
            return self.senders.get(rid)

    def _on_init(self, origin: Origin, msg: TransferInit) -> None:
        host = self._host
        peer = self.peers.get(origin.endpoint)
        if peer is None or peer.rank != msg.rank:
            why = "no accepted Hello from it" if peer is None else \
                f"it handshook as {peer.rank}, not {msg.rank}"
            self._control.reply(origin, ErrorReply(
                reason=f"unknown decode peer {origin} ({why}); handshake again",
                request_id=msg.request_id, code=ErrorCode.UNKNOWN_PEER))
            sender = self._sender(msg.request_id)
            if sender is not None and origin.endpoint is not None:
                sender.on_init_deferred(origin.endpoint)
            return
        bad = id_problem(msg.request_id)
        if bad is not None:
            self._control.reply(origin, ErrorReply(reason=f"TransferInit refused: {bad}"))
            return
        self.peers.touch(peer.endpoint)
        now = time.monotonic()
        full: str | None = None
        rid, slot = msg.request_id, (msg.rank.tp_rank, msg.rank.pp_rank)
        with self._lock:
            sender = self.senders.get(rid)
            tomb = self._tomb(rid)
            first = None if tomb is not None else self._claims.get(rid, {}).get(slot)
            if first is not None and first != peer.endpoint:
                why = self._two_claims(rid, msg, first, peer.endpoint, sender is None)
            else:
                if sender is None and tomb is None:
                    full = self._buffer(peer.endpoint, msg, now)
                if tomb is None and full is None:
                    self._claims.setdefault(rid, {})[slot] = peer.endpoint
        if first is not None and first != peer.endpoint:
            self._fail_two_claims(rid, why, first, peer.endpoint, sender)
            return
        if peer.transport_peer.closed and tomb is None and full is None:
            # its data connection broke: re-dial now; a Sender still to come gets the
            # buffered indices with the fresh peer (or re-dials itself, see above)
            host.spawn(functools.partial(self._redialed, peer, msg, deliver=sender is not None))
        elif sender is not None:
            sender.on_init(peer, msg)
        elif tomb is not None:
            host.post(peer.endpoint, TransferStatus(
                request_id=msg.request_id, rank=host.rank_id, chunk=0, last=True,
                outcome=Outcome.FAILED, reason=tomb.reason))
            if peer.endpoint not in tomb.unsafe:
                host.post(peer.endpoint, AbortAck(request_id=msg.request_id, rank=host.rank_id))
        elif full is not None:
            self._control.reply(origin, ErrorReply(reason=full, request_id=msg.request_id))

    def _two_claims(self, rid: RequestId, msg: TransferInit, first: str, second: str,
                    buffered: bool) -> str:
        """Indices for decode rank ``msg.rank`` of ``rid`` came from ``second`` after
        ``first``: why the request fails. Buffered indices are dropped and the request
        tombstoned, so its Sender fails on arrival (caller holds the lock)."""
        why = (f"request {rid!r}: decode rank tp {msg.rank.tp_rank} pp {msg.rank.pp_rank} "
               f"sent its indices from two endpoints ({first}, then {second}); the request "
               f"is failed rather than handed to either (one may be an impostor taking "
               f"the KV)")
        if buffered:
            self._take_inits(rid)
            self._claims.pop(rid, None)
            self._tombstone(rid, why)
        return why

    def _fail_two_claims(self, rid: RequestId, why: str, first: str, second: str,
                         sender: Sender | None) -> None:
        """Tell both endpoints of :meth:`_two_claims` (without the lock): the second was
        never written to; so was the first if no Sender had its indices yet. A live
        Sender fails, telling its own ranks (and acks once nothing is in flight)."""
        host = self._host
        _throttled("prefill %s: %s", host.rank_id, why)
        if sender is not None:
            sender.on_init_refused(why)
        for ep in ([second] if sender is not None else [first, second]):
            host.post(ep, TransferStatus(request_id=rid, rank=host.rank_id, chunk=0, last=True,
                                         outcome=Outcome.FAILED, reason=why))
            host.post(ep, AbortAck(request_id=rid, rank=host.rank_id))

    def _redialed(self, peer: DecodePeer, msg: TransferInit, *, deliver: bool) -> None:
        """Re-dial ``peer``'s broken data connection (a worker thread), then hand ``msg``
        to its Sender (``deliver``; else it waits in the buffer for one); if the rank
        cannot be reached, the request fails, naming why."""
        got = self.peers.redial(peer)
        with self._lock:
            sender = self.senders.get(msg.request_id)
            if not deliver:
                if isinstance(got, str) and sender is None:
                    self._take_inits(msg.request_id)
                    self._tombstone(msg.request_id, got, lost=True)  # its Sender fails on arrival
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
            tomb = self._tomb(rid)
            ours = ep is not None and ep in self._claims.get(rid, {}).values()
            if s is None and tomb is None and ours:
                self._take_inits(rid)
                self._claims.pop(rid, None)
                self._early_abort(rid, f"aborted by decode {msg.rank}: {reason}")
        if s is not None and not ours:
            ours = ep is not None and ep in s.peer_endpoints()  # asked to handshake again
        if not ours and tomb is None:
            with self._lock:
                self.not_request_peer += 1
            _throttled("agent %s: ignored an Abort of request %r from %s: not one of its "
                       "decode ranks", self._name, rid, origin)
        if s is not None and ours:
            s.on_abort(origin.endpoint, str(msg.rank), reason)
        elif tomb is not None and origin.endpoint in tomb.unsafe:
            log.info("request %r: decode %s aborted; a cancelled write to it may still land, "
                     "so no AbortAck (it waits out its release_timeout)", msg.request_id,
                     msg.rank)
        else:  # nothing of ours in flight to it: no Sender, its writes are over, or not a peer
            ack = AbortAck(request_id=msg.request_id, rank=self._host.rank_id)
            if origin.endpoint is not None and self.peers.get(origin.endpoint) is not None:
                self._host.post(origin.endpoint, ack)  # dial handshaken ranks only
            else:
                self._control.reply(origin, ack)

    # --- timers, lost peers, closing --------------------------------------------------------

    def on_tick(self, now: float, in_use: set[str]) -> None:
        """Forget expired tombstones and indices no Sender came for, and drop decode
        ranks idle for ``PEER_IDLE_S`` (on a worker: closing one joins its threads)
        (I/O thread). ``in_use``: the peer endpoints of the live Senders, which the agent
        has just gathered for its heartbeats (so the tick takes each Sender's lock once)."""
        limit = self._host.config.indices_timeout
        with self._lock:
            for table in (self._tombstones, self._early):
                for rid in [k for k, t in table.items() if t.expires < now]:
                    del table[rid]
            for rid in [k for k, v in self._inits.items() if now - v[0][2] > limit]:
                self._take_inits(rid)
            for rid in [k for k in self._claims if k not in self.senders
                        and k not in self._inits]:
                del self._claims[rid]  # indices that expired or were dropped
            busy = {ep for entries in self._inits.values() for ep, _, _ in entries}
        for ep in self.peers.idle(now, busy | in_use):
            self._host.spawn(functools.partial(self._drop_idle, ep))

    def _drop_idle(self, endpoint: str) -> None:
        """Drop a decode rank nothing used for ``PEER_IDLE_S`` (a worker thread)."""
        why = f"decode rank at {endpoint} idle for over {PEER_IDLE_S:g} s (PEER_IDLE_S)"
        if self.peers.drop(endpoint, reason=why) is not None:
            log.info("agent %s: %s; dropped (it handshakes again if it comes back)",
                     self._name, why)

    def peer_lost(self, endpoint: str, reason: str) -> None:
        """Drop the decode rank at ``endpoint`` (after its requests heard of it)."""
        self.peers.drop(endpoint, reason=reason)

    def close_requests(self) -> list[Request]:
        """Take no more Senders; returns the live ones (to fail)."""
        with self._lock:
            self._closed = True
            return [*self.senders.values()]

    def close(self) -> None:
        """Close the decode peers' data connections and forget every request."""
        self.peers.close()
        with self._lock:
            self.senders.clear()
            self._inits.clear()
            self._claims.clear()
            self._init_bytes = 0

