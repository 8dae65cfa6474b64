"""Which decode endpoint a request's KV goes to on a prefill rank, and who may abort it.

Each decode rank (tp, pp) of a request sends its indices (``TransferInit``) from one
endpoint. Who may have the request's KV is decided only once the request's
:class:`~kvhandoff.session.request.sender.Sender` exists, by its key (finding H2):

* **A request with a key** (:mod:`kvhandoff.binding`): indices count only when their
  proof verifies for the endpoint they came from and the transport endpoint its
  handshake named (:func:`refusal`). Anything else is refused before anything is planned
  or written — whether it came before or after the real decode's, while the Sender lives
  or before it existed — counted (``refused_claims``, and a metric), logged at a bounded
  rate, and answered FAILED with an ``AbortAck`` (nothing was written there); the
  request itself carries on.
* **A request without one**: the first endpoint whose indices the Sender took is the
  rank's *claim*; indices for the same rank from a second endpoint fail the request,
  loudly, on both (:func:`two_endpoints`), rather than hand the KV to whoever came
  first; a repeat from the same endpoint is ignored.
* **Before the Sender exists** indices are only buffered (a few claimants per request
  may wait side by side, see :mod:`~kvhandoff.session.rank.backlog`): nothing is decided
  until the Sender, and its key, are there.

A request's peers, who may abort it: while a Sender lives, the endpoints whose indices
it took (:class:`Claims`) and those it asked to handshake again; before, each claimant,
for its own indices only: an ``Abort`` from one drops its indices, and only when no
claimant is left is an early abort remembered (the Sender then fails on arrival). An
``Abort`` from anyone else changes nothing (the desk answers it ``AbortAck``, true for a
rank never written to, the same answer as for an id unknown here, so it reveals
nothing, and counts it in ``not_request_peer``), and leaves no tombstone. With the
deployment secret the endpoints are authenticated
(:mod:`~kvhandoff.session.control.auth`); without, they are only claimed. Claims are kept
only while their Sender lives (:meth:`Claims.keep_only`).

Pure and lock-free: the desk calls these under its own lock (:func:`refusal` needs none).
"""

from __future__ import annotations

import enum
from collections.abc import Container

from kvhandoff.binding import RequestKey
from kvhandoff.protocol import RankId, RequestId, TransferInit
from kvhandoff.session.rank.backlog import PrefillBacklog, Tomb

Slot = tuple[int, int]
"""A decode rank of a request: (tp rank, pp rank)."""


class Refused(enum.StrEnum):
    """Why indices were refused without touching their request (a metric's label)."""

    NO_PROOF = "no_proof"  # the request has a key; the indices carry no proof
    BAD_PROOF = "bad_proof"  # a proof that does not verify for that endpoint


def slot_of(rank: RankId) -> Slot:
    return rank.tp_rank, rank.pp_rank


def refusal(key: RequestKey | None, msg: TransferInit, endpoint: str,
            transport_endpoint: bytes) -> tuple[Refused, str] | None:
    """Why indices ``msg`` from the handshaken decode ``endpoint`` (its transport endpoint
    ``transport_endpoint``) may not have the KV of a request with ``key``; None when
    they may (or the request has no key)."""
    if key is None:
        return None
    why = key.refusal(msg.proof, msg.request_id, msg.rank, endpoint, transport_endpoint)
    if why is None:
        return None
    return (Refused.NO_PROOF if msg.proof is None else Refused.BAD_PROOF), why


def two_endpoints(rid: RequestId, rank: RankId, first: str, second: str) -> str:
    """Why request ``rid`` fails: decode ``rank`` sent its indices from ``first``, then
    from ``second``."""
    return (f"request {rid!r}: decode rank tp {rank.tp_rank} pp {rank.pp_rank} sent its "
            f"indices from two endpoints ({first}, then {second}); the request is failed "
            f"rather than handed to either (one may be an impostor taking the KV; give "
            f"the request a key, kvhandoff.binding, to tell them apart)")


class Claims:
    """Per live Sender's request, the endpoint whose indices it took for each decode rank."""

    def __init__(self) -> None:
        self._by_request: dict[RequestId, dict[Slot, str]] = {}

    def take(self, rid: RequestId, slot: Slot, endpoint: str) -> str | None:
        """Make ``endpoint`` the claim of ``slot`` for ``rid``, unless another endpoint is:
        then return that one (and change nothing)."""
        held = self._by_request.setdefault(rid, {}).setdefault(slot, endpoint)
        return None if held == endpoint else held

    def is_peer(self, rid: RequestId, endpoint: str | None) -> bool:
        """Whether the Sender of ``rid`` took indices from ``endpoint``."""
        return endpoint is not None and endpoint in self._by_request.get(rid, {}).values()

    def drop(self, rid: RequestId) -> None:
        self._by_request.pop(rid, None)

    def keep_only(self, live: Container[RequestId]) -> None:
        """Forget the claims of requests with no live Sender."""
        for rid in [k for k in self._by_request if k not in live]:
            del self._by_request[rid]

    def clear(self) -> None:
        self._by_request.clear()


class Buffering(enum.Enum):
    """What became of indices that came before their Sender (:func:`buffer`)."""

    BUFFERED = "buffered"
    REPEAT = "repeat"  # this endpoint's earlier set waits already: ignored
    FAILED = "failed"  # the request failed here: answer with its tombstone
    REFUSED = "refused"  # no room: answer with why


def buffer(backlog: PrefillBacklog, msg: TransferInit, endpoint: str, transport: bytes,
           now: float) -> tuple[Buffering, Tomb | str | None]:
    """Indices from the handshaken decode ``endpoint`` (transport endpoint ``transport``)
    for a request with no Sender: kept for it, unless the request already failed here
    (its tombstone) or there is no room (why). Nothing is claimed yet: the Sender
    decides (:func:`refusal`)."""
    tomb = backlog.tomb(msg.request_id)
    if tomb is not None:
        return Buffering.FAILED, tomb
    if backlog.sent(msg.request_id, endpoint):
        return Buffering.REPEAT, None
    why = backlog.buffer(endpoint, msg, now, transport)
    return (Buffering.BUFFERED, None) if why is None else (Buffering.REFUSED, why)


def abort_from(claims: Claims, backlog: PrefillBacklog, rid: RequestId,
               endpoint: str | None, why: str, now: float, *,
               has_sender: bool) -> tuple[Tomb | None, bool]:
    """An abort of ``rid`` from ``endpoint``: ``(its tombstone, whether endpoint is a peer
    of the request)``. With no Sender yet, a claimant's abort drops its own indices, and
    the last claimant's leaves an early abort (``why``)."""
    tomb = backlog.tomb(rid)
    if has_sender:
        return tomb, claims.is_peer(rid, endpoint)
    ours = endpoint is not None and tomb is None and backlog.sent(rid, endpoint)
    if ours and endpoint is not None and not backlog.drop_from(rid, endpoint):
        backlog.early_abort(rid, why, now)
    return tomb, ours
