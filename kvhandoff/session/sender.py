"""Prefill side of one request on one prefill rank.

Call order (the engine's thread)::

    s = Sender(agent, request_id)             # BOOTSTRAPPING: waits for decode's indices
    s.init(num_pages, aux_row)                # pages the request's KV will fill, from token 0
    s.send(pages_of_chunk_0)                  # chunked prefill: as KV is computed
    ...
    s.send(pages_of_last_chunk, state_indices={"mamba": [slot], ...}, last=True)
    while s.poll() not in (Status.SUCCESS, Status.FAILED): ...
    s.wait_settled(timeout)                   # before freeing the source pages

``send`` may be called before decode's indices arrive: chunks queue and go out once every
expected decode rank's ``TransferInit`` is in (``WAITING_FOR_INPUT``). The last chunk
carries every state component (``state_indices``: per component name, the source
items or ``None`` when it does not move) and the aux row; it may carry no pages (a full
decode-side prefix hit). KV pages below decode's prefix are dropped here: the engine
always hands pages from token 0.

Statuses: BOOTSTRAPPING → WAITING_FOR_INPUT (all decode indices in) → TRANSFERRING (a
chunk's writes completed) → SUCCESS (the last chunk's writes completed for every decode
rank); FAILED on a planning error, a transport failure, a timeout, a lost peer or an
abort, with :attr:`error` saying why. A decode rank that this rank does not write into
(another rank was elected for its bytes) still sends its indices, and is reported
success without a write.

Each chunk's status goes to decode over the control socket once its writes completed,
or, when both transports deliver notices (tcp), in band with the writes themselves
(:mod:`kvhandoff.session.notices`): decode then hears of the chunk as soon as its bytes
landed, one control hop earlier.

After a failure, every decode rank that sent indices is told (``TransferStatus`` FAILED)
and, once none of this request's writes is in flight any more, gets an ``AbortAck`` so it
may reuse its pages. A write that timed out was cancelled but may still land: then no
AbortAck is sent and decode waits out its release timeout.

Thread-safety: every method may be called from any thread; the agent's threads deliver
indices, completions and aborts concurrently (one lock per request).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvhandoff.errors import HandoffError, LayoutMismatch, RemoteOutOfBounds
from kvhandoff.observe import timeline as tl
from kvhandoff.plan import Indices, Plan, plan
from kvhandoff.plan.request import IndexArray, as_indices
from kvhandoff.protocol import (
    AbortAck,
    Outcome,
    PlannedIndicesMsg,
    RequestId,
    TransferInit,
    TransferStatus,
)
from kvhandoff.session import aux
from kvhandoff.session.checksum import plan_digests
from kvhandoff.session.chunks import KvCursor, check_items, source_indices
from kvhandoff.session.components import repageable
from kvhandoff.session.errors import (
    AgentClosed,
    PeerLost,
    RequestAborted,
    RequestTimeout,
    SessionError,
    TransferFailed,
)
from kvhandoff.session.host import RankHost
from kvhandoff.session.peers import DecodePeer
from kvhandoff.session.ranks import decode_candidates
from kvhandoff.session.request_side import RequestSide
from kvhandoff.session.status import Event, Status
from kvhandoff.transport.base import Handle
from kvhandoff.transport.errors import TransportError

log = logging.getLogger("kvhandoff.session.sender")


@dataclass(slots=True)
class _Chunk:
    no: int
    pages: IndexArray
    state: dict[str, tuple[IndexArray, int] | None] | None
    last: bool


@dataclass(slots=True)
class _Target:
    """One decode rank of the request."""

    peer: DecodePeer
    init: TransferInit
    cursor: KvCursor | None = None
    submitted: int = 0  # chunks submitted to it (empty plans included)
    done: int = 0  # chunks whose writes completed
    inflight: int = 0
    nbytes: int = 0
    last_chunk: int | None = None
    last_done: bool = False  # the last chunk's writes completed
    held_last: TransferStatus | None = None  # its status, sent once every chunk is done
    finished: bool = False  # its final status (success or failure) went out


@dataclass(slots=True)
class _Settle:
    inflight: int = 0
    poisoned: bool = False  # a cancelled write may still land: never AbortAck
    settled: bool = False
    event: threading.Event = field(default_factory=threading.Event)


class Sender(RequestSide):
    """See the module docstring."""

    def __init__(self, agent: RankHost, request_id: RequestId) -> None:
        super().__init__(agent, request_id, "prefill")
        self._num_pages: int | None = None
        self._num_tokens: int | None = None
        self._aux_row: int | None = None
        self._expected: frozenset[tuple[int, int]] | None = None
        self._deployment: tuple[str, int, int] | None = None  # decode instance, tp, pp sizes
        self._targets: dict[str, _Target] = {}
        self._queued: list[_Chunk] = []
        self._awaiting: set[str] = set()  # decode endpoints asked to handshake again
        self._chunks = 0
        self._last_given = False
        self._settle = _Settle()
        inits, failed = agent.attach(self)
        if failed is not None:
            self._fail(failed)
        for peer, msg in inits:
            if isinstance(peer, str):  # buffered, then its rank was dropped: why
                self._fail(PeerLost(f"request {request_id!r}: decode {msg.rank} sent its "
                                    f"indices, then was dropped before this Sender existed: "
                                    f"{peer}"))
            else:
                self.on_init(peer, msg)

    # --- the engine's calls (status, poll, wait, error, reason: RequestSide) -----------

    def wait_bootstrapped(self, timeout: float) -> Status:
        """Block until every decode rank's indices are in (WAITING_FOR_INPUT or later), or
        the request ended, or ``timeout`` seconds; returns the status then. From then on
        :attr:`decode_prefix_len` is known."""
        return self._sm.wait((Status.WAITING_FOR_INPUT, Status.TRANSFERRING), timeout)

    @property
    def decode_prefix_len(self) -> int | None:
        """Tokens decode already holds (known once its indices arrived)."""
        with self._lock:
            t = next(iter(self._targets.values()), None)
            return None if t is None else t.init.decode_prefix_len

    @property
    def settled(self) -> bool:
        """Terminal, and no write of this request reads source memory any more."""
        return self._settle.event.is_set()

    def wait_settled(self, timeout: float) -> bool:
        return self._settle.event.wait(timeout)

    def init(self, num_pages: int, aux_row: int | None = None, *,
             num_tokens: int | None = None) -> None:
        """Announce the request: ``num_pages`` KV pages from token 0 (prefix included),
        the prefill-side ``aux_row`` (required when the layout has an aux component), and
        ``num_tokens`` (required only when prefill and decode page sizes differ)."""
        if num_pages < 0 or (num_tokens is not None and num_tokens < 0):
            raise ValueError(f"num_pages and num_tokens must be >= 0, got {num_pages}, "
                             f"{num_tokens}")
        if (aux_row is None) != (self.agent.aux_tensor is None):
            raise ValueError("aux_row is required exactly when the layout has an aux component "
                             f"(it has {self.agent.aux_name!r})")
        if aux_row is not None and self.agent.aux_tensor is not None and not (
                0 <= aux_row < self.agent.aux_tensor.capacity):
            raise ValueError(f"aux_row {aux_row} is outside the aux tensor's "
                             f"{self.agent.aux_tensor.capacity} rows")
        with self._lock:
            if self._num_pages is not None:
                raise RuntimeError(f"Sender {self.request_id!r}: init() called twice")
            self._num_pages, self._aux_row, self._num_tokens = num_pages, aux_row, num_tokens
            self._maybe_bootstrapped()

    def send(self, pages: object, state_indices: Mapping[str, object | None] | None = None, *,
             last: bool = False) -> None:
        """Hand over one chunk: its KV ``pages`` (prefill page ids, in sequence order) and,
        with the last chunk only, ``state_indices``: every state component's source items
        (an index array or a :class:`~kvhandoff.session.chunks.SourceList`) or None.

        Raises ``RuntimeError`` when called before ``init`` or after the last chunk, and
        ``ValueError`` for a malformed list; a failed request ignores further chunks."""
        arr = as_indices(pages, "KV pages")
        if self.agent.kv_name is not None:
            check_items(self.agent.layout, self.agent.kv_name, arr, "prefill")
        norm = self._state(state_indices, last)
        with self._lock:
            if self._num_pages is None:
                raise RuntimeError(f"Sender {self.request_id!r}: send() before init()")
            if self._last_given:
                raise RuntimeError(f"Sender {self.request_id!r}: send() after the last chunk")
            chunk = _Chunk(self._chunks, arr, norm, last)
            self._chunks += 1
            self._last_given = last
            if self._sm.terminal:
                return
            if last and self._aux_row is not None:
                self._stamp_aux()
            if self._sm.state is Status.BOOTSTRAPPING:
                self._queued.append(chunk)
            else:
                self._submit(chunk)

    @property
    def peers(self) -> list[str]:
        return [f"{t.peer.rank.instance}/tp{t.peer.rank.tp_rank}"
                for t in list(self._targets.values())]

    def abort(self, reason: str = "aborted by the prefill engine") -> None:
        """Fail the request here and tell every decode rank; idempotent."""
        with self._lock:
            self._fail(RequestAborted(f"request {self.request_id!r}: {reason}"))

    def _state(self, state: Mapping[str, object | None] | None, last: bool
               ) -> dict[str, tuple[IndexArray, int] | None] | None:
        names = self.agent.state_names
        if not last:
            if state:
                raise ValueError("state components travel with the last chunk only")
            return None
        given = dict(state or {})
        unknown = set(given) - set(names)
        missing = set(names) - set(given)
        if unknown or missing:
            raise ValueError(f"the last chunk must name every state component exactly: "
                             f"unknown {sorted(unknown)}, missing {sorted(missing)} "
                             f"(use None for one that does not move)")
        out = {n: None if v is None else source_indices(v, f"state {n!r}")
               for n, v in given.items()}
        for n, v in out.items():
            if v is not None:
                check_items(self.agent.layout, n, v[0], "prefill")
        return out

    def _stamp_aux(self) -> None:
        t = self.agent.aux_tensor
        row = None if t is None or self._aux_row is None else \
            self.agent.views.row(t, self._aux_row)
        if row is not None:
            aux.stamp(row, self.request_id)

    # --- from the agent and its desk (their threads; not for the engine) ----------------

    def on_init(self, peer: DecodePeer, msg: TransferInit) -> None:
        self.timeline.mark(tl.INDICES)
        with self._lock:
            if self._sm.terminal:
                self._answer_late(peer, msg)
                return
            r = msg.rank
            dep = (r.instance, r.tp_size, r.pp_size)
            if self._deployment is None:
                me = self.agent.layout
                try:
                    self._expected = frozenset(decode_candidates(
                        src_tp_rank=me.tp_rank, src_tp_size=me.tp_size, src_pp_rank=me.pp_rank,
                        src_pp_size=me.pp_size, dst_tp_size=r.tp_size, dst_pp_size=r.pp_size))
                except LayoutMismatch as e:
                    self._fail(TransferFailed(f"decode {r}: {e}"))
                    return
                self._deployment = dep
            elif dep != self._deployment:
                self._fail(TransferFailed(
                    f"indices from two decode deployments: {r} after one of instance "
                    f"{self._deployment[0]!r} tp {self._deployment[1]} pp {self._deployment[2]}"))
                return
            assert self._expected is not None
            if (r.tp_rank, r.pp_rank) not in self._expected:
                self._fail(TransferFailed(
                    f"decode {r} sent indices but this rank (tp {self.agent.layout.tp_rank}, pp "
                    f"{self.agent.layout.pp_rank}) does not feed it"))
                return
            if any(t.init.rank.tp_rank == r.tp_rank and t.init.rank.pp_rank == r.pp_rank
                   for t in self._targets.values()):
                log.warning("duplicate TransferInit for %r from %s ignored", self.request_id, r)
                return
            self._targets[peer.endpoint] = _Target(peer, msg)
            self._awaiting.discard(peer.endpoint)
            self._maybe_bootstrapped()

    def on_init_refused(self, reason: str) -> None:
        """A decode rank's indices came, but the rank cannot be written (unreachable)."""
        with self._lock:
            self._fail(PeerLost(reason))

    def _answer_late(self, peer: DecodePeer, msg: TransferInit) -> None:
        """Indices for a request that already failed here: say so, and that nothing
        is in flight to that rank (it was never written to)."""
        reason = self._sm.reason or "failed"
        self.agent.post(peer.endpoint, TransferStatus(
            request_id=self.request_id, rank=self.agent.rank_id, chunk=0, last=True,
            outcome=Outcome.FAILED, reason=reason))
        self.agent.post(peer.endpoint, AbortAck(request_id=self.request_id,
                                                rank=self.agent.rank_id))

    def on_abort(self, endpoint: str | None, who: str, reason: str) -> None:
        with self._lock:
            was_settled = self._settle.settled
            self._fail(RequestAborted(f"request {self.request_id!r} aborted by decode {who}: "
                                      f"{reason}"))
            if endpoint is not None and endpoint not in self._targets:
                # never wrote to it: nothing is in flight there
                self.agent.post(endpoint, AbortAck(request_id=self.request_id,
                                                   rank=self.agent.rank_id))
            elif endpoint is not None and was_settled and not self._settle.poisoned:
                self.agent.post(endpoint, AbortAck(request_id=self.request_id,
                                                   rank=self.agent.rank_id))

    def on_tick(self, now: float) -> None:
        with self._lock:
            if self._sm.state is Status.BOOTSTRAPPING and \
                    now - self._created > self.agent.config.indices_timeout:
                got = len(self._targets)
                want = "?" if self._expected is None else str(len(self._expected))
                self._fail(RequestTimeout(
                    f"request {self.request_id!r}: waited {self.agent.config.indices_timeout:g} s "
                    f"(indices_timeout) for decode's indices; got {got} of {want} TransferInits"
                    + ("" if self._num_pages is not None else "; init() was never called")))

    def on_init_deferred(self, endpoint: str) -> None:
        """Indices came from ``endpoint``, unknown here (dropped, or restarted): it was
        asked to handshake again and resend them. Until it does, it is watched by
        heartbeat, so a decode that died meanwhile fails the request, not a timeout."""
        with self._lock:
            if not self._sm.terminal and endpoint not in self._targets:
                self._awaiting.add(endpoint)

    def on_peer_lost(self, endpoint: str, reason: str) -> None:
        with self._lock:
            if self._sm.terminal:
                return
            t = self._targets.get(endpoint)
            if t is not None:
                self._fail(PeerLost(f"request {self.request_id!r}: decode {t.peer.rank}: "
                                    f"{reason}"))
            elif endpoint in self._awaiting:
                self._fail(PeerLost(f"request {self.request_id!r}: decode {endpoint}, asked "
                                    f"to handshake again and resend its indices: {reason}"))

    def on_agent_closed(self) -> None:
        with self._lock:
            self._fail(AgentClosed(f"request {self.request_id!r}: the prefill agent closed"))

    def unsafe_endpoints(self) -> frozenset[str]:
        """Decode endpoints a cancelled write of ours may still reach."""
        with self._lock:
            return frozenset(self._targets) if self._settle.poisoned else frozenset()

    def peer_endpoints(self) -> set[str]:
        with self._lock:
            if self._settle.settled:
                return set()
            return set(self._targets) | (set() if self._sm.terminal else self._awaiting)

    # --- bootstrapping and submission (under the lock) -------------------------------------

    def _maybe_bootstrapped(self) -> None:
        if (self._sm.state is not Status.BOOTSTRAPPING or self._num_pages is None
                or self._expected is None or len(self._targets) < len(self._expected)):
            return
        prefixes = {t.init.decode_prefix_len for t in self._targets.values()}
        if len(prefixes) > 1:
            self._fail(TransferFailed(f"decode ranks disagree on the prefix length: "
                                      f"{sorted(prefixes)}"))
            return
        for t in self._targets.values():
            problem = self._make_cursor(t)
            if problem:
                self._fail(TransferFailed(f"request {self.request_id!r}, decode {t.peer.rank}: "
                                          f"{problem}"))
                return
        self._sm.fire(Event.BOOTSTRAPPED)
        queued, self._queued = self._queued, []
        for c in queued:
            if self._sm.terminal:
                break
            self._submit(c)

    def _make_cursor(self, t: _Target) -> str | None:
        name = self.agent.kv_name
        if name is None:
            if self._num_pages:
                return f"init announced {self._num_pages} KV pages but the layout has no KV"
            return None
        dst = t.init.indices.get(name)
        if dst is None:
            return None
        if dst.positions is not None:
            return f"decode sent positions for KV component {name!r}"
        me, peer = self.agent.layout, t.peer.layout
        assert self._num_pages is not None
        t.cursor = KvCursor(
            component=name, dst_items=dst.array(), dst_first_row=dst.first_row,
            src_page=me.page_size, dst_page=peer.page_size, prefix_len=t.init.decode_prefix_len,
            num_pages=self._num_pages, num_tokens=self._num_tokens,
            repageable=self.agent.kv_repageable and repageable(peer, name))
        return t.cursor.problem()

    def _request(self, t: _Target, chunk: _Chunk) -> dict[str, Indices | None]:
        req: dict[str, Indices | None] = {}
        init = t.init.indices
        for c in self.agent.layout.components:
            dst = init.get(c.name)
            if c.name == self.agent.kv_name:
                if t.cursor is not None:
                    req[c.name] = t.cursor.next(chunk.pages, chunk.last)
                elif dst is None:
                    req[c.name] = None
                    continue
            elif c.name == self.agent.aux_name:
                req[c.name] = None if (dst is None or not chunk.last) else \
                    Indices([self._aux_row], dst.array())
            elif not chunk.last:
                req[c.name] = None
            else:
                assert chunk.state is not None
                src = chunk.state.get(c.name)
                if (src is None) != (dst is None):
                    have = "no list" if src is None else f"{len(src[0])} items"
                    want = "no list" if dst is None else f"{dst.num_items} items"
                    raise ValueError(f"component {c.name!r}: prefill sends {have}, decode "
                                     f"expects {want}; both sides must agree whether it moves")
                req[c.name] = None if src is None or dst is None else Indices(
                    src[0], dst.array(), src_first_row=src[1], dst_first_row=dst.first_row,
                    num_rows=dst.num_rows, positions=dst.positions_array())
        return req

    def _submit(self, chunk: _Chunk) -> None:
        for t in self._targets.values():
            if self._sm.terminal:  # a write to another rank failed at once
                return
            try:
                req = self._request(t, chunk)
                p = plan(self.agent.layout, t.peer.layout, req)
                self.component_bytes.update(p.by_component())
            except (HandoffError, ValueError) as e:
                self._fail(TransferFailed(f"request {self.request_id!r} chunk {chunk.no} for "
                                          f"decode {t.peer.rank}: {e}"))
                return
            sums, idx = None, None
            if t.init.expect_checksum:
                sums = plan_digests(p, "src", self.agent.views)
                idx = {n: PlannedIndicesMsg.of(v) for n, v in req.items()
                       if v is not None and n in sums}
            t.submitted += 1
            if chunk.last:
                t.last_chunk = chunk.no
            nbytes = p.nbytes  # the planner's entries carry their bytes per unit
            status = TransferStatus(
                request_id=self.request_id, rank=self.agent.rank_id, chunk=chunk.no,
                last=chunk.last, outcome=Outcome.SUCCESS, nbytes=nbytes, checksums=sums,
                indices=idx)
            if not nbytes:
                self._chunk_done(t, status)
                continue
            if not self._write(t, p, status):
                return

    def _write(self, t: _Target, p: Plan, status: TransferStatus) -> bool:
        notice = self.agent.notice(t.peer, status)  # the status rides in band, if it can
        try:
            self.timeline.mark(tl.WRITE)
            handle = self.agent.transport.submit(t.peer.transport_peer, p, notice=notice)
        except (TransportError, HandoffError, TypeError, ValueError) as e:
            self._fail(TransferFailed(f"request {self.request_id!r} chunk {status.chunk} to "
                                      f"decode {t.peer.rank}: submit refused: {e}"))
            return False
        t.inflight += 1
        self._settle.inflight += 1
        self.agent.track(handle, functools.partial(self._on_written, t, status,
                                                   notice is not None))
        return True

    # --- completions (completion thread) ---------------------------------------------------

    def _on_written(self, t: _Target, status: TransferStatus, in_band: bool, handle: Handle,
                    err: TransportError | None, timed_out: bool, blocking: bool) -> bool:
        """A write of ours ended. Called in the transport thread that completed it with
        ``blocking=False`` (declines, returning False, rather than wait for our lock: its
        holder may be in ``submit``, waiting on that thread), else in the completion
        thread."""
        del handle
        if not self._lock.acquire(blocking):
            return False
        try:
            self._written(t, status, in_band, err, timed_out)
        finally:
            self._lock.release()
        return True

    def _written(self, t: _Target, status: TransferStatus, in_band: bool,
                 err: TransportError | None, timed_out: bool) -> None:
        t.inflight -= 1
        self._settle.inflight -= 1
        self._settle.poisoned |= timed_out
        if err is not None:
            if isinstance(err, RemoteOutOfBounds):
                self.events["refused_write"] += 1
            kind = PeerLost if isinstance(err, PeerLost) else TransferFailed
            self.agent.write_failed(t.peer)
            self._fail(kind(f"request {self.request_id!r} chunk {status.chunk} to decode "
                            f"{t.peer.rank} ({t.peer.endpoint}) failed: {err}"))
        else:
            self._chunk_done(t, status, in_band)
        self._maybe_settled()

    def _chunk_done(self, t: _Target, status: TransferStatus, in_band: bool = False) -> None:
        """A chunk's writes to ``t`` completed; ``in_band``: the transport already
        delivered its status. Over the control socket, the last status waits until
        every chunk is done, so decode never hears "last" before an earlier chunk."""
        if self._sm.terminal:
            return
        t.done += 1
        t.nbytes += status.nbytes
        self.nbytes += status.nbytes
        if status.last:
            t.last_done = True
            t.held_last = None if in_band else status
        elif not in_band:
            self.agent.post(t.peer.endpoint, status)
        if self._sm.state is Status.WAITING_FOR_INPUT:
            self._sm.fire(Event.CHUNK_DONE)
        if t.last_done and t.done == t.submitted and not t.finished:
            t.finished = True
            if t.held_last is not None:
                self.agent.post(t.peer.endpoint, t.held_last)
                t.held_last = None
        if self._last_given and not self._queued and all(
                x.finished for x in self._targets.values()):
            self.timeline.mark(tl.WRITTEN)
            self._sm.fire(Event.ALL_DONE)
            self._maybe_settled()

    # --- failure and settling (under the lock) ---------------------------------------------

    def _fail(self, error: SessionError) -> None:
        if not self._mark_failed(error):
            return
        self._queued.clear()
        for t in self._targets.values():
            if not t.finished:
                t.finished = True
                self.agent.post(t.peer.endpoint, TransferStatus(
                    request_id=self.request_id, rank=self.agent.rank_id,
                    chunk=max(t.submitted - 1, 0), last=True, outcome=Outcome.FAILED,
                    reason=str(error)))
        self._maybe_settled()

    def _maybe_settled(self) -> None:
        s = self._settle
        if s.settled or not self._sm.terminal or s.inflight:
            return
        s.settled = True
        self.timeline.mark(tl.SETTLED)
        if self._sm.state is Status.FAILED and not s.poisoned:
            for t in self._targets.values():
                self.agent.post(t.peer.endpoint, AbortAck(request_id=self.request_id,
                                                          rank=self.agent.rank_id))
        s.event.set()
        self.agent.finished(self)
