"""Heartbeat bookkeeping: which peers to ping now, and which have gone silent. Pure.

A peer is *watched* while some live request depends on it. Every message from a peer
counts as hearing from it. A watched peer is pinged every ``interval`` and declared lost
when nothing was heard for ``timeout`` since the later of its last message and the
moment watching began (a peer is never lost for silence from before we needed it).

Not thread-safe: the agent calls it from its I/O thread only.
"""

from __future__ import annotations


class Liveness:
    def __init__(self, *, interval: float, timeout: float) -> None:
        self.interval = interval
        self.timeout = timeout
        self._heard: dict[str, float] = {}
        self._since: dict[str, float] = {}  # watched peers: when watching began
        self._pinged: dict[str, float] = {}

    def heard(self, endpoint: str, now: float) -> None:
        self._heard[endpoint] = now

    def tick(self, watched: set[str], now: float) -> tuple[list[str], list[tuple[str, float]]]:
        """``(peers to ping now, [(lost peer, seconds silent)])``; a lost peer stops being
        watched until a live request needs it again."""
        for ep in list(self._since):
            if ep not in watched:
                del self._since[ep]
                self._pinged.pop(ep, None)
        ping, lost = [], []
        for ep in watched:
            since = self._since.setdefault(ep, now)
            quiet = now - max(self._heard.get(ep, since), since)
            if quiet > self.timeout:
                lost.append((ep, quiet))
                del self._since[ep]
                self._pinged.pop(ep, None)
                continue
            if now - self._pinged.get(ep, -1e18) >= self.interval:
                self._pinged[ep] = now
                ping.append(ep)
        # forget peers nobody watches and nobody heard from recently (bounded memory)
        if len(self._heard) > 4 * len(watched) + 1024:
            horizon = now - 10 * self.timeout
            self._heard = {e: t for e, t in self._heard.items() if t > horizon or e in watched}
        return ping, lost
