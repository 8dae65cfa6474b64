"""The built-in tcp transport: RDMA-write semantics over plain sockets. Pure Python + numpy.

The receiving side (:mod:`tcp_server`) starts on the first ``endpoint()`` call and
checks every destination byte against its registered regions before writing; the
sending side (:mod:`tcp_client`) gathers straight from source memory. Frames keep the
plan's factored form on the wire (:mod:`tcp_wire`), so a head-sliced KV page piece is
one record with an index array, not one request per segment.

Options (keyword-only): ``host`` / ``port`` to listen on (default 127.0.0.1, any free
port), ``connections`` per peer (default 2, so both cores work), ``frame_bytes``
(payload per frame, default 4 MiB), ``io_timeout`` (seconds without progress before a
peer is declared lost, default 30), ``connect_timeout`` (default 5).
"""

from __future__ import annotations

import json
import secrets

from kvhandoff.plan.model import Plan
from kvhandoff.transport import tcp_small
from kvhandoff.transport._served import ServedTransport
from kvhandoff.transport.base import Capabilities, Handle, Peer
from kvhandoff.transport.errors import ConnectError
from kvhandoff.transport.regions import RegionTable
from kvhandoff.transport.small import MAX_BYTES
from kvhandoff.transport.tcp_client import TcpPeer
from kvhandoff.transport.tcp_server import TcpServer
from kvhandoff.transport.tcp_wire import MAX_PAYLOAD

ENDPOINT_KIND = "tcp"
ENDPOINT_VERSION = 1


class TcpTransport(ServedTransport):
    """Thread-safe (see the base contract). Peers are closed with the transport."""

    name = "tcp"
    capabilities = Capabilities(strided=True, self_completing=True, notices=True)
    peer_type = TcpPeer

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, connections: int = 2,
                 frame_bytes: int = 4 << 20, io_timeout: float = 30.0,
                 connect_timeout: float = 5.0) -> None:
        super().__init__()
        if (connections < 1 or not 1 <= frame_bytes <= MAX_PAYLOAD or io_timeout <= 0
                or connect_timeout <= 0):
            raise ValueError(
                f"tcp transport needs connections >= 1, 1 <= frame_bytes <= {MAX_PAYLOAD} and "
                f"positive "
                f"timeouts; got connections={connections}, frame_bytes={frame_bytes}, "
                f"io_timeout={io_timeout}, connect_timeout={connect_timeout}"
            )
        self._host, self._port = host, port
        self._connections = connections
        self._frame_bytes = frame_bytes
        self._io_timeout = io_timeout
        self._connect_timeout = connect_timeout
        self._token = secrets.token_hex(16)

    def _table(self) -> RegionTable:
        """The current registrations (an immutable snapshot; read without a lock)."""
        return self.local

    def endpoint(self) -> bytes:
        """Starts listening on first use. The endpoint carries a random token that the
        handshake checks, so a stale endpoint never reaches a different transport."""
        self._check_open()
        with self._lock:
            server = self._server
            if server is None:
                server = self._server = TcpServer(
                    host=self._host, port=self._port, token=self._token, table=self._table,
                    io_timeout=self._io_timeout, bounce_bytes=4 << 20,
                    deliver=self._deliver_notice)
            assert isinstance(server, TcpServer)
            host, port = server.host, server.port
        return json.dumps({"kind": ENDPOINT_KIND, "v": ENDPOINT_VERSION, "host": host,
                           "port": port, "token": self._token}).encode()

    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        """Small plans (a tiny handoff) take the pure-Python path of :mod:`tcp_small`:
        one frame, written by this thread when a connection is idle. A notice rides in
        the plan's only frame, or follows its frames once all were acknowledged."""
        self._check_open()
        self._check_notice(notice)
        if not isinstance(peer, TcpPeer):
            raise TypeError(f"{self.name} transport cannot submit to {peer!r}")
        small = tcp_small.build(plan, self.local, self.name,
                                min(self._frame_bytes, MAX_BYTES))
        if small is not None:
            return peer.submit_small(small, notice)
        self.check_sources(plan)
        return peer.submit(plan, notice)

    def connect(self, peer_endpoint: bytes) -> TcpPeer:
        self._check_open()
        try:
            ep = json.loads(peer_endpoint)
            host, port, token = str(ep["host"]), int(ep["port"]), str(ep["token"])
            kind, version = ep["kind"], ep["v"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConnectError(f"not a tcp transport endpoint: {peer_endpoint[:80]!r}") from e
        if kind != ENDPOINT_KIND or version != ENDPOINT_VERSION:
            raise ConnectError(f"endpoint is {kind!r} v{version}; this is {ENDPOINT_KIND!r} "
                               f"v{ENDPOINT_VERSION}")
        return self._adopt(TcpPeer(
            peer_endpoint, host=host, port=port, token=token, connections=self._connections,
            frame_bytes=self._frame_bytes, io_timeout=self._io_timeout,
            connect_timeout=self._connect_timeout, table=self._table))
