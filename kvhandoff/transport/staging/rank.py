"""One rank's staging, both sides: the arena and control server it advertises
(receiving) and the links it dials to its peers (sending)."""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import weakref
from collections.abc import Callable
from typing import Any

from kvhandoff.layout import Region
from kvhandoff.plan.model import Plan
from kvhandoff.transport.base import Peer
from kvhandoff.transport.errors import ConnectError, ProtocolError, TransportError
from kvhandoff.transport.framing.handshake import derive_key, new_endpoint_id
from kvhandoff.transport.framing.io import recv_exact
from kvhandoff.transport.framing.served import prove
from kvhandoff.transport.framing.wire import HEADER, Header, Kind, Status
from kvhandoff.transport.regions import RegionTable, plan_side_problem
from kvhandoff.transport.staging.arena import Arena
from kvhandoff.transport.staging.common import StagingConfig, estimate_segments
from kvhandoff.transport.staging.receiver import StagingServer
from kvhandoff.transport.staging.sender import Buffers, StagingLink, Wait, Write, say_bye

log = logging.getLogger("kvhandoff.transport")


class Staging:
    """One per engine transport: the receiving arena and control server (started by
    the first :meth:`advertise`), the outbound buffers, and the links to peers.

    ``register(region)`` registers host memory with the engine *only* (it is neither a
    plan source nor a destination peers may name); ``write``/``wait`` move one segment
    between two registered host buffers; ``table()`` is the transport's registered host
    memory (sources to gather from, destinations to scatter into)."""

    OPTION = "staging"

    def __init__(self, name: str, config: StagingConfig, *, register: Callable[[Region], None],
                 write: Write, wait: Wait, table: Callable[[], RegionTable], host: str,
                 io_timeout: float, connect_timeout: float,
                 data_secret: bytes | None = None) -> None:
        self.name, self.config = name, config
        self._register, self._write, self._wait, self._table = register, write, wait, table
        self._host = host
        self._io_timeout, self._connect_timeout = io_timeout, connect_timeout
        self._token = secrets.token_hex(16)
        self._id = new_endpoint_id()
        self._data_secret = data_secret  # the deployment secret's data-plane key, if any
        self._lock = threading.Lock()
        self._server: StagingServer | None = None
        self._arena: Arena | None = None
        self._pool = Buffers(config.slot_bytes, register)
        self._links: weakref.WeakSet[StagingLink] = weakref.WeakSet()

    @property
    def slots_in_use(self) -> int:
        """This side's arena slots leased or quarantined (0 before any peer staged)."""
        arena = self._arena
        return arena.in_use if arena is not None else 0

    def advertise(self) -> tuple[tuple[str, str], ...]:
        """Endpoint options that let a peer stage into this side (registers the arena
        and starts the control server on first use); empty when staging is off."""
        if not self.config.enabled:
            return ()
        with self._lock:
            if self._server is None:
                arena = Arena(self.config.slots, self.config.slot_bytes)
                self._register(Region(ptr=arena.base, nbytes=arena.buf.nbytes))
                self._arena = arena
                self._server = StagingServer(
                    host=self._host, key=derive_key(self._token.encode(), self._data_secret),
                    endpoint_id=self._id, arena=arena,
                    slots_per_peer=self.config.slots_per_peer, table=self._table,
                    io_timeout=self._io_timeout,
                    quarantine=self.config.quarantine_for(self._io_timeout),
                    max_per_host=self.config.max_connections_per_host)
            server = self._server
        return ((self.OPTION, json.dumps({"host": server.host, "port": server.port,
                                           "token": self._token, "id": self._id})),)

    def connect(self, options: dict[str, str], peer: Peer) -> StagingLink | None:
        """A link to the peer's staging server if it advertises one (None if it does
        not, or leased no slot). Blocking, bounded by the connect timeout; raises
        :class:`ConnectError`."""
        if not self.config.enabled or self.OPTION not in options:
            return None
        try:
            info: dict[str, Any] = json.loads(options[self.OPTION])
            host, port, token = str(info["host"]), int(info["port"]), str(info["token"])
            eid = str(info["id"])
        except (ValueError, KeyError, TypeError) as e:
            raise ConnectError(f"{self.name} endpoint has a malformed staging option") from e
        sock, slots = self._dial(host, port, derive_key(token.encode(), self._data_secret),
                                 eid)
        if not slots:
            log.info("%s: %s leased no staging slot; fragmented plans go direct",
                     self.name, peer.name)
            say_bye(sock)
            sock.close()
            return None
        try:
            bufs = self._pool.lease(len(slots))
        except BaseException:
            say_bye(sock)  # nothing was written into the slots
            sock.close()
            raise
        link = StagingLink(peer, sock, slots, bufs, self._pool, write=self._write,
                           wait=self._wait, table=self._table, io_timeout=self._io_timeout)
        with self._lock:
            self._links.add(link)
        return link

    def _dial(self, host: str, port: int, key: bytes, endpoint_id: str
              ) -> tuple[socket.socket, list[tuple[int, int]]]:
        try:
            sock = socket.create_connection((host, port), timeout=self._connect_timeout)
        except OSError as e:
            raise ConnectError(f"{self.name}: cannot reach the peer's staging server at "
                               f"{host}:{port}: {e}") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            prove(sock, key=key, endpoint_id=endpoint_id, timeout=self._connect_timeout,
                  peer=f"{self.name} staging server at {host}:{port}")
            sock.settimeout(self._connect_timeout)
            sock.sendall(Header(Kind.HELLO, 0, 0, 0, 0).pack())
            hdr = bytearray(HEADER.size)
            recv_exact(sock, memoryview(hdr))
            h = Header.unpack(hdr)
            body = bytearray(min(h.desc_len, 1 << 20))
            recv_exact(sock, memoryview(body))
            if h.kind is not Kind.REPLY or h.code != Status.OK:
                raise ConnectError(f"{self.name}: staging handshake refused: "
                                   f"{body.decode(errors='replace')}")
            slots = [(int(p), int(n)) for p, n in json.loads(body)["slots"]
                     if int(n) >= 4096]
            sock.settimeout(self._io_timeout)
            return sock, slots
        except ConnectError:
            sock.close()
            raise
        except (OSError, EOFError, ProtocolError, ValueError, KeyError, TypeError) as e:
            sock.close()
            raise ConnectError(f"{self.name}: staging handshake with {host}:{port} "
                               f"failed: {e}") from e

    def wants(self, plan: Plan, dst_host: RegionTable) -> bool:
        """Whether ``plan`` is fragmented enough to stage, and all host memory."""
        cfg = self.config
        most = plan.num_segments  # uncoalesced: at least the estimate below
        if cfg.too_coarse(plan.nbytes, most):
            return False  # decided without counting runs
        if cfg.too_coarse(plan.nbytes, estimate_segments(plan)):
            return False
        return (plan_side_problem(plan, self._table(), "src") is None
                and plan_side_problem(plan, dst_host, "dst") is None)

    def abandon(self, error: TransportError) -> None:
        """Fail every link's pending submits with ``error`` and wake its threads,
        without waiting for them (``close`` could not finish in time)."""
        with self._lock:
            links = list(self._links)
        for link in links:
            link.abandon(error)

    def close(self) -> None:
        """Close every link (failing its pending submits) and the control server."""
        with self._lock:
            links, self._links = list(self._links), weakref.WeakSet()
            server, self._server = self._server, None
        for link in links:
            link.close()
        if server is not None:
            server.close()
