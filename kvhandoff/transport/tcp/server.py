"""The receiving side of the tcp transport: accept connections, validate, scatter, reply.

One thread accepts; one thread serves each connection. A connection opens with the
mutual challenge–response of :mod:`~kvhandoff.transport.framing.handshake` (run by
:class:`~kvhandoff.transport.framing.served.ThreadedServer`: fixed-size frames, a deadline,
nothing allocated and no frame header read before the client proved the endpoint's
key). Then, frame after frame:

    WRITE  → decode records → check payload size → check every record against the
             registered regions → refused: drain the payload, REPLY OUT_OF_BOUNDS
             (nothing written, no notice) → else scatter the payload → deliver the
             frame's notice, if it carries one → REPLY OK

Only a peer that proved the key sends WRITEs, so only it learns, from a ``FLAG_CHECK``
frame's OK / OUT_OF_BOUNDS, which addresses are registered (finding L5); once
authenticated, a peer is trusted to write anywhere in the registered memory (the
bounds check keeps it there, it does not confine it to one request's pages).

A malformed frame gets REPLY MALFORMED and the connection is dropped; nothing that
arrives on the wire can raise out of a serving thread (it is logged and the connection
dropped). Idle connections block in ``recv`` (no CPU); a frame that stops arriving
midway is dropped after ``io_timeout``.

Torn writes: the payload is scattered into destination memory as it arrives (RDMA
semantics, no staging copy), so a peer that disconnects (or dies) mid-frame leaves the
bytes it sent so far written and the rest untouched. The frame gets no REPLY OK and its
notice is never delivered, so the sender's handle fails (``PeerLost``) and the request
cannot report SUCCESS: the session layer fails it and keeps its pages out of use until
released (tests/security/test_data_auth.py). A refused frame, in contrast, writes
nothing at all.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import numpy as np

from kvhandoff.transport.errors import ProtocolError
from kvhandoff.transport.framing.io import drain, recv_exact, recv_header, recv_views
from kvhandoff.transport.framing.served import ThreadedServer
from kvhandoff.transport.framing.wire import (
    FLAG_CHECK,
    FLAG_NOTICE,
    HEADER,
    Header,
    Kind,
    Records,
    Status,
    split_notice,
)
from kvhandoff.transport.regions import RegionTable
from kvhandoff.transport.tcp.data import receive
from kvhandoff.transport.tcp.small import dst_views


class TcpServer(ThreadedServer):
    """Listens on ``host:port`` (0 = any free port). Thread-safe ``close`` (idempotent)."""

    def __init__(self, *, host: str, port: int, key: bytes, endpoint_id: str,
                 table: Callable[[], RegionTable], io_timeout: float, bounce_bytes: int,
                 deliver: Callable[[bytes], None], max_per_host: int) -> None:
        self.table = table
        self.deliver = deliver  # a notice, once its frame's bytes landed (never raises)
        self._io_timeout = io_timeout
        self.bounce_bytes = bounce_bytes
        listener = socket.create_server((host, port), backlog=64)
        self.host, self.port = listener.getsockname()[:2]
        super().__init__(listener, f"tcp-{self.port}", key=key, endpoint_id=endpoint_id,
                         max_per_host=max_per_host)

    def serve(self, conn: socket.socket) -> None:
        conn.settimeout(self._io_timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _Connection(conn, self).run()


class _Connection:
    """One authenticated connection's frame loop."""

    def __init__(self, sock: socket.socket, server: TcpServer) -> None:
        self.sock = sock
        self.server = server
        self.hdr = bytearray(HEADER.size)
        self.bounce = np.empty(server.bounce_bytes, np.uint8)

    def reply(self, seq: int, status: Status, message: str = "") -> None:
        body = message.encode()[:4096]
        self.sock.sendall(Header(Kind.REPLY, status, seq, len(body), 0).pack() + body)

    def run(self) -> None:
        view = memoryview(self.hdr)
        while not self.server.closing:
            if not recv_header(self.sock, view, idle_ok=True):
                continue  # idle: wake every io_timeout to notice close()
            try:
                h = Header.unpack(self.hdr)
                if h.kind is not Kind.WRITE:
                    raise ProtocolError(f"unexpected {h.kind.name} frame")
            except ProtocolError as e:
                self.reply(0, Status.MALFORMED, str(e))
                raise
            desc = bytearray(h.desc_len)
            recv_exact(self.sock, memoryview(desc))
            self.write(h, desc)

    def write(self, h: Header, desc: bytearray) -> None:
        check_only = bool(h.code & FLAG_CHECK)
        notice: bytes | None = None
        try:
            table_bytes: bytearray | memoryview = desc
            if h.code & FLAG_NOTICE:
                if check_only:
                    raise ProtocolError("a CHECK frame cannot carry a notice")
                notice, table_bytes = split_notice(desc)
            records = Records.decode(table_bytes)
            want = 0 if check_only else records.nbytes
            if h.payload_len != want:
                raise ProtocolError(f"payload of {h.payload_len} B, records describe {want} B")
        except ProtocolError as e:
            self.reply(h.seq, Status.MALFORMED, str(e))
            raise
        table = self.server.table()
        small = None if check_only else dst_views(records, table)
        problem = small if isinstance(small, str) else (
            None if small is not None else records.problem(table))
        if problem is not None:
            drain(self.sock, h.payload_len, self.bounce.data)
            self.reply(h.seq, Status.OUT_OF_BOUNDS, problem)
            return
        if check_only:
            self.reply(h.seq, Status.OK)
            return
        if isinstance(small, list):
            recv_views(self.sock, small)
        else:
            receive(self.sock, table, records, self.bounce)
        if notice is not None:
            self.server.deliver(notice)
        self.reply(h.seq, Status.OK)
