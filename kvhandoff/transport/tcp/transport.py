"""The built-in tcp transport: RDMA-write semantics over plain sockets. Pure Python + numpy.

The receiving side (:mod:`tcp_server`) starts on the first ``endpoint()`` call and
checks every destination byte against its registered regions before writing; the
sending side (:mod:`tcp_client`) gathers straight from source memory. Frames keep the
plan's factored form on the wire (:mod:`tcp_wire`), so a head-sliced KV page piece is
one record with an index array, not one request per segment.

Authentication: the endpoint carries a random token and a public endpoint id; every
data connection opens with the mutual challenge–response of
:mod:`~kvhandoff.transport.framing.handshake`, keyed with the token, or with
HMAC(``data_secret``, token) when the deployment secret's data-plane key is given. The
token never travels on the data socket; the server allocates nothing and reads no frame
before the client proved the key, and the client sends nothing before the server did
(no KV reaches an impostor on the port). The bytes themselves are not encrypted.

Torn writes: a peer that dies mid-frame leaves that frame's bytes partly written; the
frame is never acknowledged, so its transfer fails and no request reports SUCCESS on
it (see :mod:`~kvhandoff.transport.tcp.server`).

Options (keyword-only): ``host`` / ``port`` to listen on (default 127.0.0.1, any free
port), ``connections`` per peer (default 2, so both cores work), ``frame_bytes``
(payload per frame, default 4 MiB), ``io_timeout`` (seconds without progress before a
peer is declared lost, default 30), ``connect_timeout`` (default 5; also bounds the
handshake), ``data_secret`` (the deployment secret's data-plane key, see above; None:
the token alone), ``max_connections_per_host`` (connections the receiving side holds
from one source address; default 32; extras are refused at once, with a logged reason).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvhandoff.plan.model import Plan
from kvhandoff.transport.base import Capabilities, Handle, Peer
from kvhandoff.transport.errors import ConnectError
from kvhandoff.transport.framing.handshake import derive_key
from kvhandoff.transport.framing.served import MAX_PER_HOST, ServedTransport, endpoint_fields
from kvhandoff.transport.framing.wire import MAX_PAYLOAD
from kvhandoff.transport.regions import RegionTable
from kvhandoff.transport.small import MAX_BYTES
from kvhandoff.transport.tcp import small as tcp_small
from kvhandoff.transport.tcp.client import TcpPeer
from kvhandoff.transport.tcp.server import TcpServer

ENDPOINT_KIND = "tcp"
ENDPOINT_VERSION = 2  # v2: the endpoint id, and the data-plane handshake


@dataclass(frozen=True, slots=True, kw_only=True)
class TcpEndpoint:
    """A parsed tcp endpoint: where to dial and what proves the right to write there."""

    host: str
    port: int
    token: str  # the handshake key's material (never sent on the data socket)
    id: str  # public: names the endpoint in the handshake

    @staticmethod
    def parse(raw: bytes) -> TcpEndpoint:
        """ConnectError if ``raw`` is not a tcp endpoint of this version."""
        host, port, token, eid = endpoint_fields(raw, ENDPOINT_KIND, ENDPOINT_VERSION,
                                                 "host", "port", "token", "id")
        try:
            return TcpEndpoint(host=str(host), port=int(port), token=str(token), id=str(eid))
        except (ValueError, TypeError) as e:
            raise ConnectError(f"not a tcp transport endpoint: {raw[:80]!r}") from e


class TcpTransport(ServedTransport):
    """Thread-safe (see the base contract). Peers are closed with the transport."""

    name = "tcp"
    capabilities = Capabilities(strided=True, self_completing=True, notices=True)
    peer_type = TcpPeer

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, connections: int = 2,
                 frame_bytes: int = 4 << 20, io_timeout: float = 30.0,
                 connect_timeout: float = 5.0, data_secret: bytes | None = None,
                 max_connections_per_host: int = MAX_PER_HOST) -> None:
        if not 1 <= frame_bytes <= MAX_PAYLOAD:
            raise ValueError(f"tcp transport needs 1 <= frame_bytes <= {MAX_PAYLOAD}; got "
                             f"frame_bytes={frame_bytes}")
        super().__init__(io_timeout=io_timeout, connect_timeout=connect_timeout,
                         data_secret=data_secret,
                         max_connections_per_host=max_connections_per_host,
                         connections=connections)
        self._host, self._port = host, port
        self._connections = connections
        self._frame_bytes = frame_bytes

    def _table(self) -> RegionTable:
        """The current registrations (an immutable snapshot; read without a lock)."""
        return self.local

    def endpoint(self) -> bytes:
        """Starts listening on first use. The endpoint carries a random token (the
        handshake's key material) and a public id, so a stale endpoint never reaches a
        different transport and nobody without the key writes here."""
        self._check_open()
        with self._lock:
            server = self._server
            if server is None:
                server = self._server = TcpServer(
                    host=self._host, port=self._port,
                    key=derive_key(self._token.encode(), self._data_secret),
                    endpoint_id=self._id, table=self._table, io_timeout=self._io_timeout,
                    bounce_bytes=4 << 20, deliver=self._deliver_notice,
                    max_per_host=self._max_per_host)
            assert isinstance(server, TcpServer)
            host, port = server.host, server.port
        return json.dumps({"kind": ENDPOINT_KIND, "v": ENDPOINT_VERSION, "host": host,
                           "port": port, "token": self._token, "id": self._id}).encode()

    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        """Small plans (a tiny handoff) take the pure-Python path of :mod:`tcp_small`:
        one frame, written by this thread when a connection is idle. A notice rides in
        the plan's only frame, or follows its frames once all were acknowledged."""
        tcp_peer = self._admit(peer, notice, TcpPeer)
        small = tcp_small.build(plan, self.local, self.name,
                                min(self._frame_bytes, MAX_BYTES))
        if small is not None:
            return tcp_peer.submit_small(small, notice)
        self.check_sources(plan)
        return tcp_peer.submit(plan, notice)

    def connect(self, peer_endpoint: bytes) -> TcpPeer:
        """Dial ``connections`` sockets to the endpoint, each authenticated both ways
        (ConnectError if the other side does not prove the endpoint's key)."""
        self._check_open()
        ep = TcpEndpoint.parse(peer_endpoint)
        return self._adopt(TcpPeer(
            peer_endpoint, host=ep.host, port=ep.port,
            key=derive_key(ep.token.encode(), self._data_secret), endpoint_id=ep.id,
            connections=self._connections,
            frame_bytes=self._frame_bytes, io_timeout=self._io_timeout,
            connect_timeout=self._connect_timeout, table=self._table))
