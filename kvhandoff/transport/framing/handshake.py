"""The mutual challenge–response that opens every data-plane connection of the built-in
transports (tcp, the engines' staging channel, shm). Pure: bytes in, bytes out; no
sockets, no clocks (the socket shell is :func:`kvhandoff.transport.framing.served.prove` on
the client and ``ThreadedServer`` on the server).

Both ends hold the same *key* (:func:`derive_key`): the endpoint's random token, which
the receiver advertises in its endpoint over the control plane, keyed with the
deployment secret's data-plane key when one is configured, so a token seen on the wire
is useless without the secret. The token itself never travels on a data socket. ::

    server (accepted a connection)              client (dialled the endpoint)
    CHALLENGE  endpoint id, server nonce   ───▶ checks the endpoint id (a stale endpoint
                                                 fails here, by name)
                                           ◀─── ANSWER  client nonce, client proof
    checks the client proof; wrong: REFUSED
    (then close)
    VERDICT  endpoint id, server proof     ───▶ checks the server proof; only then does it
                                                 send its first frame (no KV reaches an
                                                 impostor that lacks the key)

    proof(role) = HMAC-SHA256(key, TAG ‖ role ‖ endpoint id ‖ server nonce ‖ client nonce)

* Every frame has a fixed size (server → client :data:`SERVER_FRAME` bytes, client →
  server :data:`CLIENT_FRAME`): a reader reads exactly that many, with a deadline, and
  nothing larger is read, nor anything allocated, before the handshake succeeded.
* Nonces are 32 random bytes from each side, so a recorded ANSWER or VERDICT fails on
  any other connection (replay), and the roles are in the MAC input, so neither side's
  proof is ever valid as the other's (reflection); an ANSWER that echoes the server's
  nonce is refused as well. Proofs are compared with :func:`hmac.compare_digest`.
* A server that will not serve a connection (over a cap, see ``ThreadedServer``) sends
  :func:`refusal` instead of a CHALLENGE, so the client fails with a reason, not an EOF.

Errors: :class:`HandshakeFailed`, always the peer's fault (a wrong key, a stale
endpoint, a malformed or truncated frame); the message says which, never a key.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass

__all__ = ["CLIENT_FRAME", "ENDPOINT_ID_BYTES", "NONCE_BYTES", "SERVER_FRAME",
           "ClientHandshake", "HandshakeFailed", "Refusal", "ServerHandshake", "derive_key",
           "new_endpoint_id", "refusal"]

MAGIC = b"KVHA"
VERSION = 1
NONCE_BYTES = 32
ENDPOINT_ID_BYTES = 8
TAG = b"kvhandoff data-plane handshake v1\0"
_ROLE_CLIENT, _ROLE_SERVER = b"client", b"server"  # same length: the MAC input is unambiguous
_KEY_INFO = b"kvhandoff data-plane key v1\0"

_SERVER = struct.Struct(f"<4sBBH{ENDPOINT_ID_BYTES}s32s")  # magic ver kind code, id, nonce|proof
_CLIENT = struct.Struct(f"<4sBBH{NONCE_BYTES}s32s")  # magic ver kind code, nonce, proof
SERVER_FRAME = _SERVER.size
"""Bytes of every server → client frame (CHALLENGE, VERDICT, REFUSED)."""
CLIENT_FRAME = _CLIENT.size
"""Bytes of the one client → server frame (ANSWER)."""


class _Kind(enum.IntEnum):
    CHALLENGE = 1
    ANSWER = 2
    VERDICT = 3
    REFUSED = 4


class Refusal(enum.IntEnum):
    """Why a server refused a connection (the code of a REFUSED frame)."""

    BAD_PROOF = 1  # the client's proof was wrong or its ANSWER malformed
    BUSY = 2  # over a connection cap: try later, or from fewer connections


_REFUSAL_TEXT = {
    Refusal.BAD_PROOF: "refused our proof (a different deployment secret, or a stale "
                       "endpoint token)",
    Refusal.BUSY: "refused the connection: its per-address or unauthenticated connection "
                  "cap is reached",
}


class HandshakeFailed(Exception):
    """The peer's handshake frame or proof is not acceptable (the message says why)."""


def derive_key(token: bytes, data_secret: bytes | None) -> bytes:
    """The handshake key of an endpoint whose token is ``token``: the token itself, or,
    with the deployment secret's data-plane key ``data_secret``, an HMAC of the token
    under it (a sniffed token alone then proves nothing)."""
    if not token:
        raise ValueError("a data-plane handshake needs a non-empty endpoint token")
    if data_secret is None:
        return token
    return hmac.new(data_secret, _KEY_INFO + token, hashlib.sha256).digest()


def new_endpoint_id() -> str:
    """A fresh public endpoint id (hex), advertised in the endpoint beside the token."""
    return secrets.token_hex(ENDPOINT_ID_BYTES)


def _id_bytes(endpoint_id: str) -> bytes:
    try:
        raw = bytes.fromhex(endpoint_id)
    except ValueError:
        raw = b""
    if len(raw) != ENDPOINT_ID_BYTES:
        raise HandshakeFailed(f"endpoint id {endpoint_id[:32]!r} is not "
                              f"{ENDPOINT_ID_BYTES} bytes of hex")
    return raw


def _nonce(nonce: bytes | None) -> bytes:
    """Fresh random bytes, or a test's own nonce (of the right length)."""
    if nonce is None:
        return secrets.token_bytes(NONCE_BYTES)
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a nonce is {NONCE_BYTES} bytes, got {len(nonce)}")
    return nonce


def _proof(key: bytes, role: bytes, eid: bytes, server_nonce: bytes,
           client_nonce: bytes) -> bytes:
    return hmac.new(key, TAG + role + eid + server_nonce + client_nonce,
                    hashlib.sha256).digest()


def _unpack(layout: struct.Struct, frame: bytes, who: str) -> tuple[int, int, bytes, bytes]:
    """``(kind, code, field, field)`` of a handshake frame; HandshakeFailed if it is not
    one of the right size, magic and version."""
    if len(frame) != layout.size:
        raise HandshakeFailed(f"{who} handshake frame of {len(frame)} B, want {layout.size} B")
    magic, version, kind, code, a, b = layout.unpack(frame)
    if magic != MAGIC:
        raise HandshakeFailed(f"{who} did not start the data-plane handshake (magic "
                              f"{bytes(magic)!r}, want {MAGIC!r}): an older kvhandoff or "
                              f"another service on that port")
    if version != VERSION:
        raise HandshakeFailed(f"{who} speaks data-plane handshake v{version}, we speak "
                              f"v{VERSION}")
    return kind, code, a, b


def refusal(reason: Refusal, endpoint_id: str) -> bytes:
    """A REFUSED frame (sent in place of a CHALLENGE or a VERDICT, then the close)."""
    return _SERVER.pack(MAGIC, VERSION, _Kind.REFUSED, reason, _id_bytes(endpoint_id),
                        bytes(32))


@dataclass(frozen=True, slots=True)
class ServerHandshake:
    """The server's side of one connection. Build with :meth:`new`; send
    :meth:`challenge`, read :data:`CLIENT_FRAME` bytes, pass them to :meth:`verdict`."""

    key: bytes
    endpoint_id: str
    nonce: bytes

    @classmethod
    def new(cls, key: bytes, endpoint_id: str, nonce: bytes | None = None) -> ServerHandshake:
        """``nonce``: fresh random bytes unless a test passes its own."""
        _id_bytes(endpoint_id)
        return cls(key, endpoint_id, _nonce(nonce))

    def challenge(self) -> bytes:
        return _SERVER.pack(MAGIC, VERSION, _Kind.CHALLENGE, 0, _id_bytes(self.endpoint_id),
                            self.nonce)

    def verdict(self, answer: bytes) -> bytes:
        """The VERDICT frame to send if ``answer`` proves the key; HandshakeFailed (send
        :func:`refusal` ``BAD_PROOF``, then close) otherwise."""
        kind, _code, client_nonce, proof = _unpack(_CLIENT, answer, "client")
        if kind != _Kind.ANSWER:
            raise HandshakeFailed(f"client sent handshake frame kind {kind}, want an ANSWER")
        if hmac.compare_digest(client_nonce, self.nonce):
            raise HandshakeFailed("client echoed the server's nonce (a reflected challenge)")
        eid = _id_bytes(self.endpoint_id)
        want = _proof(self.key, _ROLE_CLIENT, eid, self.nonce, client_nonce)
        if not hmac.compare_digest(proof, want):
            raise HandshakeFailed("client's proof is wrong: it does not hold this endpoint's "
                                  "key (a different deployment secret, or a stale token)")
        mine = _proof(self.key, _ROLE_SERVER, eid, self.nonce, client_nonce)
        return _SERVER.pack(MAGIC, VERSION, _Kind.VERDICT, 0, eid, mine)


@dataclass(frozen=True, slots=True)
class ClientHandshake:
    """The client's side: :meth:`answer` the server's first frame, then
    :meth:`check_verdict` its second. ``peer`` names the server in messages."""

    key: bytes
    endpoint_id: str
    nonce: bytes
    peer: str

    @classmethod
    def new(cls, key: bytes, endpoint_id: str, *, peer: str,
            nonce: bytes | None = None) -> ClientHandshake:
        _id_bytes(endpoint_id)
        return cls(key, endpoint_id, _nonce(nonce), peer)

    def _server_frame(self, frame: bytes, want: _Kind) -> bytes:
        kind, code, eid, body = _unpack(_SERVER, frame, self.peer)
        if kind == _Kind.REFUSED:
            try:
                why = _REFUSAL_TEXT[Refusal(code)]
            except ValueError:
                why = f"refused the connection (code {code})"
            raise HandshakeFailed(f"{self.peer} {why}")
        if kind != want:
            raise HandshakeFailed(f"{self.peer} sent handshake frame kind {kind}, want "
                                  f"{want.name}")
        if not hmac.compare_digest(eid, _id_bytes(self.endpoint_id)):
            raise HandshakeFailed(f"{self.peer} serves endpoint {eid.hex()}, not "
                                  f"{self.endpoint_id}: the endpoint is stale")
        return bytes(body)

    def answer(self, challenge: bytes) -> bytes:
        """The ANSWER frame for the server's first frame; HandshakeFailed if that was a
        refusal, malformed, or for another endpoint."""
        server_nonce = self._server_frame(challenge, _Kind.CHALLENGE)
        proof = _proof(self.key, _ROLE_CLIENT, _id_bytes(self.endpoint_id), server_nonce,
                       self.nonce)
        return _CLIENT.pack(MAGIC, VERSION, _Kind.ANSWER, 0, self.nonce, proof)

    def check_verdict(self, challenge: bytes, verdict: bytes) -> None:
        """Check the server's VERDICT (``challenge`` is its first frame, as answered);
        HandshakeFailed unless it proves the key: then send nothing and close."""
        server_nonce = self._server_frame(challenge, _Kind.CHALLENGE)
        proof = self._server_frame(verdict, _Kind.VERDICT)
        want = _proof(self.key, _ROLE_SERVER, _id_bytes(self.endpoint_id), server_nonce,
                      self.nonce)
        if not hmac.compare_digest(proof, want):
            raise HandshakeFailed(f"{self.peer} did not prove it holds the endpoint's key: "
                                  f"an impostor on that port, or a different deployment "
                                  f"secret; nothing was sent")
