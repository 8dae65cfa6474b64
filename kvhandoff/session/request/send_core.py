"""Prefill side of one request, sans I/O: events in, effects out.

:class:`~kvhandoff.session.request.sender.Sender` is the shell: it holds the lock, feeds these
events and carries out the effects with its host (post, plan, submit, track). The rules:

* **Bootstrapping.** Indices (``indices``) arrive from decode ranks of one deployment;
  the first one fixes which decode ranks are expected. Once ``init`` was called and
  every expected rank's indices are in (with one prefix length, and a KV chunking that
  fits each), the request is BOOTSTRAPPED and the queued chunks go out.
* **The lease.** Still bootstrapping ``lease`` seconds after the engine handed over the
  last chunk (prefill is done; its memory waits for decode alone), the request fails
  with ``LeaseExpired``, logged once, and settles: the engine frees its memory. Before
  the last chunk, ``indices_timeout`` (from creation) bounds the wait.
* **Chunks, one write at a time.** For each (decode rank, chunk), in order, the core
  emits ``PlanChunk`` (the planner request); the shell answers ``planned`` (or
  ``plan_failed``). A plan with bytes becomes ``Write``, answered ``submitted`` (or
  ``submit_refused``); the next ``PlanChunk`` comes only then, so a failure stops the
  rest. An empty plan counts as written at once. A write the shell batched with others
  (:mod:`~kvhandoff.session.control.write_batch`) is answered ``submitted`` when batched and,
  should the batch's submit be refused, ``refused`` later.
* **Statuses.** A written chunk's status is posted unless it travelled in band; the last
  chunk's waits until every chunk to that rank is written, so decode never hears "last"
  early. The last chunk written to every rank: ALL_DONE.
* **Failure** (any event, first one wins): every decode rank not yet told gets a FAILED
  status. **Settling:** terminal with no write in flight; after a failure each decode
  rank then gets an ``AbortAck``, unless a write timed out (it may still land).

Effects (besides ``Post``/``Fire``/``Fail``/``Mark``): ``PlanChunk``, ``Write``,
``StampGuard`` (write the aux guard), ``WriteFailed`` (watch that decode rank),
``Settle`` (the request is over here).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from kvhandoff.errors import HandoffError, LayoutMismatch, RemoteOutOfBounds
from kvhandoff.layout import Layout
from kvhandoff.observe import timeline as tl
from kvhandoff.plan import Indices
from kvhandoff.plan.request import IndexArray, as_indices
from kvhandoff.protocol import (
    AbortAck,
    Outcome,
    PlannedIndicesMsg,
    RankId,
    RequestId,
    TransferInit,
    TransferStatus,
)
from kvhandoff.session.errors import (
    AgentClosed,
    LeaseExpired,
    PeerLost,
    RequestAborted,
    RequestTimeout,
    SessionError,
    TransferFailed,
)
from kvhandoff.session.peers.mapping import decode_candidates
from kvhandoff.session.request.chunks import KvCursor, StateLists, chunk_request
from kvhandoff.session.request.components import repageable
from kvhandoff.session.request.core import CoreBase, Mark, Post, RankFacts
from kvhandoff.session.request.status import Event, Status

log = logging.getLogger("kvhandoff.session.request.sender")

@dataclass(frozen=True, slots=True)
class PlanChunk:
    """Plan chunk ``chunk`` for decode rank ``endpoint`` (answer: planned / plan_failed)."""

    endpoint: str
    chunk: int
    request: dict[str, Indices | None]
    checksums: bool  # digest the source bytes (decode asked for it)


@dataclass(frozen=True, slots=True)
class Write:
    """Submit the planned writes with ``status`` (answer: submitted / submit_refused);
    report their end with ``written``."""

    endpoint: str
    status: TransferStatus
    payload: object  # the shell's plan, handed back untouched


@dataclass(frozen=True, slots=True)
class StampGuard:
    row: int


@dataclass(frozen=True, slots=True)
class WriteFailed:
    endpoint: str


@dataclass(frozen=True, slots=True)
class Settle:
    pass


@dataclass(slots=True)
class _Chunk:
    no: int
    pages: IndexArray
    state: StateLists | None
    last: bool


@dataclass(slots=True)
class _Target:
    """One decode rank of the request."""

    endpoint: str
    rank: RankId  # as its handshake named it
    layout: Layout
    init: TransferInit
    cursor: KvCursor | None = None
    submitted: int = 0  # chunks planned for it (empty plans included)
    done: int = 0  # chunks whose writes completed
    last_done: bool = False  # the last chunk's writes completed
    held_last: TransferStatus | None = None  # its status, sent once every chunk is done
    finished: bool = False  # its final status (success or failure) went out


def failed_answer(request_id: RequestId, rank: RankId, reason: str, *, ack: bool,
                  chunk: int = 0) -> list[TransferStatus | AbortAck]:
    """A failed request's last word to a decode rank: a FAILED status for its last chunk
    (``chunk``) with ``reason``, then, when ``ack``, an ``AbortAck`` (nothing of ours is
    in flight to that rank: it may reuse its pages)."""
    out: list[TransferStatus | AbortAck] = [TransferStatus(
        request_id=request_id, rank=rank, chunk=chunk, last=True, outcome=Outcome.FAILED,
        reason=reason)]
    if ack:
        out.append(AbortAck(request_id=request_id, rank=rank))
    return out


def _batched(shared: int) -> str:
    return "" if not shared else \
        f" (one batched write with {shared} other chunk(s) to that rank, all failed alike)"


class SendFacts(RankFacts, Protocol):
    """What a prefill core reads of its rank."""

    @property
    def layout(self) -> Layout: ...

    @property
    def kv_name(self) -> str | None: ...

    @property
    def aux_name(self) -> str | None: ...

    @property
    def kv_repageable(self) -> bool: ...


class SendCore(CoreBase):
    """See the module docstring. Every event returns the effects to carry out, in order."""

    def __init__(self, *, request_id: RequestId, facts: SendFacts, created: float) -> None:
        super().__init__(request_id=request_id, facts=facts, created=created)
        self.facts = facts
        self.num_pages: int | None = None
        self._num_tokens: int | None = None
        self._aux_row: int | None = None
        self._aux_src: IndexArray | None = None
        self._expected: frozenset[tuple[int, int]] | None = None
        self._deployment: tuple[str, int, int] | None = None
        self.targets: dict[str, _Target] = {}
        self._queued: list[_Chunk] = []  # before bootstrap
        self._pending: deque[tuple[_Target, _Chunk]] = deque()  # to plan, in order
        self._current: tuple[_Target, _Chunk] | None = None  # planned or written, unanswered
        self._awaiting: set[str] = set()  # decode endpoints asked to handshake again
        self._chunks = 0
        self._last_given = False
        self._lease_from: float | None = None  # when the last chunk was handed over
        self._inflight = 0
        self.poisoned = False  # a cancelled write may still land: never AbortAck
        self.settled = False

    # --- queries ---------------------------------------------------------------------

    @property
    def last_given(self) -> bool:
        """The engine handed over the last chunk."""
        return self._last_given

    @property
    def decode_prefix_len(self) -> int | None:
        t = next(iter(self.targets.values()), None)
        return None if t is None else t.init.decode_prefix_len

    def unsafe_endpoints(self) -> frozenset[str]:
        """Decode endpoints a cancelled write of ours may still reach."""
        return frozenset(self.targets) if self.poisoned else frozenset()

    def peer_endpoints(self) -> set[str]:
        if self.settled:
            return set()
        return set(self.targets) | (set() if self.terminal else self._awaiting)

    # --- the engine's events -----------------------------------------------------------

    def init(self, num_pages: int, aux_row: int | None, num_tokens: int | None) -> list[object]:
        """Raises ``RuntimeError`` when called twice."""
        if self.num_pages is not None:
            raise RuntimeError(f"Sender {self.request_id!r}: init() called twice")
        self.num_pages, self._aux_row, self._num_tokens = num_pages, aux_row, num_tokens
        # the aux row as its planner list, made here (the engine's thread), not per plan
        self._aux_src = None if aux_row is None else as_indices([aux_row], "aux row")
        self._maybe_bootstrapped()
        return self._take()

    def send(self, pages: IndexArray, state: StateLists | None, last: bool, *,
             now: float) -> list[object]:
        """One chunk, handed over at ``now`` (the last one starts the lease). Raises
        ``RuntimeError`` before ``init`` or after the last chunk."""
        if self.num_pages is None:
            raise RuntimeError(f"Sender {self.request_id!r}: send() before init()")
        if self._last_given:
            raise RuntimeError(f"Sender {self.request_id!r}: send() after the last chunk")
        chunk = _Chunk(self._chunks, pages, state, last)
        self._chunks += 1
        self._last_given = last
        if last:
            self._lease_from = now
        if self.terminal:
            return []
        if last and self._aux_row is not None:
            self._emit(StampGuard(self._aux_row))
        if self.status is Status.BOOTSTRAPPING:
            self._queued.append(chunk)
        else:
            self._pending.extend((t, chunk) for t in self.targets.values())
            self._pump()
        return self._take()

    def abort(self, reason: str) -> list[object]:
        self._fail(RequestAborted(f"request {self.request_id!r}: {reason}"))
        return self._take()

    # --- the rank's events -------------------------------------------------------------

    def failed_before(self, error: SessionError) -> list[object]:
        """The request had already failed here before it existed (its backlog said so)."""
        self._fail(error)
        return self._take()

    def dropped_before(self, rank: RankId, why: str) -> list[object]:
        """A decode rank sent indices, then was dropped before this request existed."""
        self._fail(PeerLost(f"request {self.request_id!r}: decode {rank} sent its indices, "
                            f"then was dropped before this Sender existed: {why}"))
        return self._take()

    def agent_closed(self) -> list[object]:
        self._fail(AgentClosed(f"request {self.request_id!r}: the prefill agent closed"))
        return self._take()

    def init_refused(self, reason: str) -> list[object]:
        """A decode rank's indices came, but the rank cannot be written (unreachable)."""
        self._fail(PeerLost(reason))
        return self._take()

    def init_deferred(self, endpoint: str) -> list[object]:
        """Indices came from an unknown ``endpoint``, asked to handshake again: until it
        resends, it is watched (a death then fails the request, not a timeout)."""
        if not self.terminal and endpoint not in self.targets:
            self._awaiting.add(endpoint)
        return []

    def indices(self, endpoint: str, rank: RankId, layout: Layout,
                msg: TransferInit) -> list[object]:
        """Decode rank ``rank`` (control ``endpoint``, ``layout``) sent its indices."""
        if self.terminal:
            self._answer_late(endpoint)
        elif self._accepts(msg.rank):
            if any(t.init.rank.tp_rank == msg.rank.tp_rank
                   and t.init.rank.pp_rank == msg.rank.pp_rank for t in self.targets.values()):
                log.warning("duplicate TransferInit for %r from %s ignored", self.request_id,
                            msg.rank)
                return []
            self.targets[endpoint] = _Target(endpoint, rank, layout, msg)
            self._awaiting.discard(endpoint)
            self._maybe_bootstrapped()
        return self._take()

    def decode_aborted(self, endpoint: str | None, who: str, reason: str) -> list[object]:
        was_settled = self.settled
        self._fail(RequestAborted(f"request {self.request_id!r} aborted by decode {who}: "
                                  f"{reason}"))
        if endpoint is not None and (endpoint not in self.targets
                                     or (was_settled and not self.poisoned)):
            # never wrote to it, or nothing is in flight any more
            self._emit(Post(endpoint, AbortAck(request_id=self.request_id, rank=self.rank)))
        return self._take()

    def peer_lost(self, endpoint: str, reason: str) -> list[object]:
        if self.terminal:
            return []
        t = self.targets.get(endpoint)
        if t is not None:
            self._fail(PeerLost(f"request {self.request_id!r}: decode {t.rank}: {reason}"))
        elif endpoint in self._awaiting:
            self._fail(PeerLost(f"request {self.request_id!r}: decode {endpoint}, asked "
                                f"to handshake again and resend its indices: {reason}"))
        return self._take()

    def tick_due(self, now: float) -> bool:
        """Whether :meth:`tick` may have anything to do at ``now``. Safe without the
        shell's lock: it reads only the status, which never returns to BOOTSTRAPPING, the
        creation time and the lease's start, set once, so a stale answer is at worst a
        True that :meth:`tick` then finds has nothing to do, or a False the next tick
        corrects."""
        return self.status is Status.BOOTSTRAPPING and (
            self._lease_expired(now) or now - self.created > self.facts.config.indices_timeout)

    def tick(self, now: float) -> list[object]:
        if self.status is not Status.BOOTSTRAPPING:
            return self._take()
        want = "?" if self._expected is None else str(len(self._expected))
        got = f"got {len(self.targets)} of {want} decode ranks' TransferInits"
        limit = self.facts.config.indices_timeout
        if self._lease_expired(now):
            lease = self.facts.config.lease
            error = LeaseExpired(
                f"request {self.request_id!r}: prefill finished it, and no decode claimed it "
                f"within the {lease:g} s lease ({got}); its memory is freed")
            log.warning("%s", error)  # once: the request is terminal from here on
            self.events["lease_expired"] += 1
            self._fail(error)
        elif now - self.created > limit:
            self._fail(RequestTimeout(
                f"request {self.request_id!r}: waited {limit:g} s (indices_timeout) for "
                f"decode's indices; {got}"
                + ("" if self.num_pages is not None else "; init() was never called")))
        return self._take()

    def _lease_expired(self, now: float) -> bool:
        start = self._lease_from
        return start is not None and now - start > self.facts.config.lease

    # --- answers to PlanChunk and Write --------------------------------------------------

    def planned(self, nbytes: int, checksums: dict[str, int] | None,
                indices: dict[str, PlannedIndicesMsg] | None, payload: object) -> list[object]:
        """The outstanding ``PlanChunk`` was planned: ``nbytes`` to write."""
        t, chunk = self._answer()
        if self.terminal:
            return self._take()
        t.submitted += 1
        status = TransferStatus(
            request_id=self.request_id, rank=self.rank, chunk=chunk.no, last=chunk.last,
            outcome=Outcome.SUCCESS, nbytes=nbytes, checksums=checksums, indices=indices)
        if not nbytes:
            self._chunk_done(t, status, False)
            self._pump()
        else:
            self._inflight += 1
            self._current = (t, chunk)
            self._emit(Write(t.endpoint, status, payload))
        return self._take()

    def plan_failed(self, why: str) -> list[object]:
        t, chunk = self._answer()
        self._fail(TransferFailed(f"request {self.request_id!r} chunk {chunk.no} for "
                                  f"decode {t.rank}: {why}"))
        return self._take()

    def submitted(self) -> list[object]:
        """The outstanding ``Write`` was submitted and is tracked."""
        self._answer()
        self._pump()
        return self._take()

    def submit_refused(self, why: str) -> list[object]:
        t, chunk = self._answer()
        self._inflight -= 1
        self._fail(TransferFailed(f"request {self.request_id!r} chunk {chunk.no} to "
                                  f"decode {t.rank}: submit refused: {why}"))
        return self._take()

    def written(self, endpoint: str, status: TransferStatus, in_band: bool,
                error: Exception | None, timed_out: bool, shared: int = 0) -> list[object]:
        """A write of ours ended (``error`` None: it completed); ``in_band``: the
        transport delivered ``status`` with it; ``timed_out``: cancelled, may still land;
        ``shared``: how many other chunks (of this or other requests) rode in the same
        batched write (:mod:`kvhandoff.session.control.write_batch`), named in a failure."""
        t = self.targets[endpoint]
        self._inflight -= 1
        self.poisoned |= timed_out
        if error is not None:
            if isinstance(error, RemoteOutOfBounds):
                self.events["refused_write"] += 1
            kind = PeerLost if isinstance(error, PeerLost) else TransferFailed
            self._emit(WriteFailed(endpoint))
            self._fail(kind(f"request {self.request_id!r} chunk {status.chunk} to decode "
                            f"{t.rank} ({endpoint}) failed: {error}{_batched(shared)}"))
        else:
            self._chunk_done(t, status, in_band)
        self._maybe_settled()
        return self._take()

    def refused(self, endpoint: str, status: TransferStatus, why: str,
                shared: int = 0) -> list[object]:
        """A write already answered ``submitted`` (the shell deferred it into a batch)
        was refused by the transport when the batch was submitted: as ``submit_refused``."""
        t = self.targets[endpoint]
        self._inflight -= 1
        self._fail(TransferFailed(f"request {self.request_id!r} chunk {status.chunk} to "
                                  f"decode {t.rank}: submit refused: {why}{_batched(shared)}"))
        self._maybe_settled()
        return self._take()

    # --- the rules (each appends effects) -------------------------------------------------

    def _accepts(self, r: RankId) -> bool:
        """Whether decode rank ``r`` belongs to this request's one decode deployment and
        is fed by this rank; fails the request when not."""
        dep = (r.instance, r.tp_size, r.pp_size)
        me = self.facts.layout
        if self._deployment is None:
            try:
                self._expected = frozenset(decode_candidates(
                    src_tp_rank=me.tp_rank, src_tp_size=me.tp_size, src_pp_rank=me.pp_rank,
                    src_pp_size=me.pp_size, dst_tp_size=r.tp_size, dst_pp_size=r.pp_size))
            except LayoutMismatch as e:
                self._fail(TransferFailed(f"decode {r}: {e}"))
                return False
            self._deployment = dep
        elif dep != self._deployment:
            self._fail(TransferFailed(
                f"indices from two decode deployments: {r} after one of instance "
                f"{self._deployment[0]!r} tp {self._deployment[1]} pp {self._deployment[2]}"))
            return False
        assert self._expected is not None
        if (r.tp_rank, r.pp_rank) not in self._expected:
            self._fail(TransferFailed(
                f"decode {r} sent indices but this rank (tp {me.tp_rank}, pp "
                f"{me.pp_rank}) does not feed it"))
            return False
        return True

    def _answer_late(self, endpoint: str) -> None:
        """Indices for a request that already ended here: say so, and that nothing is
        in flight to that rank (it was never written to)."""
        for msg in failed_answer(self.request_id, self.rank, self.reason or "failed",
                                 ack=True):
            self._emit(Post(endpoint, msg))

    def _maybe_bootstrapped(self) -> None:
        if (self.status is not Status.BOOTSTRAPPING or self.num_pages is None
                or self._expected is None or len(self.targets) < len(self._expected)):
            return
        prefixes = {t.init.decode_prefix_len for t in self.targets.values()}
        if len(prefixes) > 1:
            self._fail(TransferFailed(f"decode ranks disagree on the prefix length: "
                                      f"{sorted(prefixes)}"))
            return
        for t in self.targets.values():
            problem = self._make_cursor(t)
            if problem:
                self._fail(TransferFailed(f"request {self.request_id!r}, decode {t.rank}: "
                                          f"{problem}"))
                return
        self._fire(Event.BOOTSTRAPPED)
        queued, self._queued = self._queued, []
        self._pending.extend((t, c) for c in queued for t in self.targets.values())
        self._pump()

    def _make_cursor(self, t: _Target) -> str | None:
        name = self.facts.kv_name
        if name is None:
            if self.num_pages:
                return f"init announced {self.num_pages} KV pages but the layout has no KV"
            return None
        dst = t.init.indices.get(name)
        if dst is None:
            return None
        if dst.positions is not None:
            return f"decode sent positions for KV component {name!r}"
        assert self.num_pages is not None
        t.cursor = KvCursor(
            component=name, dst_items=dst.array(), dst_first_row=dst.first_row,
            src_page=self.facts.layout.page_size, dst_page=t.layout.page_size,
            prefix_len=t.init.decode_prefix_len, num_pages=self.num_pages,
            num_tokens=self._num_tokens,
            repageable=self.facts.kv_repageable and repageable(t.layout, name))
        return t.cursor.problem()

    def _pump(self) -> None:
        """Emit the next ``PlanChunk``, unless one is unanswered or the request ended."""
        while self._current is None and self._pending and not self.terminal:
            t, chunk = self._pending.popleft()
            try:
                req = self._request(t, chunk)
            except (HandoffError, ValueError) as e:
                self._fail(TransferFailed(f"request {self.request_id!r} chunk {chunk.no} for "
                                          f"decode {t.rank}: {e}"))
                return
            self._current = (t, chunk)
            self._emit(PlanChunk(t.endpoint, chunk.no, req, t.init.expect_checksum))

    def _answer(self) -> tuple[_Target, _Chunk]:
        if self._current is None:
            raise RuntimeError(f"request {self.request_id!r}: an answer with no question")
        current, self._current = self._current, None
        return current

    def _request(self, t: _Target, chunk: _Chunk) -> dict[str, Indices | None]:
        """The planner request of ``chunk`` for ``t``; ``ValueError`` when it cannot be."""
        kv = None if t.cursor is None else t.cursor.next(chunk.pages, chunk.last)
        return chunk_request(self.facts.layout, t.init.indices, kv=kv, kv_name=self.facts.kv_name,
                             aux_name=self.facts.aux_name, aux_src=self._aux_src,
                             state=chunk.state, last=chunk.last)

    def _chunk_done(self, t: _Target, status: TransferStatus, in_band: bool) -> None:
        """A chunk's writes to ``t`` completed; ``in_band``: its status already went."""
        if self.terminal:
            return
        t.done += 1
        self.nbytes += status.nbytes
        if status.last:
            t.last_done = True
            t.held_last = None if in_band else status
        elif not in_band:
            self._emit(Post(t.endpoint, status))
        if self.status is Status.WAITING_FOR_INPUT:
            self._fire(Event.CHUNK_DONE)
        if t.last_done and t.done == t.submitted and not t.finished:
            t.finished = True
            if t.held_last is not None:
                self._emit(Post(t.endpoint, t.held_last))
                t.held_last = None
        if self._last_given and not self._queued and not self._pending and all(
                x.finished for x in self.targets.values()):
            self._emit(Mark(tl.MOVED))
            self._emit(Mark(tl.WRITTEN))
            self._fire(Event.ALL_DONE)
            self._maybe_settled()

    def _fail(self, error: SessionError) -> None:
        if not self._mark_failed(error):
            return
        self._queued.clear()
        self._pending.clear()
        for t in self.targets.values():
            if not t.finished:
                t.finished = True
                for msg in failed_answer(self.request_id, self.rank, str(error), ack=False,
                                         chunk=max(t.submitted - 1, 0)):
                    self._emit(Post(t.endpoint, msg))
        self._maybe_settled()

    def _maybe_settled(self) -> None:
        if self.settled or not self.terminal or self._inflight:
            return
        self.settled = True
        self._emit(Mark(tl.SETTLED))
        if self.status is Status.FAILED and not self.poisoned:
            for t in self.targets.values():
                self._emit(Post(t.endpoint, AbortAck(request_id=self.request_id,
                                                     rank=self.rank)))
        self._emit(Settle())
