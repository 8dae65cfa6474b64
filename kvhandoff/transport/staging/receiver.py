"""Staging's receiving side: the control server that leases slots of the arena to an
authenticated sender, bounds-checks each COMMIT and scatters the slot (see the
package docstring for the protocol)."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from dataclasses import dataclass

from kvhandoff.transport.errors import ProtocolError
from kvhandoff.transport.framing.io import recv_exact, recv_header
from kvhandoff.transport.framing.served import MAX_PER_HOST, ThreadedServer
from kvhandoff.transport.framing.wire import FLAG_CHECK, HEADER, Header, Kind, Records, Status
from kvhandoff.transport.regions import RegionTable
from kvhandoff.transport.staging.arena import Arena, scatter
from kvhandoff.transport.staging.common import JOB, MAX_REPLY


class StagingServer(ThreadedServer):
    """The receiver's control server: leases slots, checks and scatters commits."""

    def __init__(self, *, host: str, key: bytes, endpoint_id: str, arena: Arena,
                 slots_per_peer: int, table: Callable[[], RegionTable], io_timeout: float,
                 quarantine: float, max_per_host: int = MAX_PER_HOST) -> None:
        self.arena, self.table = arena, table
        self.slots_per_peer, self.io_timeout = slots_per_peer, io_timeout
        self.quarantine = quarantine  # seconds; see StagingConfig
        listener = socket.create_server((host, 0), backlog=64)
        self.host, self.port = listener.getsockname()[:2]
        super().__init__(listener, f"staging-{self.port}", key=key, endpoint_id=endpoint_id,
                         max_per_host=max_per_host)

    def serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.io_timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        lease: list[int] = []
        link = _ServedLink(conn, self, lease)
        try:
            link.run()
        finally:
            if link.said_bye:  # no write of this sender can still land in its slots
                self.arena.give_back(lease)
            else:
                self.arena.quarantine(lease, self.quarantine)


@dataclass(eq=False)
class _ServedLink:
    """One authenticated sender's control connection, frame after frame (see the module
    docstring). ``greeted``: its HELLO leased the slots."""

    sock: socket.socket
    server: StagingServer
    lease: list[int]
    refused: int = -1  # the last job refused by a CHECK or a COMMIT
    greeted: bool = False
    said_bye: bool = False  # a well-formed BYE ended the connection

    def reply(self, seq: int, status: Status, message: str = "") -> None:
        body = message.encode()[:MAX_REPLY]
        self.sock.sendall(Header(Kind.REPLY, status, seq, len(body), 0).pack() + body)

    def run(self) -> None:
        hdr = bytearray(HEADER.size)
        while not self.server.closing:
            if not recv_header(self.sock, memoryview(hdr), idle_ok=True):
                continue
            try:
                h = Header.unpack(hdr)
                if h.payload_len:
                    raise ProtocolError("staging control frames carry no payload")
                if not self.greeted and (h.kind is not Kind.HELLO or h.desc_len):
                    raise ProtocolError(f"unexpected {h.kind.name} frame of {h.desc_len} B "
                                        f"before HELLO (an empty HELLO comes first)")
            except ProtocolError as e:
                self.reply(0, Status.MALFORMED, str(e))
                raise
            desc = bytearray(h.desc_len)
            recv_exact(self.sock, memoryview(desc))
            if h.kind is Kind.HELLO and not self.greeted:
                self.hello(h.seq)
            elif h.kind is Kind.WRITE and self.greeted:
                self.write(h, desc)
            elif h.kind is Kind.BYE and self.greeted:
                if h.desc_len or h.code:
                    self.reply(h.seq, Status.MALFORMED, "a BYE frame carries nothing")
                    raise ProtocolError("staging BYE with a description or flags")
                self.said_bye = True
                return
            else:
                msg = f"unexpected {h.kind.name} frame" + ("" if self.greeted else " before HELLO")
                self.reply(h.seq, Status.MALFORMED, msg)
                raise ProtocolError(msg)

    def hello(self, seq: int) -> None:
        self.greeted = True
        arena = self.server.arena
        self.lease.extend(arena.lease(self.server.slots_per_peer))
        self.reply(seq, Status.OK, json.dumps({
            "slots": [[arena.base + i * arena.slot_bytes, arena.slot_bytes] for i in self.lease]}))

    def write(self, h: Header, desc: bytearray) -> None:
        try:
            if len(desc) < JOB.size:
                raise ProtocolError(f"staging WRITE of {len(desc)} B has no job header")
            job, slot = JOB.unpack_from(desc)
            records = Records.decode(memoryview(desc)[JOB.size:])
            check = bool(h.code & FLAG_CHECK)
            if not check and not 0 <= slot < len(self.lease):
                raise ProtocolError(f"slot {slot} is not leased to this sender")
            if not check and records.nbytes > self.server.arena.slot_bytes:
                raise ProtocolError(f"records describe {records.nbytes} B, more than a slot")
        except ProtocolError as e:
            self.reply(h.seq, Status.MALFORMED, str(e))
            raise
        if job == self.refused:
            self.reply(h.seq, Status.OUT_OF_BOUNDS, f"job {job} was refused; nothing written")
            return
        table = self.server.table()
        problem = records.problem(table)
        if problem is not None:
            self.refused = job
            self.reply(h.seq, Status.OUT_OF_BOUNDS, problem)
            return
        if not check:
            scatter(records, table, self.server.arena.slot(self.lease[slot]))
        self.reply(h.seq, Status.OK)
