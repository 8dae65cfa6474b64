"""Prefill side: answer decode ranks' ``Hello`` and keep the ones accepted.

For each ``Hello`` (on a worker thread, since connecting may block up to the transport's
connect timeout): check the pair with :func:`~kvhandoff.session.compat.answer_hello`;
if it is compatible, connect this rank's transport to the decode rank's transport
endpoint (prefill *writes* into decode memory); answer ``HelloAck`` (with this rank's
layout, so decode can rebuild plans to verify checksums) or ``HelloReject`` naming every
problem, including an unreachable transport endpoint. An incompatible pair is refused
here, never mid-request.

Decode ranks are keyed by their control endpoint (unique per agent process); a second
Hello from the same endpoint replaces the first (its old transport peer is closed). A
rank whose transport peer gave up (its data connection broke) is re-dialed when it is
next needed (:meth:`DecodePeers.redial`), or dropped if that fails.

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvhandoff.layout import Layout
from kvhandoff.protocol import (
    PROTOCOL_VERSION,
    Hello,
    HelloAck,
    HelloReject,
    Message,
    RankId,
    layout_from_msg,
    layout_to_msg,
)
from kvhandoff.session.compat import answer_hello
from kvhandoff.transport.base import Peer, Transport
from kvhandoff.transport.errors import TransportError

log = logging.getLogger("kvhandoff.session.peers")

_GONE_MEMORY = 1024  # dropped ranks whose reason is kept


@dataclass(frozen=True, slots=True)
class DecodePeer:
    """A decode rank whose Hello this prefill rank accepted."""

    endpoint: str  # its control endpoint
    rank: RankId
    layout: Layout
    transport_peer: Peer
    writes: bool
    notices: bool = False  # takes statuses in band (its Hello said so)
    transport_endpoint: bytes = b""  # what its transport peer was dialed with


class DecodePeers:
    """The accepted decode ranks of one prefill rank; see the module docstring."""

    def __init__(self, *, layout: Layout, transport: Transport, rank: RankId,
                 send: Callable[[str, Message], None]) -> None:
        self._layout = layout
        self._layout_msg = layout_to_msg(layout)
        self._transport = transport
        self._rank = rank
        self._send = send
        self._lock = threading.Lock()
        self._peers: dict[str, DecodePeer] = {}
        self._dialing: dict[str, threading.Lock] = {}  # one redial per rank at a time
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()  # why dropped
        self._closed = False

    def get(self, endpoint: str | None) -> DecodePeer | None:
        if endpoint is None:
            return None
        with self._lock:
            return self._peers.get(endpoint)

    def __len__(self) -> int:
        with self._lock:
            return len(self._peers)

    def answer(self, sender: str | None, hello: Hello) -> None:
        """Check, connect, store and answer one Hello (worker thread)."""
        reply = self._check(sender, hello)
        if isinstance(reply, HelloAck):
            peer = self._connect(hello, reply)
            if isinstance(peer, HelloReject):
                reply = peer
            else:
                old = self._store(peer)
                if old is not None:
                    old.transport_peer.close()
                reply = HelloAck(protocol_version=PROTOCOL_VERSION, rank=self._rank,
                                 layout_signature=reply.layout_signature, writes=reply.writes,
                                 layout=self._layout_msg)
        else:
            log.warning("rejected Hello from %s (%s): %s", hello.control_endpoint, hello.rank,
                        "; ".join(reply.problems))
        self._send(hello.control_endpoint, reply)

    def _check(self, sender: str | None, hello: Hello) -> HelloAck | HelloReject:
        if sender is not None and sender != hello.control_endpoint:
            return self._reject(f"Hello came from {sender} but names control endpoint "
                                f"{hello.control_endpoint}; each rank must send from the "
                                f"endpoint it advertises")
        return answer_hello(hello, layout=self._layout, transport=self._transport.name,
                            rank=self._rank, memory_kinds=self._transport.capabilities.memory)

    def _connect(self, hello: Hello, ack: HelloAck) -> DecodePeer | HelloReject:
        try:
            tpeer = self._transport.connect(hello.transport_endpoint)
        except TransportError as e:
            return self._reject(
                f"prefill {self._rank} cannot reach decode {hello.rank}'s {hello.transport} "
                f"transport endpoint: {e}; check that decode's transport listens on an "
                f"address prefill can route to")
        # answer_hello decoded the layout already; decoding again keeps it a pure function
        return DecodePeer(endpoint=hello.control_endpoint, rank=hello.rank,
                          layout=layout_from_msg(hello.layout), transport_peer=tpeer,
                          writes=ack.writes, notices=hello.notices,
                          transport_endpoint=hello.transport_endpoint)

    def _store(self, peer: DecodePeer) -> DecodePeer | None:
        with self._lock:
            if self._closed:
                peer.transport_peer.close()
                return None
            old = self._peers.get(peer.endpoint)
            self._peers[peer.endpoint] = peer
            return old

    def _reject(self, problem: str) -> HelloReject:
        return HelloReject(protocol_version=PROTOCOL_VERSION, rank=self._rank,
                           problems=(problem,))

    def redial(self, peer: DecodePeer) -> DecodePeer | str:
        """A fresh transport peer for ``peer``, whose own gave up (blocking, bounded by
        the transport's connect timeout; a worker thread): the rank's current peer if
        someone redialed or handshook meanwhile, else a copy with a new connection; or,
        if the rank cannot be reached, a sentence saying why (the rank is dropped)."""
        with self._lock:
            gate = self._dialing.setdefault(peer.endpoint, threading.Lock())
        with gate:
            with self._lock:
                now = self._peers.get(peer.endpoint)
            if now is None:
                return f"decode {peer.rank} was dropped (lost, or the agent closed)"
            if not now.transport_peer.closed:
                return now
            try:
                tpeer = self._transport.connect(now.transport_endpoint)
            except TransportError as e:
                why = (f"decode {peer.rank}'s data connection was lost and re-dialing its "
                       f"{self._transport.name} endpoint failed: {e}")
                self.drop(peer.endpoint, only=now, reason=why)
                return why
            fresh = dataclasses.replace(now, transport_peer=tpeer)
            with self._lock:
                if self._closed or self._peers.get(peer.endpoint) is not now:
                    tpeer.close()
                    current = self._peers.get(peer.endpoint)
                    return current if current is not None else \
                        f"decode {peer.rank} was dropped while re-dialing"
                self._peers[peer.endpoint] = fresh
            log.info("re-dialed decode %s's %s transport", peer.rank, self._transport.name)
            return fresh

    def drop(self, endpoint: str, only: DecodePeer | None = None, *,
             reason: str = "") -> DecodePeer | None:
        """Forget a lost decode rank and close its transport peer (pending writes fail);
        with ``only``, just when that is still the rank's peer (not a newer handshake).
        ``reason`` is remembered for a while: see :meth:`why_gone`."""
        with self._lock:
            peer = self._peers.get(endpoint)
            if peer is None or (only is not None and peer is not only):
                return None
            del self._peers[endpoint]
            self._dialing.pop(endpoint, None)  # a redial holding it finds the rank gone
            self._gone[endpoint] = reason or "dropped"
            while len(self._gone) > _GONE_MEMORY:
                self._gone.popitem(last=False)
        peer.transport_peer.close()
        return peer

    def why_gone(self, endpoint: str) -> str:
        """Why the rank at ``endpoint`` was dropped (recent drops only)."""
        with self._lock:
            return self._gone.get(endpoint, "not handshaken (or dropped long ago)")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
        for p in peers:
            p.transport_peer.close()
