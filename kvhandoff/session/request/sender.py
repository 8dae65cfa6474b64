"""Prefill side of one request on one prefill rank.

Call order (the engine's thread)::

    s = Sender(agent, request_id, key=key)    # BOOTSTRAPPING: waits for decode's indices
    s.init(num_pages, aux_row)                # pages the request's KV will fill, from token 0
    s.send(pages_of_chunk_0)                  # chunked prefill: as KV is computed
    ...
    s.send(pages_of_last_chunk, state_indices={"mamba": [slot], ...}, last=True)
    while s.poll() not in (Status.SUCCESS, Status.FAILED): ...
    s.wait_settled(timeout)                   # before freeing the source pages

``key``: the request's :class:`~kvhandoff.binding.RequestKey`, which its decode got too
(the engine adapter makes it, see :mod:`kvhandoff.binding`): then only indices that prove
they come from the decode the request was routed to are taken, and any other claimant is
refused before a byte moves, whenever it comes. Without a key, the indices of the first
endpoint to send them for each decode rank are taken and a second endpoint fails the
request (:mod:`~kvhandoff.session.rank.claims`).

``send`` may be called before decode's indices arrive: chunks queue and go out once every
expected decode rank's ``TransferInit`` is in (``WAITING_FOR_INPUT``). The last chunk
carries every state component (``state_indices``: per component name, the source
items or ``None`` when it does not move) and the aux row; it may carry no pages (a full
decode-side prefix hit). KV pages below decode's prefix are dropped here: the engine
always hands pages from token 0.

**The lease** (``SessionConfig.lease``, 30 s): the last chunk starts it. A request
still bootstrapping when it runs out (no decode, or not every decode rank, sent its
indices: the client hung up between the prefill and the decode hop) fails with
:class:`~kvhandoff.errors.LeaseExpired`, logged once and counted
(``kvhandoff_leases_expired``), and settles. What an engine adapter does for it: hand
over the last chunk as soon as the request's prefill is done (not when decode asks),
keep polling, and free the request's memory once the Sender is final and
:attr:`settled`, whatever the outcome, as for every other failure.

Statuses: BOOTSTRAPPING → WAITING_FOR_INPUT (all decode indices in) → TRANSFERRING (a
chunk's writes completed) → SUCCESS (the last chunk's writes completed for every decode
rank); FAILED on a planning error, a transport failure, a timeout, a lost peer or an
abort, with :attr:`error` saying why. A decode rank that this rank does not write into
(another rank was elected for its bytes) still sends its indices, and is reported
success without a write.

Each chunk's status goes to decode over the control socket once its writes completed,
or, when both transports deliver notices (tcp), in band with the writes themselves
(:mod:`kvhandoff.session.rank.notices`): decode then hears of the chunk as soon as its bytes
landed, one control hop earlier. A write decided on the agent's control I/O thread
(queued chunks going out when decode's indices arrive) is batched with the other writes
of that burst to the same decode rank (:mod:`kvhandoff.session.control.write_batch`): one submit,
one notice, one completion fanned out to each request.

After a failure, every decode rank that sent indices is told (``TransferStatus`` FAILED)
and, once none of this request's writes is in flight any more, gets an ``AbortAck`` so it
may reuse its pages. A write that timed out was cancelled but may still land: then no
AbortAck is sent and decode waits out its release timeout.

Every decision above lives in :class:`~kvhandoff.session.request.send_core.SendCore` (sans I/O);
this class is its shell: it holds the lock, feeds the core events and carries out its
effects with the host (post, plan and digest, submit and track, stamp the aux guard).

Thread-safety: every method may be called from any thread; the agent's threads deliver
indices, completions and aborts concurrently (one lock per request).
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Mapping

from kvhandoff.binding import RequestKey
from kvhandoff.errors import HandoffError
from kvhandoff.observe import timeline as tl
from kvhandoff.plan import Plan, plan
from kvhandoff.plan.request import as_indices
from kvhandoff.protocol import PlannedIndicesMsg, RequestId, TransferInit, TransferStatus
from kvhandoff.session.control.write_batch import BatchedWrite
from kvhandoff.session.peers.decode_ranks import DecodePeer
from kvhandoff.session.request import aux
from kvhandoff.session.request.checksum import plan_digests
from kvhandoff.session.request.chunks import check_items, state_lists
from kvhandoff.session.request.host import PrefillHost
from kvhandoff.session.request.send_core import (
    PlanChunk,
    SendCore,
    Settle,
    StampGuard,
    Write,
    WriteFailed,
)
from kvhandoff.session.request.side import RequestSide
from kvhandoff.session.request.status import Latch, Status
from kvhandoff.transport.base import Handle
from kvhandoff.transport.errors import TransportError


class Sender(RequestSide):
    """See the module docstring."""

    _core: SendCore
    agent: PrefillHost

    def __init__(self, agent: PrefillHost, request_id: RequestId, *,
                 key: RequestKey | None = None) -> None:
        super().__init__(agent, request_id, "prefill")
        self.key = key  # read by the desk, without the lock: never changes
        self._core = SendCore(request_id=request_id, facts=agent, created=self._created)
        self._peers: dict[str, DecodePeer] = {}
        self._settled = Latch()
        self._landed: float | None = None  # the latest acknowledgement of our writes
        self._moved: float | None = None  # ... and the latest end of their bytes moving
        self._plans: list[Plan] = []  # every chunk's, for component_bytes
        inits, failed = agent.attach(self)
        with self._lock:
            if failed is not None:
                self._do(self._core.failed_before(failed))
            for peer, msg in inits:
                if isinstance(peer, str):  # buffered, then its rank was dropped: why
                    self._do(self._core.dropped_before(msg.rank, peer))
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
            return self._core.decode_prefix_len

    @property
    def settled(self) -> bool:
        """Terminal, and no write of this request reads source memory any more."""
        return self._settled.is_set()

    def wait_settled(self, timeout: float) -> bool:
        return self._settled.wait(timeout)

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
            self._do(self._core.init(num_pages, aux_row, num_tokens))

    def send(self, pages: object, state_indices: Mapping[str, object | None] | None = None, *,
             last: bool = False) -> None:
        """Hand over one chunk: its KV ``pages`` (prefill page ids, in sequence order) and,
        with the last chunk only, ``state_indices``: every state component's source items
        (an index array or a :class:`~kvhandoff.session.request.chunks.SourceList`) or None.

        Raises ``RuntimeError`` when called before ``init`` or after the last chunk, and
        ``ValueError`` for a malformed list; a failed request ignores further chunks."""
        arr = as_indices(pages, "KV pages")
        if self.agent.kv_name is not None:
            check_items(self.agent.layout, self.agent.kv_name, arr, "prefill")
        norm = state_lists(self.agent.layout, self.agent.state_names, state_indices, last)
        with self._lock:
            self._do(self._core.send(arr, norm, last, now=time.monotonic()))

    @property
    def peers(self) -> list[str]:
        return [f"{t.rank.instance}/tp{t.rank.tp_rank}"
                for t in list(self._core.targets.values())]

    def abort(self, reason: str = "aborted by the prefill engine") -> None:
        """Fail the request here and tell every decode rank; idempotent."""
        with self._lock:
            self._do(self._core.abort(reason))

    # --- from the agent and its desk (their threads; not for the engine) ----------------

    def on_init(self, peer: DecodePeer, msg: TransferInit) -> None:
        self.timeline.mark(tl.INDICES)
        with self._lock:
            effects = self._core.indices(peer.endpoint, peer.rank, peer.layout, msg)
            if peer.endpoint in self._core.targets:
                self._peers.setdefault(peer.endpoint, peer)
            self._do(effects)

    def on_init_refused(self, reason: str) -> None:
        """A decode rank's indices came, but the rank cannot be written (unreachable)."""
        with self._lock:
            self._do(self._core.init_refused(reason))

    def on_abort(self, endpoint: str | None, who: str, reason: str) -> None:
        with self._lock:
            self._do(self._core.decode_aborted(endpoint, who, reason))

    def on_tick(self, now: float) -> None:
        # every live request is ticked every few ms: one that has no timer due (nearly
        # all) is passed over without its lock (tick_due is safe without it)
        if not self._core.tick_due(now):
            return
        with self._lock:
            self._do(self._core.tick(now))

    def on_init_deferred(self, endpoint: str) -> None:
        """Indices came from ``endpoint``, unknown here (dropped, or restarted): it was
        asked to handshake again and resend them. Until it does, it is watched by
        heartbeat, so a decode that died meanwhile fails the request, not a timeout."""
        with self._lock:
            self._do(self._core.init_deferred(endpoint))

    def on_peer_lost(self, endpoint: str, reason: str) -> None:
        with self._lock:
            self._do(self._core.peer_lost(endpoint, reason))

    def on_agent_closed(self) -> None:
        with self._lock:
            self._do(self._core.agent_closed())

    @property
    def component_bytes(self) -> Mapping[str, int]:
        """Bytes planned per component, summed when asked (a trace writes them), not by
        every plan."""
        out: Counter[str] = Counter()
        with self._lock:
            for p in self._plans:
                out.update(p.by_component())
        return out

    def unsafe_endpoints(self) -> frozenset[str]:
        """Decode endpoints a cancelled write of ours may still reach."""
        with self._lock:
            return self._core.unsafe_endpoints()

    def peer_endpoints(self) -> set[str]:
        with self._lock:
            return self._core.peer_endpoints()

    # --- the core's effects (under the lock) ---------------------------------------------

    def _stamp(self, event: str) -> float | None:
        return {tl.WRITTEN: self._landed, tl.MOVED: self._moved}.get(event)

    def _carry_out(self, effect: object) -> list[object]:
        match effect:
            case PlanChunk():
                return self._plan(effect)
            case Write():
                return self._write(effect)
            case StampGuard(row=row):
                t = self.agent.aux_tensor
                view = None if t is None else self.agent.views.row(t, row)
                if view is not None:
                    aux.stamp(view, self.request_id)
            case WriteFailed(endpoint=endpoint):
                self.agent.write_failed(self._peers[endpoint])
            case Settle():
                self._settled.set()
                self.agent.finished(self)
            case _:
                return super()._carry_out(effect)
        return []

    def _plan(self, e: PlanChunk) -> list[object]:
        try:
            p = plan(self.agent.layout, self._peers[e.endpoint].layout, e.request)
        except (HandoffError, ValueError) as exc:
            return self._core.plan_failed(str(exc))
        sums, idx = None, None
        if e.checksums:
            sums = plan_digests(p, "src", self.agent.views)
            idx = {n: PlannedIndicesMsg.of(v) for n, v in e.request.items()
                   if v is not None and n in sums}
        self._plans.append(p)
        return self._core.planned(p.nbytes, sums, idx, p)

    def _write(self, e: Write) -> list[object]:
        peer = self._peers[e.endpoint]
        assert isinstance(e.payload, Plan)
        submitted = time.monotonic()
        if self.agent.defer_write(BatchedWrite(
                peer, e.payload, e.status,
                functools.partial(self._on_written, e.endpoint, e.status, submitted),
                functools.partial(self._on_batch_refused, e.endpoint, e.status))):
            return self._core.submitted()  # the I/O thread submits it with its burst
        notice = self.agent.notice(peer, e.status)  # the status rides in band, if it can
        try:
            handle = self.agent.transport.submit(peer.transport_peer, e.payload, notice=notice)
        except (TransportError, HandoffError, TypeError, ValueError) as exc:
            return self._core.submit_refused(f"{exc}")
        self.agent.track(handle, functools.partial(self._on_one_written, e.endpoint, e.status,
                                                   submitted, notice is not None))
        return self._core.submitted()

    # --- completions (a transport thread or the completion thread) -----------------------

    def _on_one_written(self, endpoint: str, status: TransferStatus, submitted: float,
                        in_band: bool, handle: Handle, err: TransportError | None,
                        timed_out: bool, blocking: bool) -> bool:
        """The completion callback of a write of ours alone (see :meth:`_on_written`)."""
        return self._on_written(endpoint, status, submitted, handle, in_band, err, timed_out,
                                blocking, 0)

    def _on_batch_refused(self, endpoint: str, status: TransferStatus, why: str,
                          shared: int) -> None:
        """The batch that carried our chunk was refused by the transport (the I/O thread,
        or the closing agent's)."""
        with self._lock:
            self._do(self._core.refused(endpoint, status, why, shared))

    def _on_written(self, endpoint: str, status: TransferStatus, submitted: float,
                    handle: Handle, in_band: bool, err: TransportError | None,
                    timed_out: bool, blocking: bool, shared: int) -> bool:
        """A write of ours ended (alone, or batched with ``shared`` other chunks: see
        :mod:`~kvhandoff.session.control.write_batch`). Called in the transport thread that
        completed it with ``blocking=False`` (declines, returning False, rather than wait
        for our lock: its holder may be in ``submit``, waiting on that thread), else in
        the completion thread. The timeline's WRITE is when the transport began moving the
        bytes of the first write (the submit, or for a batched one when the request
        handed it over, for a transport that does not say), its WRITTEN when the
        transport acknowledged the last (:meth:`_stamp`): noticing it later is ``settle``.
        MOVING and MOVED: the same, timed where the bytes moved, when the transport says
        (``Handle.moving`` / ``moved``)."""
        if not self._lock.acquire(blocking):
            return False
        try:
            if err is None:
                began = submitted if handle.started is None else handle.started
                self.timeline.mark_earliest(tl.WRITE, began)
                self.timeline.mark_earliest(tl.MOVING,
                                            began if handle.moving is None else handle.moving)
                if handle.finished is not None:
                    self._landed = max(self._landed or handle.finished, handle.finished)
                moved = handle.finished if handle.moved is None else handle.moved
                if moved is not None:
                    self._moved = max(self._moved or moved, moved)
            self._do(self._core.written(endpoint, status, in_band, err, timed_out, shared))
        finally:
            self._lock.release()
        return True
