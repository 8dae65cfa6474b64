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
import sys

__all__ = ["BACKLOG", "OUT_OF_DESCRIPTORS", "RESERVE", "Backoff", "connection_cap", "in_use",
           "limit", "listening_socket", "reset_listen_queue"]

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


BACKLOG = 128
"""Connections a listening socket queues before they are accepted."""
_TCP_INFO_QUEUED = 24  # struct tcp_info: tcpi_unacked, a listener's accept queue length


def listening_socket(host: str, port: int) -> socket.socket:
    """A non-blocking listening TCP socket on ``host:port`` (every address for ``""`` or
    ``"*"``; port 0: any free one); ``OSError`` when it cannot be bound.

    The port is always bound explicitly (port 0 asks the kernel for one first, on a probe
    socket that holds it meanwhile): only then does it survive
    :func:`reset_listen_queue`, which would otherwise give it back."""
    host = "" if host == "*" else host
    dualstack = not host and socket.has_dualstack_ipv6()
    family, addr = socket.AF_INET6, ("::", port)
    if not dualstack:
        family, _, _, _, found = socket.getaddrinfo(host or "0.0.0.0", port,
                                                    type=socket.SOCK_STREAM,
                                                    flags=socket.AI_PASSIVE)[0]
        addr = (str(found[0]), int(found[1]))
    probe = None
    if port == 0:  # both sockets reuse the address and neither listens: both may bind
        probe = socket.socket(family, socket.SOCK_STREAM)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if dualstack:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    try:
        if probe is not None:
            probe.bind(addr)
            addr = (addr[0], probe.getsockname()[1])
        sock = socket.create_server(addr, family=family, backlog=BACKLOG,
                                    dualstack_ipv6=dualstack)
    finally:
        if probe is not None:
            probe.close()
    sock.setblocking(False)
    return sock


def reset_listen_queue(sock: socket.socket) -> int:
    """Close every connection waiting in ``sock``'s accept queue, unread, without taking
    a descriptor; returns how many there were. ``sock`` (from :func:`listening_socket`)
    keeps its port and listens again at once: the queue is reset by shutting the
    socket down (Linux resets the queued connections), then listening anew. What a
    process out of descriptors does instead of accepting with a spare descriptor, which
    any other thread of the process may take first (libzmq's I/O thread, spinning on the
    same queue, does)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        queued = int.from_bytes(info[_TCP_INFO_QUEUED:_TCP_INFO_QUEUED + 4], sys.byteorder)
    except (OSError, AttributeError):  # not Linux
        queued = 0
    try:
        sock.shutdown(socket.SHUT_RD)
    finally:
        sock.listen(BACKLOG)
    return queued
