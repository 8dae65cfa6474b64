"""Emptying a listen queue without a descriptor (the control socket's door does it when
the process is out of descriptors; accepting with a spare descriptor lost the race to
libzmq's spinning I/O thread, which then spun for the whole flood)."""

from __future__ import annotations

import socket
import sys

import pytest

from kvhandoff.descriptors import listening_socket, reset_listen_queue

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux resets listen queues")


def _dial(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


@pytest.mark.parametrize("host", ["127.0.0.1", "*"])
def test_queued_connections_are_reset_and_the_port_keeps_listening(host: str) -> None:
    """Every queued connection is reset, unread, and counted; the socket listens again
    on the very port it was given (port 0 included), and accepts the next one."""
    listener = listening_socket(host, 0)
    port = listener.getsockname()[1]
    queued = [_dial(port) for _ in range(3)]
    try:
        assert reset_listen_queue(listener) == 3
        assert listener.getsockname()[1] == port
        for c in queued:
            with pytest.raises(ConnectionResetError):
                c.recv(1)
        with _dial(port) as late:
            listener.settimeout(10)
            conn, _ = listener.accept()
            with conn:
                late.sendall(b"x")
                assert conn.recv(1) == b"x"
        assert reset_listen_queue(listener) == 0  # nothing queued: nothing reset
    finally:
        for c in queued:
            c.close()
        listener.close()

