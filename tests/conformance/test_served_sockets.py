"""The socket-served transports' server never shuts down a socket another thread closed.

CPython's ``socket.shutdown`` reads the descriptor number after releasing the GIL, so a
shutdown that races the owner's ``close`` can reach whatever socket reused the number
next: in the full suite a decode's tcp listener stopped listening (prefill's dials were
refused; its accept thread died without a word) and handshakes were cut at 0 B. The
server now only shuts down, under its lock, sockets that are still open: the thread that
uses a socket closes it, under the same lock. These tests force the interleaving that
used to do it, and check that a listener stopped by someone else is reported.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from kvhandoff.transport.framing.handshake import new_endpoint_id
from kvhandoff.transport.framing.served import ThreadedServer, prove

KEY = bytes(32)
WAIT_S = 30.0  # bounds a wait for an event that happens unless the code is broken


class _HeldServer(ThreadedServer):
    """Serves a connection by waiting until the test releases it."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.eid = new_endpoint_id()
        listener = socket.create_server(("127.0.0.1", 0))
        self.port, self.listener_fd = listener.getsockname()[1], listener.fileno()
        super().__init__(listener, "held", key=KEY, endpoint_id=self.eid)

    def serve(self, conn: socket.socket) -> None:
        self.entered.set()
        self.release.wait(WAIT_S)


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


@contextmanager
def _shutdowns(on_listener: Callable[[], None]) -> Iterator[list[str]]:
    """Record every ``shutdown`` called on an already closed socket (what reaches a
    reused descriptor number when the timing is unlucky); call ``on_listener`` after a
    listening socket was shut down."""
    stale: list[str] = []
    real = socket.socket.shutdown

    def shutdown(self: socket.socket, how: int) -> None:
        if self.fileno() < 0:
            stale.append(repr(self))
        listening = self.fileno() >= 0 and self.getsockopt(socket.SOL_SOCKET,
                                                           socket.SO_ACCEPTCONN)
        real(self, how)
        if listening:
            on_listener()

    socket.socket.shutdown = shutdown  # type: ignore[method-assign]
    try:
        yield stale
    finally:
        socket.socket.shutdown = real  # type: ignore[method-assign]


def test_close_never_shuts_down_a_connection_its_thread_closed() -> None:
    """``close`` wakes the listener first; here that lets the serving thread finish and
    close its connection right then. ``close`` must not shut that connection down after
    (it used to, from a list taken before; and the serving thread must not close it
    while ``close`` may still shut it down)."""
    server = _HeldServer()
    client = socket.create_connection(("127.0.0.1", server.port))
    try:
        prove(client, key=KEY, endpoint_id=server.eid, timeout=WAIT_S, peer="held")
        assert server.entered.wait(WAIT_S)
        serving = _threads("kvh-held-serve")

        def let_it_close() -> None:
            server.release.set()  # the serving thread returns and closes its socket...
            for t in serving:  # ... unless close() holds the lock it closes under
                t.join(1.0)

        with _shutdowns(let_it_close) as stale:
            server.close()
        assert stale == []
        assert not any(t.is_alive() for t in serving)
    finally:
        server.release.set()
        server.close()
        client.close()


def test_a_listener_stopped_from_outside_is_reported(caplog: pytest.LogCaptureFixture
                                                     ) -> None:
    """A listening socket that someone else shuts down ends the accept loop; the server
    says so instead of going quiet while its owner believes it listens."""
    server = _HeldServer()
    accepter = _threads("kvh-held-accept")
    try:
        outsider = socket.socket(fileno=server.listener_fd)  # the same descriptor
        try:
            with caplog.at_level(logging.ERROR, "kvhandoff.transport"):
                outsider.shutdown(socket.SHUT_RDWR)
                for t in accepter:
                    t.join(WAIT_S)
        finally:
            outsider.detach()
        assert accepter and not any(t.is_alive() for t in accepter)
        assert any("held server: its listening socket stopped" in r.getMessage()
                   for r in caplog.records), caplog.text
    finally:
        server.close()
