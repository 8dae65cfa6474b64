"""Which decode endpoints are a request's peers on a prefill rank: who may abort it.

A request's peers are the decode endpoints that sent its indices (buffered or delivered)
and those its Sender asked to handshake again. Only they may abort it: an ``Abort`` from
anyone else changes nothing (the desk answers it ``AbortAck``, true for a rank never
written to, the same answer as for an id unknown here, so it reveals nothing, and counts
it in ``not_request_peer``); so is an abort for an id with no Sender and no indices here,
which therefore leaves no tombstone.

Each decode rank (tp, pp) of a request sends its indices from one endpoint, its *claim*:
indices for the same request and rank from a second endpoint fail the request, loudly,
on both (:func:`two_endpoints`; a rogue decode that sent them first would otherwise get
the KV and the real one starve, finding H2), and a repeat from the same endpoint is
ignored. With the deployment secret the endpoints are authenticated
(:mod:`~kvhandoff.session.control.auth`); without, they are only claimed. A claim is kept
only while its request has a Sender or buffered indices (:meth:`Claims.keep_only`), at
most one per handshaken decode rank (``MAX_DECODE_PEERS``).

:func:`admit` and :func:`abort_from` apply these rules to a request's
:class:`~kvhandoff.session.rank.backlog.PrefillBacklog` and claims when indices or an abort
arrive. Pure and lock-free: the desk calls them under its own lock.
"""

from __future__ import annotations

from collections.abc import Container
from typing import NamedTuple

from kvhandoff.protocol import RankId, RequestId, TransferInit
from kvhandoff.session.rank.backlog import PrefillBacklog, Tomb

Slot = tuple[int, int]
"""A decode rank of a request: (tp rank, pp rank)."""


def slot_of(rank: RankId) -> Slot:
    return rank.tp_rank, rank.pp_rank


def two_endpoints(rid: RequestId, rank: RankId, first: str, second: str) -> str:
    """Why request ``rid`` fails: decode ``rank`` sent its indices from ``first``, then
    from ``second``."""
    return (f"request {rid!r}: decode rank tp {rank.tp_rank} pp {rank.pp_rank} sent its "
            f"indices from two endpoints ({first}, then {second}); the request is failed "
            f"rather than handed to either (one may be an impostor taking the KV)")


class Claims:
    """Per request, the endpoint that sent each decode rank's indices."""

    def __init__(self) -> None:
        self._by_request: dict[RequestId, dict[Slot, str]] = {}

    def first(self, rid: RequestId, slot: Slot) -> str | None:
        """The endpoint that sent ``slot``'s indices for ``rid`` already, if one did."""
        return self._by_request.get(rid, {}).get(slot)

    def claim(self, rid: RequestId, slot: Slot, endpoint: str) -> None:
        self._by_request.setdefault(rid, {})[slot] = endpoint

    def is_peer(self, rid: RequestId, endpoint: str | None) -> bool:
        """Whether ``endpoint`` sent indices for ``rid`` (so it may abort it)."""
        return endpoint is not None and endpoint in self._by_request.get(rid, {}).values()

    def drop(self, rid: RequestId) -> None:
        self._by_request.pop(rid, None)

    def keep_only(self, *live: Container[RequestId]) -> None:
        """Forget the claims of requests in none of ``live`` (their indices expired or
        were dropped)."""
        for rid in [k for k in self._by_request if not any(k in c for c in live)]:
            del self._by_request[rid]

    def clear(self) -> None:
        self._by_request.clear()


class Admission(NamedTuple):
    """What :func:`admit` made of a decode rank's indices."""

    tomb: Tomb | None  # the request already failed here: answer with its reason
    first: str | None  # a second endpoint: the first one (``twice`` says why it fails)
    twice: str | None
    refused: str | None  # could not be buffered: why
    repeat: bool = False  # this endpoint's earlier set is buffered: ignored


def admit(claims: Claims, backlog: PrefillBacklog, msg: TransferInit, endpoint: str,
          now: float, *, has_sender: bool) -> Admission:
    """Indices from the handshaken decode ``endpoint``. With no Sender yet they are
    buffered (or refused); unless the request failed or they were refused, ``endpoint``
    is the rank's claim. From a second endpoint they fail the request: with no Sender yet
    its buffered indices are dropped and it is tombstoned (its Sender fails on arrival)."""
    rid, slot = msg.request_id, slot_of(msg.rank)
    tomb = backlog.tomb(rid)
    first = None if tomb is not None else claims.first(rid, slot)
    if first is not None and first != endpoint:
        why = two_endpoints(rid, msg.rank, first, endpoint)
        if not has_sender:
            claims.drop(rid)
            backlog.fail(rid, why, now)
        return Admission(tomb, first, why, None)
    waits = not has_sender and tomb is None
    repeat = waits and backlog.sent(rid, endpoint)
    refused = backlog.buffer(endpoint, msg, now) if waits and not repeat else None
    if tomb is None and refused is None:
        claims.claim(rid, slot, endpoint)
    return Admission(tomb, None, None, refused, repeat)


def abort_from(claims: Claims, backlog: PrefillBacklog, rid: RequestId,
               endpoint: str | None, why: str, now: float, *,
               has_sender: bool) -> tuple[Tomb | None, bool]:
    """An abort of ``rid`` from ``endpoint``: ``(its tombstone, whether endpoint sent
    its indices)``. From such a peer, with no Sender and no tombstone yet, the buffered
    indices are dropped and an early abort (``why``) remembered."""
    tomb, ours = backlog.tomb(rid), claims.is_peer(rid, endpoint)
    if not has_sender and tomb is None and ours:
        backlog.take_inits(rid)
        claims.drop(rid)
        backlog.early_abort(rid, why, now)
    return tomb, ours
