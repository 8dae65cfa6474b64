"""File descriptors: how many this process may open, and how many a listener may hold.

Every listener of kvhandoff (the bootstrap server, the transports' data servers, an
agent's control socket) holds one descriptor per connection. One that lets strangers
open connections until the process has no descriptor left breaks every other part of
the process (its own connections, files, the other listeners), and an accept loop that
retries at once on ``EMFILE`` spins a core and, logging each failure, floods its log
(issue #30: 250k tracebacks in 90 s from the bootstrap under ``ulimit -n 256``). So:

* each listener caps its connections *below* the descriptor limit, read when it starts:
  :func:`connection_cap` gives it a share of the descriptors then still free, less a
  reserve the rest of the process keeps (its files, pipes, outgoing connections);
* an accept that fails for want of resources (:data:`OUT_OF_DESCRIPTORS`) is logged at a
  bounded rate and retried after a back-off (:class:`Backoff`), never at once.

Linux reads the descriptors in use from ``/proc/self/fd``; elsewhere it counts none.
"""

from __future__ import annotations

import errno
import os
import resource
import socket

__all__ = ["OUT_OF_DESCRIPTORS", "RESERVE", "Backoff", "connection_cap", "in_use", "limit",
           "listening_socket"]

RESERVE = 32
"""Descriptors no listener's cap counts on: what the rest of the process opens."""
OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""``accept`` errors that mean "no room now" (retry later), not "the listener is gone"."""
_UNLIMITED = 1 << 20


def limit() -> int:
    """This process's soft limit on open descriptors (``RLIMIT_NOFILE``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _UNLIMITED if soft == resource.RLIM_INFINITY else int(soft)


def in_use() -> int:
    """Descriptors this process holds now (0 where that cannot be read)."""
    try:
        return max(0, len(os.listdir("/proc/self/fd")) - 1)  # less the listing's own
    except OSError:
        return 0


def connection_cap(wanted: int, share: float) -> int:
    """How many connections a listener starting now may hold: ``wanted``, but at most
    ``share`` (0 < share <= 1) of the descriptors free now beyond :data:`RESERVE`, and at
    least one. The shares of the listeners of one process should sum to at most one."""
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    free = max(0, limit() - in_use() - RESERVE)
    return max(1, min(wanted, int(free * share)))


class Backoff:
    """The wait before retrying a failed accept: ``first`` seconds, doubling up to
    ``cap``; :meth:`reset` after an accept succeeds. Not thread-safe (one accept loop)."""

    def __init__(self, first: float = 0.01, cap: float = 1.0) -> None:
        self.first, self.cap = first, cap
        self.delay = first

    def next(self) -> float:
        """The wait now; the next one doubles."""
        delay, self.delay = self.delay, min(self.delay * 2, self.cap)
        return delay

    def reset(self) -> None:
        self.delay = self.first


def listening_socket(host: str, port: int) -> socket.socket:
    """A non-blocking listening TCP socket on ``host:port`` (every address for ``""`` or
    ``"*"``; port 0: any free one); ``OSError`` when it cannot be bound."""
    host = "" if host == "*" else host
    if not host and socket.has_dualstack_ipv6():
        sock = socket.create_server(("::", port), family=socket.AF_INET6,
                                    dualstack_ipv6=True)
    else:
        family, _, _, _, addr = socket.getaddrinfo(host or "0.0.0.0", port,
                                                   type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
        sock = socket.create_server(addr[:2], family=family)
    sock.setblocking(False)
    return sock
