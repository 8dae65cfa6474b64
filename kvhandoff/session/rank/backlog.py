"""What reaches a prefill rank for a request before its Sender exists, and after it failed.

A decode rank may send a request's indices (``TransferInit``) or abort it before the
engine has created the request's :class:`~kvhandoff.session.request.sender.Sender`. The
:class:`PrefillBacklog` keeps, per request id:

* the *buffered indices*, each with the decode endpoint that sent it and when, until the
  Sender comes for them (:meth:`~PrefillBacklog.take`) or ``hold`` seconds pass;
* a *tombstone* of a request that failed here, for ``hold`` seconds, so late indices or
  aborts for it are answered and its Sender, if one comes, fails on arrival;
* an *early abort*: an abort from a peer of a request with no Sender yet.

Bounds. Nothing a peer sends may grow without bound or push out what a real request
left: a request id over ``MAX_ID_BYTES`` is refused (:func:`id_problem`); buffered indices
are capped in bytes (``MAX_INIT_BYTES``), in requests (``max_requests``), to one set per
request and decode endpoint (the caller ignores a repeat, see :meth:`~PrefillBacklog.sent`)
and to ``MAX_CLAIMANTS`` endpoints per request (several may wait side by side: the
Sender, not the order they came in, decides whose they are);
a kept reason is cut to ``MAX_REASON`` characters. Tombstones of requests that had a
Sender here (``MAX_TOMBSTONES``) are kept apart from early aborts (``MAX_EARLY_ABORTS``,
oldest forgotten first), so aborts cannot evict a real tombstone and the ``unsafe``
endpoints it remembers. The caps are read when used, so a test may lower them.

Pure and lock-free: no clock (``now`` is passed in), no I/O; the desk calls it under
its own lock.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

from kvhandoff.protocol import RequestId, TransferInit
from kvhandoff.session.errors import PeerLost, RequestAborted, SessionError

MAX_TOMBSTONES = 65536
"""Requests that failed here (only local Senders make these)."""
MAX_EARLY_ABORTS = 4096
"""Aborts remembered for request ids with no Sender here (anyone can send these)."""
MAX_ID_BYTES = 1024
"""A request id longer than this (a ``str``'s UTF-8 bytes) is refused."""
MAX_REASON = 4096
"""Characters of an abort's reason that are kept."""
MAX_INIT_BYTES = 256 << 20
"""Bytes of index lists buffered for requests with no Sender yet, in all."""
MAX_CLAIMANTS = 16
"""Decode endpoints whose indices for one request wait for its Sender (a request's own
decode ranks, and whoever else claims them)."""


class Tomb(NamedTuple):
    """A failed request, remembered for a while."""

    reason: str
    expires: float  # time.monotonic()
    unsafe: frozenset[str]  # decode endpoints a cancelled write may still reach
    lost: bool = False  # failed for an unreachable decode rank, not an abort

    def error(self) -> SessionError:
        return PeerLost(self.reason) if self.lost else RequestAborted(self.reason)


class Buffered(NamedTuple):
    """Indices that came before their Sender."""

    endpoint: str  # the decode endpoint that sent them
    msg: TransferInit
    at: float  # time.monotonic() when they came
    transport: bytes = b""  # that decode rank's transport endpoint (what its proof names)


def id_problem(rid: RequestId) -> str | None:
    """Why a request id from the wire is refused (too long to keep), or None."""
    if isinstance(rid, str) and len(rid) * 4 > MAX_ID_BYTES and \
            len(rid.encode(errors="replace")) > MAX_ID_BYTES:
        return f"request id of {len(rid.encode(errors='replace'))} B (at most {MAX_ID_BYTES} B)"
    return None


def init_bytes(msg: TransferInit) -> int:
    """Bytes a buffered TransferInit holds in index lists (what its sender controls)."""
    return sum(len(m.items) + len(m.positions or b"") for m in msg.indices.values()
               if m is not None)


class PrefillBacklog:
    """See the module docstring. ``hold``: seconds indices and tombstones are kept
    (``indices_timeout``); ``max_requests``: requests with buffered indices at most
    (``max_pending_inits``); ``who``: this rank, for refusals."""

    def __init__(self, *, hold: float, max_requests: int, who: str) -> None:
        self.hold, self.max_requests, self.who = hold, max_requests, who
        self.inits: collections.OrderedDict[RequestId, list[Buffered]] = \
            collections.OrderedDict()
        self.init_bytes = 0  # what the buffered index lists hold
        self.tombstones: collections.OrderedDict[RequestId, Tomb] = collections.OrderedDict()
        self.early: collections.OrderedDict[RequestId, Tomb] = \
            collections.OrderedDict()  # aborts for ids no Sender here had

    def tomb(self, rid: RequestId) -> Tomb | None:
        """The tombstone of ``rid``, from either table."""
        tomb = self.tombstones.get(rid)
        return tomb if tomb is not None else self.early.get(rid)

    def tombstone(self, rid: RequestId, reason: str, now: float,
                  unsafe: frozenset[str] = frozenset(), *, lost: bool = False) -> None:
        """Remember a failed request; ``unsafe``: decode endpoints a cancelled write may
        still reach, never to be told "no write in flight"."""
        self.early.pop(rid, None)
        self.tombstones[rid] = Tomb(reason[:MAX_REASON], now + self.hold, unsafe, lost)
        while len(self.tombstones) > MAX_TOMBSTONES:
            self.tombstones.popitem(last=False)

    def early_abort(self, rid: RequestId, reason: str, now: float) -> None:
        """Remember an abort for a request with no Sender here (its own bounded table)."""
        self.early[rid] = Tomb(reason[:MAX_REASON], now + self.hold, frozenset())
        while len(self.early) > MAX_EARLY_ABORTS:
            self.early.popitem(last=False)

    def take(self, rid: RequestId) -> tuple[list[Buffered], Tomb | None]:
        """For a new Sender: remove and return its buffered indices and its tombstone."""
        tomb = self.tombstones.pop(rid, None)
        early = self.early.pop(rid, None)
        return self.take_inits(rid), tomb or early

    def fail(self, rid: RequestId, reason: str, now: float, *, lost: bool = False) -> None:
        """A request with no Sender failed: drop what waits for it and tombstone it (its
        Sender fails on arrival)."""
        self.take_inits(rid)
        self.tombstone(rid, reason, now, lost=lost)

    def take_inits(self, rid: RequestId) -> list[Buffered]:
        """Remove and return the indices buffered for ``rid``."""
        got = self.inits.pop(rid, [])
        self.init_bytes -= sum(init_bytes(b.msg) for b in got)
        return got

    def sent(self, rid: RequestId, endpoint: str) -> bool:
        """Whether ``endpoint`` already has indices buffered for ``rid``."""
        return any(b.endpoint == endpoint for b in self.inits.get(rid, ()))

    def drop_from(self, rid: RequestId, endpoint: str) -> bool:
        """Drop the indices ``endpoint`` buffered for ``rid``; whether others still wait."""
        entries = self.inits.get(rid, [])
        mine = [b for b in entries if b.endpoint == endpoint]
        rest = [b for b in entries if b.endpoint != endpoint]
        self.init_bytes -= sum(init_bytes(b.msg) for b in mine)
        if rest:
            self.inits[rid] = rest
        else:
            self.inits.pop(rid, None)
        return bool(rest)

    def buffer(self, endpoint: str, msg: TransferInit, now: float, transport: bytes = b""
               ) -> str | None:
        """Buffer indices that arrived before their Sender (from ``endpoint``, whose
        transport endpoint is ``transport``); why not, if refused (the caller checks
        :meth:`sent` first: a repeat is not buffered again)."""
        rid = msg.request_id
        if rid not in self.inits and len(self.inits) >= self.max_requests:
            return (f"{self.who} holds {self.max_requests} requests' indices with no "
                    f"Sender yet (max_pending_inits); refused")
        if len(self.inits.get(rid, ())) >= MAX_CLAIMANTS:
            return (f"{self.who}: {MAX_CLAIMANTS} decode endpoints sent indices for "
                    f"request {rid!r} before its Sender (MAX_CLAIMANTS); refused")
        size = init_bytes(msg)
        if self.init_bytes + size > MAX_INIT_BYTES:
            return (f"{self.who} buffers {self.init_bytes} B of indices with no Sender "
                    f"yet; {size} B more would pass MAX_INIT_BYTES ({MAX_INIT_BYTES} B); "
                    f"refused")
        self.inits.setdefault(rid, []).append(Buffered(endpoint, msg, now, transport))
        self.init_bytes += size
        return None

    def endpoints(self) -> set[str]:
        """The decode endpoints with indices buffered here (still in use)."""
        return {b.endpoint for entries in self.inits.values() for b in entries}

    def expire(self, now: float) -> None:
        """Forget tombstones past their time and indices no Sender came for in ``hold``."""
        for table in (self.tombstones, self.early):
            for rid in [k for k, t in table.items() if t.expires < now]:
                del table[rid]
        for rid in [k for k, v in self.inits.items() if now - v[0].at > self.hold]:
            self.take_inits(rid)

    def clear_inits(self) -> None:
        """Forget every buffered index list (closing)."""
        self.inits.clear()
        self.init_bytes = 0
