"""An agent's heartbeats: the timer tick, pings and probes, and peers declared lost.

On every tick of the control I/O thread (``config.tick``) the live requests run their
timers, the prefill desk sweeps its tables, the peers those requests depend on (and the
suspects, see :mod:`~kvhandoff.session.rank.liveness.watch`) are pinged every
``heartbeat_interval``, and a peer silent for ``heartbeat_timeout`` whose control link is
down as well (the connection reset, or its libzmq stopped answering the link's own
heartbeats: :meth:`~kvhandoff.session.control.channel.ControlChannel.link_up`) is declared
lost: its requests fail, the desk drops it, and the control channel forgets it. One
silent with its link up is busy, not dead: logged once, and lost only after the
backstop (:data:`~kvhandoff.session.rank.liveness.book.BUSY_FACTOR` timeouts). A peer
whose messages cannot be delivered is lost the same way. The books are kept by
:class:`~kvhandoff.session.rank.liveness.watch.PeerWatch`; this does the sending.

Threading: :meth:`Heartbeats.probe` blocks (a worker thread, or the agent starting);
the rest runs on the control I/O thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvhandoff.protocol import Heartbeat, HeartbeatAck, Message
from kvhandoff.session.config import SessionConfig
from kvhandoff.session.control.channel import ControlChannel, Origin
from kvhandoff.session.rank.desk import Desk
from kvhandoff.session.rank.liveness.watch import PeerWatch

log = logging.getLogger("kvhandoff.session.rank.agent")  # the agent's voice: one logger per agent


class Heartbeats:
    """See the module docstring. ``post`` sends a control message (unless its endpoint
    was declared lost); :attr:`control` is set once the channel is open."""

    def __init__(self, config: SessionConfig, *, name: str,
                 post: Callable[[str, Message], None]) -> None:
        self.watch = PeerWatch(interval=config.heartbeat_interval,
                               timeout=config.heartbeat_timeout)
        self.control: ControlChannel | None = None
        self._timeout = config.heartbeat_timeout
        self._name, self._post = name, post

    def _ping(self, endpoint: str, seq: int) -> None:
        assert self.control is not None
        self._post(endpoint, Heartbeat(seq=seq, sender=self.control.endpoint))

    def probe(self, endpoint: str, timeout: float) -> bool:
        """Whether a control endpoint answers a Heartbeat within ``timeout`` seconds."""
        try:
            return self.watch.probe(lambda seq: self._ping(endpoint, seq), timeout)
        finally:
            assert self.control is not None
            self.control.forget(endpoint)

    def on_message(self, origin: Origin, msg: Message) -> bool:
        """Hear from ``origin`` (whatever it says) and answer a heartbeat; False when
        ``msg`` is not one. Before :attr:`control` is set, heartbeats are dropped (the
        sender pings again)."""
        if self.control is None:  # see tick
            return isinstance(msg, Heartbeat | HeartbeatAck)
        if origin.endpoint is not None:
            self.watch.heard(origin.endpoint, time.monotonic())
        match msg:
            case Heartbeat():
                self.control.reply(origin, HeartbeatAck(seq=msg.seq,
                                                        sender=self.control.endpoint))
            case HeartbeatAck():
                self.watch.acked(origin.endpoint, msg.seq)
            case _:
                return False
        return True

    def tick(self, now: float, desk: Desk | None) -> None:
        """Run the live requests' timers, ping and judge the peers. Nothing before
        :attr:`control` is set: the channel ticks from the moment it opens, while the
        agent is still starting (a slow start used to log an AssertionError here)."""
        if self.control is None:
            return
        live = [] if desk is None else [*desk.live()]
        for r in live:
            r.on_tick(now)
        watched: set[str] = set()  # one pass (one lock each) per tick: serves both users
        for r in live:
            watched |= r.peer_endpoints()
        if desk is not None:
            desk.on_tick(now, watched)
        ping, lost, busy = self.watch.tick(watched, now, self.control.link_up)
        for ep in ping:
            self._ping(ep, self.watch.next_seq())
        for s in busy:
            log.info("agent %s: peer %s silent for %.1f s, but its control link answers: "
                     "busy, not lost", self._name, s.endpoint, s.quiet)
        for s in lost:
            why = "its control link answers, past the busy backstop" if s.link_up else \
                "and its control link is down"
            self.peer_lost(s.endpoint, f"peer {s.endpoint} silent for {s.quiet:.1f} s "
                                       f"(heartbeat_timeout {self._timeout:g} s) {why}", desk)

    def peer_lost(self, endpoint: str, reason: str, desk: Desk | None) -> None:
        """Fail the requests that depend on ``endpoint``, then drop it everywhere."""
        log.warning("agent %s: %s", self._name, reason)
        self.watch.lost(endpoint, time.monotonic())
        for r in [] if desk is None else desk.live():
            r.on_peer_lost(endpoint, reason)
        if desk is not None:
            desk.peer_lost(endpoint, reason)
        if self.control is not None:
            self.control.forget(endpoint)
