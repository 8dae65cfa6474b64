"""Prefill side: answer decode ranks' ``Hello`` and keep the ones accepted.

For each ``Hello`` (on one of this table's own ``MAX_DIALS`` dial threads, since
connecting may block up to the transport's connect timeout; never on the agent's worker
pool, so Hellos naming endpoints that never answer cannot hold it; beyond
``MAX_QUEUED_HELLOS`` waiting, a Hello is rejected at once as busy): check the pair
with :func:`~kvhandoff.session.peers.compat.answer_hello`; if it is compatible, connect this
rank's transport to the decode rank's transport endpoint (prefill *writes* into decode
memory); answer ``HelloAck`` (with this rank's
layout, so decode can rebuild plans to verify checksums) or ``HelloReject`` naming every
problem, including an unreachable transport endpoint. An incompatible pair is refused
here, never mid-request.

Decode ranks are keyed by their control endpoint (unique per agent process); a second
Hello from the same endpoint replaces the first (its old transport peer is closed). A
rank whose transport peer gave up (its data connection broke) is re-dialed when it is
next needed (:meth:`DecodePeers.redial`), or dropped if that fails.

Each accepted rank costs data connections, threads and descriptors, and a Hello is not
authenticated: at most ``MAX_DECODE_PEERS`` ranks are kept (a Hello beyond that is
rejected, naming the cap, before anything is dialed), and a rank that sent no Hello or
indices for ``PEER_IDLE_S`` seconds and serves no live request is dropped
(:meth:`DecodePeers.idle`; if it comes back its indices get "unknown decode peer" and it
handshakes again, as after a prefill restart).

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvhandoff.layout import Layout
from kvhandoff.protocol import (
    PROTOCOL_VERSION,
    Hello,
    HelloAck,
    HelloReject,
    Message,
    RankId,
    layout_to_msg,
)
from kvhandoff.session.peers.compat import answer_hello
from kvhandoff.transport.base import Peer, Transport
from kvhandoff.transport.errors import TransportError
from kvhandoff.transport.throttle import Throttle

log = logging.getLogger("kvhandoff.session.peers.decode_ranks")
_unnamed = Throttle(log)

_GONE_MEMORY = 1024  # dropped ranks whose reason is kept
MAX_DECODE_PEERS = 256
"""Decode ranks one prefill rank keeps handshakes with (a Hello beyond this is rejected)."""
PEER_IDLE_S = 600.0
"""A decode rank unused this long (no Hello, no indices, no live request) is dropped."""
MAX_DIALS = 16
"""Hellos whose transport endpoint is being dialed at once (each up to connect_timeout)."""
MAX_QUEUED_HELLOS = 64
"""Hellos waiting for a dial thread; one more is rejected at once (the rank retries)."""


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
        self._used: dict[str, float] = {}  # endpoint → last Hello or indices (monotonic)
        self._queued = 0  # Hellos offered and not answered yet
        self._dialer = ThreadPoolExecutor(MAX_DIALS, thread_name_prefix=f"kvh-dial-{rank}")
        self._closed = False

    def get(self, endpoint: str | None) -> DecodePeer | None:
        if endpoint is None:
            return None
        with self._lock:
            return self._peers.get(endpoint)

    def __len__(self) -> int:
        with self._lock:
            return len(self._peers)

    def offer(self, sender: str | None, hello: Hello) -> None:
        """Answer ``hello`` on a dial thread (any thread; returns at once). Rejected at
        once when ``MAX_QUEUED_HELLOS`` already wait; dropped once closed."""
        with self._lock:
            if self._closed:
                return
            busy = self._queued >= MAX_QUEUED_HELLOS
            if not busy:
                self._queued += 1
        if busy:
            _unnamed("rejected a Hello from %s: %d Hellos are being answered already",
                     hello.control_endpoint, MAX_QUEUED_HELLOS)
            self._send(hello.control_endpoint, self._reject(
                f"prefill {self._rank} is answering {MAX_QUEUED_HELLOS} Hellos already "
                f"(MAX_QUEUED_HELLOS); try again"))
            return
        try:
            self._dialer.submit(self._answer_queued, sender, hello)
        except RuntimeError:  # closed meanwhile
            self._done_queued()

    def _answer_queued(self, sender: str | None, hello: Hello) -> None:
        try:
            self.answer(sender, hello)
        except Exception:
            log.exception("answering the Hello from %s failed", hello.control_endpoint)
        finally:
            self._done_queued()

    def _done_queued(self) -> None:
        with self._lock:
            self._queued -= 1

    def answer(self, sender: str | None, hello: Hello) -> None:
        """Check, connect, store and answer one Hello (worker thread)."""
        reply, layout = self._check(sender, hello)
        if isinstance(reply, HelloAck):
            assert layout is not None
            reply = self._accept(hello, layout, reply)
        if isinstance(reply, HelloReject):
            log.warning("rejected Hello from %s (%s): %s", hello.control_endpoint, hello.rank,
                        "; ".join(reply.problems))
        self._send(hello.control_endpoint, reply)

    def _accept(self, hello: Hello, layout: Layout, ack: HelloAck) -> HelloAck | HelloReject:
        """Connect to and keep a compatible rank (its decoded ``layout``), unless the cap
        is reached."""
        full = self._full(hello.control_endpoint)
        if full is not None:
            return self._reject(full)
        peer = self._connect(hello, layout, ack)
        if isinstance(peer, HelloReject):
            return peer
        old = self._store(peer)
        if isinstance(old, HelloReject):
            return old
        if old is not None:
            old.transport_peer.close()
        return HelloAck(protocol_version=PROTOCOL_VERSION, rank=self._rank,
                        layout_signature=ack.layout_signature, writes=ack.writes,
                        layout=self._layout_msg)

    def refuse_unnamed(self, hello: Hello) -> HelloReject:
        """The answer to a Hello from a client with no control endpoint of its own: it
        would have us dial whatever endpoint it names."""
        _unnamed("rejected a Hello from an unnamed client naming %s", hello.control_endpoint)
        return self._reject("Hello from a client with no control endpoint; a decode rank "
                            "sends its Hello from the endpoint it advertises")

    def _check(self, sender: str | None, hello: Hello
               ) -> tuple[HelloAck | HelloReject, Layout | None]:
        """The answer to ``hello``, and the decode rank's layout once decoded."""
        if sender is not None and sender != hello.control_endpoint:
            return self._reject(f"Hello came from {sender} but names control endpoint "
                                f"{hello.control_endpoint}; each rank must send from the "
                                f"endpoint it advertises"), None
        return answer_hello(hello, layout=self._layout, transport=self._transport.name,
                            rank=self._rank, memory_kinds=self._transport.capabilities.memory)

    def _connect(self, hello: Hello, layout: Layout, ack: HelloAck
                 ) -> DecodePeer | HelloReject:
        try:
            tpeer = self._transport.connect(hello.transport_endpoint)
        except TransportError as e:
            return self._reject(
                f"prefill {self._rank} cannot reach decode {hello.rank}'s {hello.transport} "
                f"transport endpoint: {e}; check that decode's transport listens on an "
                f"address prefill can route to")
        return DecodePeer(endpoint=hello.control_endpoint, rank=hello.rank,
                          layout=layout, transport_peer=tpeer,
                          writes=ack.writes, notices=hello.notices,
                          transport_endpoint=hello.transport_endpoint)

    def _full(self, endpoint: str) -> str | None:
        """Why a Hello from ``endpoint`` cannot be accepted now (the cap), or None."""
        with self._lock:
            if endpoint in self._peers or len(self._peers) < MAX_DECODE_PEERS:
                return None
        return (f"prefill {self._rank} already keeps handshakes with {MAX_DECODE_PEERS} "
                f"decode ranks (MAX_DECODE_PEERS); try again once idle ones are dropped")

    def _store(self, peer: DecodePeer) -> DecodePeer | HelloReject | None:
        """Keep ``peer``; returns the rank's previous peer (to close), or a rejection
        when the cap filled up meanwhile (``peer``'s connection is then closed)."""
        with self._lock:
            full = peer.endpoint not in self._peers and len(self._peers) >= MAX_DECODE_PEERS
            if self._closed or full:
                peer.transport_peer.close()
                return None if self._closed else self._reject(
                    f"prefill {self._rank} already keeps handshakes with {MAX_DECODE_PEERS} "
                    f"decode ranks (MAX_DECODE_PEERS)")
            old = self._peers.get(peer.endpoint)
            self._peers[peer.endpoint] = peer
            self._used[peer.endpoint] = time.monotonic()
            return old

    def touch(self, endpoint: str) -> None:
        """The rank at ``endpoint`` is in use (it sent indices): not idle."""
        with self._lock:
            if endpoint in self._peers:
                self._used[endpoint] = time.monotonic()

    def idle(self, now: float, busy: set[str]) -> list[str]:
        """Ranks unused for ``PEER_IDLE_S`` that serve none of the ``busy`` endpoints
        (those live requests use): to drop."""
        with self._lock:
            return [ep for ep, t in self._used.items()
                    if now - t > PEER_IDLE_S and ep not in busy and ep in self._peers]

    def drop_idle(self, endpoint: str) -> None:
        """Drop a rank nothing used for ``PEER_IDLE_S``, if it still is one (it handshakes
        again if it comes back). Closing its transport peer joins threads: a worker's job."""
        why = f"decode rank at {endpoint} idle for over {PEER_IDLE_S:g} s (PEER_IDLE_S)"
        if self.drop(endpoint, reason=why) is not None:
            log.info("%s; dropped (it handshakes again if it comes back)", why)

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
            if now is None:  # why: e.g. a redial that held the gate just failed
                with self._lock:
                    why = self._gone.get(peer.endpoint)
                return why or f"decode {peer.rank} was dropped (lost, or the agent closed)"
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
            self._used.pop(endpoint, None)
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
        """Stop answering Hellos (waits for those being dialed, each bounded by the
        transport's connect timeout) and close every rank's transport peer."""
        with self._lock:
            self._closed = True
        self._dialer.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for p in peers:
            p.transport_peer.close()
