"""Heartbeat bookkeeping: which peers to ping now, and which are dead. Pure.

A peer is *watched* while some live request depends on it. Every message from a peer
counts as hearing from it. A watched peer is pinged every ``interval``. Its *silence*
runs from the later of its last message and the moment watching began (a peer is
never lost for silence from before we needed it).

Busy is not dead. A peer silent for ``timeout`` is declared lost only when its link is
down as well (``up``, asked on the tick: our connection to it is gone, or its libzmq
stopped answering the connection's own heartbeats; see
:mod:`~kvhandoff.session.control.links`), which a dead or frozen process shows and a
merely slow one does not. A peer that stays silent while its link is up is *busy*: its
process answers, its Python does not (yet). It is declared lost only after
``BUSY_FACTOR`` times ``timeout`` (a backstop for a peer whose interpreter hangs for
good; the requests waiting on it have their own timeouts too).

Not thread-safe: the agent calls it from its I/O thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

BUSY_FACTOR = 12
"""How many heartbeat timeouts a peer whose link is up may stay silent (60 s by default)."""


@dataclass(frozen=True, slots=True)
class Silent:
    """A watched peer's silence as one tick judged it: ``lost`` (declared dead now) or
    just become busy (silent past the timeout, its link up)."""

    endpoint: str
    quiet: float  # seconds since we last heard from it (or began watching)
    link_up: bool


class Liveness:
    def __init__(self, *, interval: float, timeout: float) -> None:
        self.interval = interval
        self.timeout = timeout
        self.busy_limit = BUSY_FACTOR * timeout
        self._heard: dict[str, float] = {}
        self._since: dict[str, float] = {}  # watched peers: when watching began
        self._pinged: dict[str, float] = {}
        self._busy: set[str] = set()  # silent past the timeout with the link up

    def heard(self, endpoint: str, now: float) -> None:
        self._heard[endpoint] = now
        self._busy.discard(endpoint)

    def tick(self, watched: set[str], now: float, up: Callable[[str], bool]
             ) -> tuple[list[str], list[Silent], list[Silent]]:
        """``(peers to ping now, peers lost, peers just become busy)``; a lost peer stops
        being watched until a live request needs it again. ``up(endpoint)``: whether its
        link is up (asked only of peers silent past the timeout)."""
        for ep in list(self._since):
            if ep not in watched:
                del self._since[ep]
                self._pinged.pop(ep, None)
                self._busy.discard(ep)
        ping: list[str] = []
        lost: list[Silent] = []
        busy: list[Silent] = []
        for ep in watched:
            since = self._since.setdefault(ep, now)
            quiet = now - max(self._heard.get(ep, since), since)
            if quiet > self.timeout:
                link = up(ep)
                if not link or quiet > self.busy_limit:
                    lost.append(Silent(ep, quiet, link))
                    del self._since[ep]
                    self._pinged.pop(ep, None)
                    self._busy.discard(ep)
                    continue
                if ep not in self._busy:
                    self._busy.add(ep)
                    busy.append(Silent(ep, quiet, link))
            if now - self._pinged.get(ep, -1e18) >= self.interval:
                self._pinged[ep] = now
                ping.append(ep)
        # forget peers nobody watches and nobody heard from recently (bounded memory)
        if len(self._heard) > 4 * len(watched) + 1024:
            horizon = now - 10 * self.busy_limit
            self._heard = {e: t for e, t in self._heard.items() if t > horizon or e in watched}
        return ping, lost, busy
