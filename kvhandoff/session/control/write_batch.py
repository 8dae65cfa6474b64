"""Prefill's writes, batched per decode rank: one submit for the requests ready together.

Why: a burst of decode indices (many small requests at once) used to cost one transport
submit per request, each with its own in-band notice, its own completion and its own
handle. The control I/O thread handles the burst's messages one by one; every write
those requests produce on that thread is *deferred* (:meth:`WriteBatcher.defer`) and
submitted when the thread has handled every message that was ready
(:meth:`WriteBatcher.flush`, called by the channel after each read): per decode rank, the
plans merge into one (:func:`kvhandoff.plan.merge.merge`) and one notice carries every
status (``StatusNotice.more``). No timer and no added wait: a burst of one is submitted
at the end of handling that one message, as before.

Writes decided off the I/O thread (the engine's ``send`` once decode's indices are in, a
re-dial worker) are batched too, inside :meth:`WriteBatcher.held` on the thread that
decides them (``Agent.batched_writes()``: it counts per thread, nests, and holds no
other thread's writes):

* outside any ``held()`` block on its thread, ``defer`` refuses such a write and its
  request submits it at once, unbatched;
* inside one, it is held for that thread alone and submitted, batched with the thread's
  other held writes, when the outermost ``held()`` exits: never earlier, and never by
  another thread (the I/O thread's end of a burst submits only the writes the I/O thread
  deferred), so what an engine hands over together goes out together however long it
  takes and whatever the I/O thread does meanwhile.

Rules (pure, :func:`groups` and :func:`fit`):

* a batch goes to one decode rank (one :class:`~kvhandoff.session.peers.decode_ranks.DecodePeer`);
  writes keep their order; it holds at most one chunk of each request (the batch
  amortises across requests, where the per-write cost is; a request's chunks keep one
  write and one status each, as unbatched);
* a batch's plans total at most ``max_bytes``: a bigger write goes alone, so a batch
  never makes a big transfer wait for, or fail with, unrelated ones;
* its notice fits :data:`~kvhandoff.transport.base.MAX_NOTICE`; otherwise the batch is
  halved until each half's does (one status too big to be a notice goes over the
  control socket once written, as before).

Outcome, for every request in a batch alike: the batch's completion (or failure, or
timeout) is handed to each request's ``written`` (:class:`Fanout`); a submit the
transport refused is handed to each one's ``refused``. A request never learns more or
less than its own write would have told it, plus how many others shared the write.

Thread-safety: :meth:`WriteBatcher.defer` takes writes on the control I/O thread and on
a thread inside ``held()`` (it refuses any other, and every thread once closed);
:meth:`WriteBatcher.flush` runs on the I/O thread (after each burst), and a ``held()``
exit submits its own thread's writes; :meth:`WriteBatcher.close` from any thread once
the I/O thread stopped; it reports every write still waiting, whichever thread deferred
it, as refused.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvhandoff.errors import HandoffError
from kvhandoff.plan import Plan
from kvhandoff.plan.merge import merge
from kvhandoff.protocol import TransferStatus
from kvhandoff.session.control.completion import Callback
from kvhandoff.session.control.holding import Holding
from kvhandoff.session.peers.decode_ranks import DecodePeer
from kvhandoff.transport.base import Handle, Transport
from kvhandoff.transport.errors import TransportError

MAX_BATCH_BYTES = 16 << 20
"""A batch's plans total at most this; a bigger write is submitted alone."""

Written = Callable[[Handle, bool, "TransportError | None", bool, bool, int], bool]
"""``written(handle, in_band, error, timed_out, blocking, shared) -> ran``: the batch's
write ended (see :data:`kvhandoff.session.control.completion.Callback`; ``in_band``: the status
travelled in the batch's notice; ``shared``: how many other chunks rode in the write)."""

Refused = Callable[[str, int], None]
"""``refused(why, shared)``: the transport refused the batch's submit."""


@dataclass(frozen=True, slots=True)
class BatchedWrite:
    """One request's chunk write to ``peer``, waiting for the end of the burst."""

    peer: DecodePeer
    plan: Plan
    status: TransferStatus
    written: Written
    refused: Refused


def groups(writes: Sequence[BatchedWrite], max_bytes: int = MAX_BATCH_BYTES
           ) -> list[list[BatchedWrite]]:
    """``writes`` in batches, per decode rank (in first-seen order): each write joins the
    first batch with room (at most ``max_bytes`` of plans; a bigger write goes alone)
    that comes after its request's previous chunk, so a batch holds at most one chunk
    of each request and a request's chunks go out in order, each reported on its own."""
    by_peer: dict[int, list[list[BatchedWrite]]] = {}
    sizes: dict[int, list[int]] = {}
    after: dict[tuple[int, object], int] = {}  # first batch a request's next chunk may join
    for w in writes:
        key = id(w.peer)
        n = w.plan.nbytes
        batches = by_peer.setdefault(key, [])
        used = sizes.setdefault(key, [])
        first = after.get((key, w.status.request_id), 0)
        at = next((i for i in range(first, len(batches)) if used[i] + n <= max_bytes),
                  len(batches))
        if at == len(batches):
            batches.append([])
            used.append(0)
        batches[at].append(w)
        used[at] += n
        after[(key, w.status.request_id)] = at + 1
    return [b for batches in by_peer.values() for b in batches]


def fit(batch: list[BatchedWrite], notice: Callable[[list[TransferStatus]], bytes | None]
        ) -> list[tuple[list[BatchedWrite], bytes | None]]:
    """``batch`` in parts whose statuses fit one notice (``notice`` returns its bytes, or
    None when too big): halved until each part's does; a single write whose status
    does not fit keeps None (its status goes over the control socket)."""
    data = notice([w.status for w in batch])
    if data is not None or len(batch) == 1:
        return [(batch, data)]
    half = len(batch) // 2
    return fit(batch[:half], notice) + fit(batch[half:], notice)


class Fanout:
    """The completion callback of one batch's handle: hands the outcome to each write's
    ``written``. One that declines (``blocking=False`` and its request's lock is busy)
    is asked again on the blocking call; the others are not called twice."""

    __slots__ = ("_in_band", "_left", "_shared")

    def __init__(self, writes: Sequence[BatchedWrite], *, in_band: bool) -> None:
        self._left = [w.written for w in writes]
        self._in_band = in_band
        self._shared = len(writes) - 1

    def __call__(self, handle: Handle, error: TransportError | None, timed_out: bool,
                 blocking: bool) -> bool:
        left = [w for w in self._left
                if not w(handle, self._in_band, error, timed_out, blocking, self._shared)]
        self._left = left
        return not left


class WriteBatcher:
    """See the module docstring."""

    def __init__(self, *, transport: Transport, track: Callable[[Handle, Callback], None],
                 notice: Callable[[DecodePeer, list[TransferStatus]], bytes | None],
                 on_io_thread: Callable[[], bool], max_bytes: int = MAX_BATCH_BYTES) -> None:
        self._transport = transport
        self._track = track
        self._notice = notice
        self._on_io_thread = on_io_thread
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._waiting: list[BatchedWrite] = []  # the I/O thread's burst
        self._holding: dict[int, list[BatchedWrite]] = {}  # per thread inside held()
        self._closed = False
        self._held = Holding()

    def held(self) -> contextlib.AbstractContextManager[None]:
        """Within this context, writes decided on the calling thread are held and
        submitted, batched, when it exits (the outermost one, if nested); no other
        thread's flush takes them."""
        return self._held.block(self._release)

    def _release(self) -> None:
        with self._lock:
            mine = self._holding.pop(threading.get_ident(), [])
        self._submit_all(mine)

    def defer(self, write: BatchedWrite) -> bool:
        """Take ``write`` (True): into the calling thread's hold when it is inside
        :meth:`held`, else into the I/O thread's burst; or refuse (False: neither the
        I/O thread nor a thread inside :meth:`held`, or closed): the caller then submits
        it itself."""
        holding = self._held.active
        if not (holding or self._on_io_thread()):
            return False
        with self._lock:
            if self._closed:
                return False
            if holding:
                self._holding.setdefault(threading.get_ident(), []).append(write)
            else:
                self._waiting.append(write)
        return True

    def flush(self) -> None:
        """Submit the I/O thread's deferred writes, batched (at the end of its burst)."""
        if not self._waiting:  # the common case, every loop of the I/O thread: no lock
            return
        with self._lock:
            waiting, self._waiting = self._waiting, []
        self._submit_all(waiting)

    def _submit_all(self, waiting: list[BatchedWrite]) -> None:
        for batch in groups(waiting, self._max_bytes):
            peer = batch[0].peer
            for part, data in fit(batch, functools.partial(self._notice, peer)):
                self._submit(peer, part, data)

    def close(self) -> None:
        """No more batching; every write still waiting is reported refused."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            for held in self._holding.values():
                waiting += held
            self._holding.clear()
        for w in waiting:
            w.refused("the agent closed before the write was submitted", 0)

    def _submit(self, peer: DecodePeer, part: list[BatchedWrite], notice: bytes | None
                ) -> None:
        shared = len(part) - 1
        try:
            p = part[0].plan if not shared else merge([w.plan for w in part])
            handle = self._transport.submit(peer.transport_peer, p, notice=notice)
        except (TransportError, HandoffError, TypeError, ValueError) as exc:
            for w in part:
                w.refused(f"{exc}", shared)
            return
        self._track(handle, Fanout(part, in_band=notice is not None))
