"""The receiving side of the shm transport: hand out arenas, acknowledge commits.

One thread accepts on an abstract Unix socket; one thread serves each connection. A
connection opens with the mutual challenge–response of
:mod:`~kvhandoff.transport.framing.handshake` (an abstract socket has no file permissions:
any process in the network namespace can connect, so the fds go only to a peer that
proved the endpoint's key). Then:

    HELLO (empty)  → REPLY OK carrying the arena fds (SCM_RIGHTS) and the allocation
                     list as JSON
    WRITE (empty)  → a COMMIT: the sender finished copying one transfer → REPLY OK

The data never passes through this side. A bad frame drops the connection (logged);
nothing raises out of a serving thread. Idle connections block in ``recv``.
"""

from __future__ import annotations

import json
import socket

from kvhandoff.transport.errors import ProtocolError
from kvhandoff.transport.framing.io import recv_header
from kvhandoff.transport.framing.served import MAX_PER_HOST, ThreadedServer, unix_listener
from kvhandoff.transport.framing.wire import HEADER, Header, Kind, Status
from kvhandoff.transport.shm.arena import Arenas

MAX_FDS = 250  # below SCM_MAX_FD (253)


class ShmServer(ThreadedServer):
    """Accepts peers on an abstract Unix socket; answers HELLO with the arenas and each
    COMMIT with a REPLY. One thread per connection; a bad frame drops the connection."""

    def __init__(self, address: str, *, key: bytes, endpoint_id: str, arenas: Arenas,
                 io_timeout: float, max_per_host: int = MAX_PER_HOST) -> None:
        self.address, self.arenas, self.io_timeout = address, arenas, io_timeout
        super().__init__(unix_listener(address), "shm", key=key, endpoint_id=endpoint_id,
                         max_per_host=max_per_host)

    def serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.io_timeout)
        self._loop(conn)

    def _loop(self, conn: socket.socket) -> None:
        hdr = bytearray(HEADER.size)
        greeted = False
        while not self._closing:
            if not recv_header(conn, memoryview(hdr), idle_ok=True):
                continue
            h = Header.unpack(hdr)
            if h.desc_len or h.payload_len:  # every shm control frame is a bare header
                _reply(conn, h.seq, Status.MALFORMED, b"shm control frames carry nothing")
                raise ProtocolError("oversized control frame")
            if h.kind is Kind.HELLO and not greeted:
                greeted = True
                self._send_arenas(conn, h.seq)
            elif h.kind is Kind.WRITE and greeted:  # COMMIT: the sender finished a copy
                _reply(conn, h.seq, Status.OK, b"")
            else:
                _reply(conn, h.seq, Status.MALFORMED, b"unexpected frame")
                raise ProtocolError(f"unexpected {h.kind.name} frame")

    def _send_arenas(self, conn: socket.socket, seq: int) -> None:
        fds, sizes, allocs = self.arenas.snapshot()
        if len(fds) > MAX_FDS:
            _reply(conn, seq, Status.INTERNAL, b"too many shared arenas to pass")
            raise ProtocolError("too many arenas")
        body = json.dumps({"sizes": sizes, "allocs": [
            [a.ptr, a.nbytes, a.arena, a.offset] for a in allocs]}).encode()
        msg = Header(Kind.REPLY, Status.OK, seq, len(body), 0).pack() + body
        socket.send_fds(conn, [msg[:HEADER.size]], fds)  # fds ride on the header bytes
        conn.sendall(msg[HEADER.size:])


def _reply(conn: socket.socket, seq: int, status: Status, body: bytes) -> None:
    conn.sendall(Header(Kind.REPLY, status, seq, len(body), 0).pack() + body)
