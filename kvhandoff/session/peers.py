"""Prefill side: answer decode ranks' ``Hello`` and keep the ones accepted.

For each ``Hello`` (on a worker thread, since connecting may block up to the transport's
connect timeout): check the pair with :func:`~kvhandoff.session.compat.answer_hello`;
if it is compatible, connect this rank's transport to the decode rank's transport
endpoint (prefill *writes* into decode memory); answer ``HelloAck`` (with this rank's
layout, so decode can rebuild plans to verify checksums) or ``HelloReject`` naming every
problem, including an unreachable transport endpoint. An incompatible pair is refused
here, never mid-request.

Decode ranks are keyed by their control endpoint (unique per agent process); a second
Hello from the same endpoint replaces the first (its old transport peer is closed).

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class DecodePeer:
    """A decode rank whose Hello this prefill rank accepted."""

    endpoint: str  # its control endpoint
    rank: RankId
    layout: Layout
    transport_peer: Peer
    writes: bool
    notices: bool = False  # takes statuses in band (its Hello said so)


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
                          writes=ack.writes, notices=hello.notices)

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

    def drop(self, endpoint: str) -> DecodePeer | None:
        """Forget a lost decode rank and close its transport peer (pending writes fail)."""
        with self._lock:
            peer = self._peers.pop(endpoint, None)
        if peer is not None:
            peer.transport_peer.close()
        return peer

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
        for p in peers:
            p.transport_peer.close()
