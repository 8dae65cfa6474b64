"""The bootstrap server's door: its listening socket, its accept loop, its connection cap.

asyncio's own accept loop, out of descriptors, logged a traceback for each failed accept,
up to a hundred per pass of the event loop, and tried again a second later: under
``ulimit -n 256`` a connection flood made the bootstrap write 250k–350k tracebacks
(100–140 MB) in 90 s at 70 % CPU, before any authentication (issue #30). Here
:func:`accept_loop` accepts one connection at a time, logs a failure at a bounded rate
and waits a back-off (:class:`~kvhandoff.descriptors.Backoff`) before trying again, and
hands each connection to aiohttp through :class:`Doors`, which holds at most ``cap``
connections — below the descriptor limit, read when the server starts
(:func:`~kvhandoff.descriptors.connection_cap`), so the server's own connections cannot
exhaust its descriptors.

Event-loop thread only.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket

from kvhandoff.bootstrap.aio import web
from kvhandoff.descriptors import OUT_OF_DESCRIPTORS, Backoff
from kvhandoff.transport.throttle import Throttle

__all__ = ["Doors", "accept_loop"]

log = logging.getLogger("kvhandoff.bootstrap")
_accept_failed = Throttle(log)
_GONE = frozenset({errno.ECONNABORTED, errno.EPROTO})  # the client left before accept


class _Refuse(asyncio.Protocol):
    """A connection the server has no room for: closed as soon as it is accepted."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class Doors:
    """The protocol factory of accepted connections: at most ``cap`` at once. At the cap
    the oldest connection not inside a request (idle, or still sending its request head)
    is closed to make room; when every one is inside a request, which ``body_timeout``
    bounds, the newcomer is closed instead."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.server: web.Server | None = None  # set once the runner is set up
        self.busy: set[int] = set()  # id() of the handlers inside a request
        self.shed = 0  # connections closed to make room
        self.accept_failures = 0  # accepts that failed (out of descriptors, say)

    def __call__(self) -> asyncio.Protocol:
        assert self.server is not None
        live = [h for h in self.server.connections if h.transport is not None]
        if len(live) >= self.cap:
            idle = next((h for h in live if id(h) not in self.busy), None)
            if idle is None:
                return _Refuse()
            idle.force_close()
            self.shed += 1
        return self.server()


async def accept_loop(sock: socket.socket, doors: Doors) -> None:
    """Accept connections on ``sock`` for ``doors`` until cancelled; a failed accept is
    logged (rate-limited) and retried after a back-off, never at once."""
    loop = asyncio.get_running_loop()
    backoff = Backoff()
    while True:
        try:
            conn, _ = await loop.sock_accept(sock)
        except OSError as e:
            if e.errno in _GONE:
                continue
            if e.errno not in OUT_OF_DESCRIPTORS:
                raise
            doors.accept_failures += 1
            wait = backoff.next()
            _accept_failed("bootstrap server: accept failed (%s; at most %d connections "
                           "held); retrying in %.2f s, still listening", e, doors.cap, wait)
            await asyncio.sleep(wait)
            continue
        backoff.reset()
        try:
            await loop.connect_accepted_socket(doors, conn)
        except OSError:
            conn.close()
