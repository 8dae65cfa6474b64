"""The receiving side of the tcp transport: accept connections, validate, scatter, reply.

One thread accepts; one thread serves each connection, frame after frame:

    HELLO  → check the token (the endpoint's secret) → REPLY OK | BAD_TOKEN (and close);
             before it, any other frame, or a HELLO over ``MAX_HELLO`` bytes, is
             refused from its header alone (nothing a stranger announces is allocated)
    WRITE  → decode records → check payload size → check every record against the
             registered regions → refused: drain the payload, REPLY OUT_OF_BOUNDS
             (nothing written, no notice) → else scatter the payload → deliver the
             frame's notice, if it carries one → REPLY OK

A malformed frame gets REPLY MALFORMED and the connection is dropped; nothing that
arrives on the wire can raise out of a serving thread (it is logged and the connection
dropped). Idle connections block in ``recv`` (no CPU); a frame that stops arriving
midway is dropped after ``io_timeout``.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import numpy as np

from kvhandoff.transport._served import ThreadedServer
from kvhandoff.transport.errors import ProtocolError
from kvhandoff.transport.regions import RegionTable
from kvhandoff.transport.tcp_data import receive
from kvhandoff.transport.tcp_io import drain, recv_exact, recv_header, recv_views
from kvhandoff.transport.tcp_small import dst_views
from kvhandoff.transport.tcp_wire import (
    FLAG_CHECK,
    FLAG_NOTICE,
    HEADER,
    Header,
    Kind,
    Records,
    Status,
    split_notice,
    unproven_problem,
)


class TcpServer(ThreadedServer):
    """Listens on ``host:port`` (0 = any free port). Thread-safe ``close`` (idempotent)."""

    def __init__(self, *, host: str, port: int, token: str, table: Callable[[], RegionTable],
                 io_timeout: float, bounce_bytes: int,
                 deliver: Callable[[bytes], None]) -> None:
        self.token = token.encode()
        self.table = table
        self.deliver = deliver  # a notice, once its frame's bytes landed (never raises)
        self._io_timeout = io_timeout
        self.bounce_bytes = bounce_bytes
        listener = socket.create_server((host, port), backlog=64)
        self.host, self.port = listener.getsockname()[:2]
        super().__init__(listener, f"tcp-{self.port}")

    def serve(self, conn: socket.socket) -> None:
        conn.settimeout(self._io_timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _Connection(conn, self).run()


class _Connection:
    """One accepted connection's frame loop."""

    def __init__(self, sock: socket.socket, server: TcpServer) -> None:
        self.sock = sock
        self.server = server
        self.hdr = bytearray(HEADER.size)
        self.bounce = np.empty(server.bounce_bytes, np.uint8)
        self.greeted = False

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
                early = unproven_problem(h, greeted=self.greeted)
                if early is not None:
                    raise ProtocolError(early)
            except ProtocolError as e:
                self.reply(0, Status.MALFORMED, str(e))
                raise
            desc = bytearray(h.desc_len)
            recv_exact(self.sock, memoryview(desc))
            if h.kind is Kind.HELLO:
                self.hello(h, bytes(desc))
            elif h.kind is Kind.WRITE and self.greeted:
                self.write(h, desc)
            else:
                msg = f"unexpected {h.kind.name} frame" + ("" if self.greeted else " before HELLO")
                self.reply(h.seq, Status.MALFORMED, msg)
                raise ProtocolError(msg)

    def hello(self, h: Header, token: bytes) -> None:
        if token != self.server.token:
            self.reply(h.seq, Status.BAD_TOKEN, "endpoint token does not match this transport")
            raise ProtocolError("HELLO with a wrong token")
        self.greeted = True
        self.server.greeted(self.sock)
        self.reply(h.seq, Status.OK)

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
