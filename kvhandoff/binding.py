"""A request bound to its decode: the request's key, and the proof a decode rank sends
with its indices so that prefill writes the request's KV only there.

**Why.** A prefill rank learns where a request's KV goes from the ``TransferInit`` that
decode ranks send it. Without more, whoever sends indices for the request id first is
its decode: a second decode agent of the same layout that sent them after prefill had
the KV queued, but before the real decode's arrived, got an exact copy and SUCCESS,
while the real decode starved (finding H2, issue #30). The deployment secret does not
help against a rogue that holds it, and request ids are often guessable.

**The key.** A :class:`RequestKey` is a per-request secret that the request's prefill
and decode hold, and nobody else but whoever routed the request. Each engine adapter
makes it from what its router hands both sides (nothing more is sent anywhere):

* :meth:`RequestKey.new`, random, where the router can carry a value from one side to
  the other: vLLM's prefill makes it and returns it in ``kv_transfer_params``, which
  the proxy hands decode with the request;
* :meth:`RequestKey.derive`, where both sides get only the request's id (SGLang's
  ``bootstrap_room``, a random 63-bit integer from the router): a keyed hash of the id
  under a secret every process of the deployment holds and no one else does —
  :meth:`RequestKey.for_room` uses the deployment secret's
  :data:`~kvhandoff.secret.PURPOSE_REQUEST` key, the reference engine's router a secret
  of its run. Such a key is as secret as the id is among the holders of that secret.

**The proof.** A decode rank sends ``HMAC-SHA256(key, request id | its rank | its
control endpoint | its transport endpoint)``, truncated to 128 bits, in its
``TransferInit`` (:meth:`RequestKey.prove`). The prefill rank recomputes it from what its
handshake with that decode rank recorded — the control endpoint the indices came from,
the transport endpoint it will write to — and refuses indices whose proof does not
match (:meth:`RequestKey.refusal`) before anything is planned or written. The proof
names the destination: a claimant that speaks under the real decode's control endpoint
(a holder of the deployment secret can) but handshook with its own transport endpoint is
refused as well. It reveals nothing of the key, and a proof captured on the wire is
worth nothing to a claimant at another endpoint.

Pure and standard library only (HMAC); safe to share between threads.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

import msgspec

from kvhandoff.protocol import RankId, RequestId
from kvhandoff.secret import PURPOSE_REQUEST, Secret

__all__ = ["KEY_BYTES", "PROOF_BYTES", "RequestKey"]

KEY_BYTES = 32
"""Bytes of a new key (at least 16 are required of one made elsewhere)."""
PROOF_BYTES = 16
"""A proof: HMAC-SHA-256 truncated to 128 bits (tried online only, one guess per try)."""
_MIN_KEY = 16
_CLAIM = "kvhandoff/claim/v1"
_DERIVED = "kvhandoff/request-key/v1"
_encode = msgspec.msgpack.Encoder().encode  # deterministic for str, int and bytes


@dataclass(frozen=True, slots=True)
class RequestKey:
    """One request's key (see the module docstring). Immutable; its bytes never show in
    ``repr``. Give the same key to the request's Sender on every prefill rank and its
    Receiver on every decode rank."""

    material: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.material, bytes) or len(self.material) < _MIN_KEY:
            raise ValueError(f"a request key needs at least {_MIN_KEY} bytes")

    @classmethod
    def new(cls) -> RequestKey:
        """A fresh random key."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_hex(cls, text: object) -> RequestKey:
        """The key :meth:`hex` wrote; ``ValueError`` naming what is wrong otherwise."""
        if not isinstance(text, str):
            raise ValueError(f"a request key is a hex string, got {type(text).__name__}")
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raise ValueError("a request key is a hex string (not hex digits)") from None
        return cls(raw)

    def hex(self) -> str:
        """The key as hex, to carry it in a request (e.g. vLLM's ``kv_transfer_params``)."""
        return self.material.hex()

    @classmethod
    def derive(cls, shared: bytes, request_id: RequestId) -> RequestKey:
        """The key of ``request_id`` under ``shared``, a secret both sides hold (at least
        16 bytes): the same on every process that holds it, unrelated across ids."""
        if len(shared) < _MIN_KEY:
            raise ValueError(f"a shared secret needs at least {_MIN_KEY} bytes")
        return cls(hmac.digest(shared, _encode((_DERIVED, request_id)), hashlib.sha256))

    @classmethod
    def for_room(cls, room: RequestId, secret: Secret) -> RequestKey:
        """The key of a request whose sides share only its id ``room`` (SGLang's
        ``bootstrap_room``), under the deployment ``secret``."""
        return cls.derive(secret.key(PURPOSE_REQUEST), room)

    def prove(self, request_id: RequestId, rank: RankId, control_endpoint: str,
              transport_endpoint: bytes) -> bytes:
        """The proof decode rank ``rank`` sends with its indices for ``request_id``: that
        it holds the key, and that the request's KV goes to the agent at
        ``control_endpoint`` and ``transport_endpoint`` (its own)."""
        claim = _encode((_CLAIM, request_id, rank.instance, rank.dp_rank, rank.tp_rank,
                         rank.tp_size, rank.pp_rank, rank.pp_size, control_endpoint,
                         transport_endpoint))
        return hmac.digest(self.material, claim, hashlib.sha256)[:PROOF_BYTES]

    def refusal(self, proof: bytes | None, request_id: RequestId, rank: RankId,
                control_endpoint: str, transport_endpoint: bytes) -> str | None:
        """Why indices carrying ``proof`` from decode ``rank`` at ``control_endpoint``
        (handshaken with ``transport_endpoint``) are not this request's decode's, or
        None when they are."""
        who = f"request {request_id!r}: decode {rank} at {control_endpoint}"
        if proof is None:
            return (f"{who} sent indices without proof that the request was routed to it "
                    f"(was that decode given the request's key?); refused, nothing sent "
                    f"there")
        want = self.prove(request_id, rank, control_endpoint, transport_endpoint)
        if not hmac.compare_digest(want, proof):
            return (f"{who} sent indices whose proof does not match the request's key and "
                    f"that decode's endpoints (another decode's request, or another "
                    f"key); refused, nothing sent there")
        return None
