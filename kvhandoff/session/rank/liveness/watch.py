"""One agent's watch over its peers: heartbeats, suspects, probes and peers declared lost.

:class:`~kvhandoff.session.rank.liveness.book.Liveness` decides when a watched peer is pinged and
when its silence makes it lost; around it this keeps what the agent learns between ticks:

* a *suspect* is a decode endpoint a write to failed. It is watched by heartbeat, even
  with no request left to watch it, until it answers a ping sent after the failure, or
  is declared lost: a dead rank does not linger;
* a *probe* asks one endpoint once whether it answers at all (at registration, the
  previous holder of this rank's slot);
* a peer *declared lost* is sent no control message for ``memory`` seconds, unless it
  speaks first.

Heartbeats carry one sequence of numbers, shared by pings and probes, so an answer
names the ping it answers. The agent sends and receives; this only keeps the books.

Thread-safety: :meth:`suspect` and :meth:`probe` may be called from any thread; the
rest from the agent's I/O thread only.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from kvhandoff.session.rank.liveness.book import Liveness, Silent


class PeerWatch:
    """See the module docstring."""

    def __init__(self, *, interval: float, timeout: float, memory: float = 60.0) -> None:
        self._liveness = Liveness(interval=interval, timeout=timeout)
        self._memory = memory
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        # suspect endpoint -> the last ping seq before suspicion; a later one must be answered
        self._suspects: dict[str, int] = {}
        self._probes: dict[int, threading.Event] = {}
        self._lost: dict[str, float] = {}  # endpoint -> when declared lost

    @property
    def suspects(self) -> int:
        return len(self._suspects)

    def next_seq(self) -> int:
        """The sequence number of a new ping."""
        return next(self._seq)

    def is_lost(self, endpoint: str) -> bool:
        return endpoint in self._lost

    def heard(self, endpoint: str, now: float) -> None:
        """A message came from ``endpoint``: it is alive, whatever was said of it."""
        self._liveness.heard(endpoint, now)
        self._lost.pop(endpoint, None)

    def suspect(self, endpoint: str) -> None:
        """A write to ``endpoint`` failed: watch it until it answers a later ping."""
        with self._lock:
            self._suspects.setdefault(endpoint, next(self._seq))

    def acked(self, endpoint: str | None, seq: int) -> None:
        """``endpoint`` answered ping (or probe) ``seq``."""
        if self._suspects and endpoint in self._suspects:
            with self._lock:  # an answer to a ping sent after the failed write
                if endpoint is not None and seq > self._suspects.get(endpoint, seq):
                    del self._suspects[endpoint]
        probe = self._probes.get(seq)
        if probe is not None:
            probe.set()

    def probe(self, ping: Callable[[int], None], timeout: float) -> bool:
        """Whether an answer comes within ``timeout`` seconds to the heartbeat that
        ``ping(seq)`` sends (blocks)."""
        seq = next(self._seq)
        ev = threading.Event()
        self._probes[seq] = ev
        try:
            ping(seq)
            return ev.wait(timeout)
        finally:
            self._probes.pop(seq, None)

    def tick(self, watched: set[str], now: float, up: Callable[[str], bool]
             ) -> tuple[list[str], list[Silent], list[Silent]]:
        """``(endpoints to ping now, endpoints lost, endpoints just become busy)`` among
        those live requests depend on (``watched``) and the suspects (``up``: whether an
        endpoint's link is up; see :class:`~kvhandoff.session.rank.liveness.book.Liveness`);
        forgets endpoints declared lost longer ago than ``memory``."""
        with self._lock:
            watched = watched | set(self._suspects)
        for ep in [e for e, t in self._lost.items() if now - t > self._memory]:
            del self._lost[ep]
        return self._liveness.tick(watched, now, up)

    def lost(self, endpoint: str, now: float) -> None:
        """``endpoint`` was declared lost: drop messages to it for a while, suspect it
        no more."""
        self._lost[endpoint] = now
        with self._lock:
            self._suspects.pop(endpoint, None)
