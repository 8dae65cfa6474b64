"""Waiting for transport handles: finished transfers become callbacks.

Each tracked handle gets ``handle.add_done_callback``: the request's callback runs in
the thread that completed the transfer (a transport thread), at once, with no thread
hop — the status message leaves from there. It runs there only if it can without
blocking (``blocking=False``: a request whose lock is held elsewhere returns False) —
a transport thread must never wait on a request lock, whose holder may be inside
``submit`` waiting on that very thread — and is otherwise handed to the completion
thread, which calls it again with ``blocking=True``. That one thread per agent also
serves what a callback cannot do: deadlines, and transports that make progress only
when the caller polls (the contract allows it). For those it polls the pending handles
every slice (0.5 ms, doubling to 4 ms while nothing finishes). A transport whose
capabilities say ``self_completing`` (every built-in one) is never polled: the thread
sleeps until a declined callback or the earliest deadline, so it does not compete with
the transport's own threads right after a submit. Idle, it sleeps on a condition
variable (no CPU). A handle pending longer than ``timeout`` is released (cancelled) and reported as
timed out: bytes of a cancelled transfer may still land, so the callback is told
(``timed_out=True``) and the request must not promise its peer "no write in flight".

Exactly once: whichever path claims an item first (done-callback, poll, deadline,
close) reports it; the others find it gone.

Thread-safety: :meth:`track` and :meth:`close` from any thread; callbacks run in a
transport thread, the completion thread or (for a handle already final) the caller of
:meth:`track`, and must not block for long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvhandoff.transport.base import Handle, TransferState, Transport
from kvhandoff.transport.errors import TransportClosed, TransportError

log = logging.getLogger("kvhandoff.session.control.completion")

Callback = Callable[[Handle, "TransportError | None", bool, bool], bool]
"""``callback(handle, error, timed_out, blocking) -> ran``: error is None when the transfer
is DONE. With ``blocking=False`` it may decline (return False) rather than wait for a
lock; it is then called again, from the completion thread, with ``blocking=True`` (and
must run then)."""

_SLICE_S = 0.0005  # poll the pending handles this often...
_MAX_SLICE_S = 0.004  # ...doubling while nothing finishes, up to this
_JOIN_S = 5.0
_MAX_SLEEP_S = 3600.0  # bounds a wait even for an infinite timeout (threading refuses inf)


@dataclass(eq=False, slots=True)
class _Item:
    handle: Handle
    callback: Callback
    deadline: float


class Completions:
    """See the module docstring."""

    def __init__(self, transport: Transport, *, timeout: float, name: str = "agent") -> None:
        self._transport = transport
        self._poll = not transport.capabilities.self_completing
        self._timeout = timeout
        self._cond = threading.Condition()
        self._pending: dict[int, _Item] = {}  # id(item) -> item, in tracking order
        self._deferred: list[tuple[_Item, TransportError | None]] = []  # declined inline
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"kvh-done-{name}", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def track(self, handle: Handle, callback: Callback) -> None:
        """Call ``callback`` once ``handle`` is final (or timed out, or the tracker closed)."""
        item = _Item(handle, callback, time.monotonic() + self._timeout)
        with self._cond:
            stopped = self._stop
            if not stopped:
                first = not self._pending
                self._pending[id(item)] = item
                if first and self._poll:  # else the thread's next wake-up is soon enough
                    self._cond.notify()
        if stopped:
            handle.release()
            self._call(item, TransportClosed("the agent is closing; transfer cancelled"), True)
            return
        handle.add_done_callback(lambda h: self._finished(item))

    def close(self) -> None:
        """Stop the thread; still-pending handles are released and reported as timed out
        (their bytes may still land). Idempotent."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(_JOIN_S)
        with self._cond:
            left = list(self._pending.values())
            self._pending.clear()
            deferred, self._deferred = self._deferred, []
        for item, err in deferred:
            self._call(item, err, False)
        for item in left:
            item.handle.release()
            self._call(item, TransportClosed("the agent closed with this transfer pending"), True)

    def _claim(self, item: _Item) -> bool:
        with self._cond:
            return self._pending.pop(id(item), None) is not None

    def _finished(self, item: _Item) -> None:
        """The handle's done-callback (any thread): report it unless already reported,
        here if that needs no waiting, else from the completion thread."""
        if not self._claim(item):
            return
        state = item.handle.state
        err = None if state is TransferState.DONE else \
            item.handle.error or TransportError("transfer failed")
        if not self._call(item, err, False, blocking=False):
            with self._cond:
                self._deferred.append((item, err))
                self._cond.notify()

    def _run(self) -> None:
        slice_s = _SLICE_S
        while True:
            with self._cond:
                if self._poll:
                    self._cond.wait_for(
                        lambda: bool(self._pending or self._deferred or self._stop))
                if not self._deferred:  # done-callbacks report what completes meanwhile
                    self._cond.wait_for(lambda: self._stop or bool(self._deferred),
                                        slice_s if self._poll else self._until_deadline())
                if self._stopping():
                    return
                deferred, self._deferred = self._deferred, []
                batch = list(self._pending.values())
            for item, err in deferred:
                self._call(item, err, False)
            now = time.monotonic()
            done: list[tuple[_Item, TransportError | None, bool]] = []
            for item in batch:
                # polling drives transports that progress only in poll; the others
                # finish their handles themselves and only deadlines are checked
                state = self._state(item.handle) if self._poll else TransferState.PENDING
                if state is TransferState.DONE:
                    done.append((item, None, False))
                elif state is TransferState.FAILED:
                    done.append((item, item.handle.error, False))
                elif now > item.deadline:
                    done.append((item, TransportError(
                        f"transfer to {item.handle.peer or 'peer'} still pending after "
                        f"{self._timeout:g} s (transfer_timeout); cancelled"), True))
            slice_s = _SLICE_S if done else min(2 * slice_s, _MAX_SLICE_S)
            for item, err, timed_out in done:
                if self._claim(item):
                    if timed_out:
                        item.handle.release()
                    self._call(item, err, timed_out)

    def _until_deadline(self) -> float:
        """Seconds until the earliest pending deadline (the oldest item: every item gets
        the same timeout), or a full timeout when none is pending (caller holds the
        condition). A handle tracked meanwhile has a later deadline than this wake-up."""
        first = next(iter(self._pending.values()), None)
        left = self._timeout if first is None else first.deadline - time.monotonic()
        return min(max(0.0, left), _MAX_SLEEP_S)

    def _stopping(self) -> bool:
        return self._stop

    def _state(self, handle: Handle) -> TransferState:
        try:
            return self._transport.poll(handle)
        except TransportError as e:
            handle.set_failed(e)
            return TransferState.FAILED

    @staticmethod
    def _call(item: _Item, err: TransportError | None, timed_out: bool, *,
              blocking: bool = True) -> bool:
        """Run the callback; False when it declined (only with ``blocking=False``)."""
        try:
            ran = item.callback(item.handle, err, timed_out, blocking)
        except Exception:  # a request's bug must not stop every other request's completions
            log.exception("completion callback failed")
            ran = True
        if ran or blocking:
            item.handle.release()
            return True
        return False
