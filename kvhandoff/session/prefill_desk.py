"""The prefill desk: the part of a prefill agent that knows decode ranks and Senders.

It registers the rank with the bootstrap server (and deregisters it on close), answers
decode ranks' handshakes (:class:`~kvhandoff.session.peers.DecodePeers`), and routes
their ``TransferInit`` and ``Abort`` messages to this rank's
:class:`~kvhandoff.session.sender.Sender` of the request. What arrives before a request
has a Sender waits in a buffer (indices: up to ``indices_timeout``, at most
``max_pending_inits`` requests); a request that failed here is remembered as a
tombstone for as long, so late indices or aborts for it are answered.

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
from kvhandoff.session.bootstrap_client import BootstrapError, RankRecord, deregister
from kvhandoff.session.control import ControlChannel, Origin
from kvhandoff.session.errors import (
    AgentClosed,
    PeerLost,
    RequestAborted,
    SessionError,
)
from kvhandoff.session.host import Backlog, RankHost, Request
from kvhandoff.session.peers import DecodePeer, DecodePeers
from kvhandoff.session.registration import Probe, register_rank
from kvhandoff.session.sender import Sender
from kvhandoff.transport.base import MAX_NOTICE

log = logging.getLogger("kvhandoff.session.agent")  # the agent's voice: one logger per agent

_MAX_TOMBSTONES = 65536


class _Tomb(NamedTuple):
    """A failed request, remembered for a while."""

    reason: str
    expires: float  # time.monotonic()
    unsafe: frozenset[str]  # decode endpoints a cancelled write may still reach
    lost: bool = False  # failed for an unreachable decode rank, not an abort

    def error(self) -> SessionError:
        return PeerLost(self.reason) if self.lost else RequestAborted(self.reason)


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
        self._tombstones: collections.OrderedDict[RequestId, _Tomb] = \
            collections.OrderedDict()
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
                         model_signature=lay.model_signature)
        register_rank(url, rec, config=cfg, probe=probe, what=f"prefill {self._host.rank_id}")
        self._record, self._url = rec, url

    def leave(self) -> None:
        """Deregister from the bootstrap server (once; a failure is only logged)."""
        if self._record is not None and self._url is not None:
            try:
                deregister(self._url, self._record, retries=1, timeout=2.0)
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
            buffered = self._inits.pop(side.request_id, [])
            tomb = self._tombstones.pop(side.request_id, None)
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
        self._tombstones[rid] = _Tomb(reason, time.monotonic() + self._host.config.indices_timeout,
                                      unsafe, lost)
        while len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    # --- control messages (I/O thread) ----------------------------------------------------

    def on_message(self, origin: Origin, msg: Message) -> bool:
        """Handle a message the agent passed on; False when a prefill rank takes none
        such."""
        match msg:
            case Hello():
                peers = self.peers
                self._host.spawn(lambda: peers.answer(origin.endpoint, msg))
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
        now = time.monotonic()
        full = False
        with self._lock:
            sender = self.senders.get(msg.request_id)
            tomb = self._tombstones.get(msg.request_id)
            if sender is None and tomb is None:
                if len(self._inits) >= host.config.max_pending_inits and \
                        msg.request_id not in self._inits:
                    full = True
                else:
                    self._inits.setdefault(msg.request_id, []).append((peer.endpoint, msg, now))
        if peer.transport_peer.closed and tomb is None and not full:
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
        elif full:
            self._control.reply(origin, ErrorReply(
                reason=f"prefill {host.rank_id} holds {host.config.max_pending_inits} requests' "
                       f"indices with no Sender yet (max_pending_inits); refused",
                request_id=msg.request_id))

    def _redialed(self, peer: DecodePeer, msg: TransferInit, *, deliver: bool) -> None:
        """Re-dial ``peer``'s broken data connection (a worker thread), then hand ``msg``
        to its Sender (``deliver``; else it waits in the buffer for one); if the rank
        cannot be reached, the request fails, naming why."""
        got = self.peers.redial(peer)
        with self._lock:
            sender = self.senders.get(msg.request_id)
            if not deliver:
                if isinstance(got, str) and sender is None:
                    self._inits.pop(msg.request_id, None)
                    self._tombstone(msg.request_id, got, lost=True)  # its Sender fails on arrival
                return  # else the Sender's own attach re-dials (or finds the fresh peer)
        if sender is None:
            return
        if isinstance(got, str):
            sender.on_init_refused(f"request {msg.request_id!r}: {got}")
        else:
            sender.on_init(got, msg)

    def _on_abort(self, origin: Origin, msg: Abort) -> None:
        with self._lock:
            s = self.senders.get(msg.request_id)
            tomb = self._tombstones.get(msg.request_id)
            if s is None and tomb is None:
                self._inits.pop(msg.request_id, None)
                self._tombstone(msg.request_id, f"aborted by decode {msg.rank}: {msg.reason}")
        if s is not None:
            s.on_abort(origin.endpoint, str(msg.rank), msg.reason)
        elif tomb is not None and origin.endpoint in tomb.unsafe:
            log.info("request %r: decode %s aborted; a cancelled write to it may still land, "
                     "so no AbortAck (it waits out its release_timeout)", msg.request_id,
                     msg.rank)
        else:  # no Sender, or its writes to this rank are all over
            ack = AbortAck(request_id=msg.request_id, rank=self._host.rank_id)
            if origin.endpoint is not None:
                self._host.post(origin.endpoint, ack)
            else:
                self._control.reply(origin, ack)

    # --- timers, lost peers, closing --------------------------------------------------------

    def on_tick(self, now: float) -> None:
        """Forget expired tombstones and indices no Sender came for (I/O thread)."""
        limit = self._host.config.indices_timeout
        with self._lock:
            for rid in [k for k, t in self._tombstones.items() if t.expires < now]:
                del self._tombstones[rid]
            for rid in [k for k, v in self._inits.items() if now - v[0][2] > limit]:
                del self._inits[rid]

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

