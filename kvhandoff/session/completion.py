"""Waiting for transport handles: one thread per agent turns finished transfers into
callbacks.

The transport contract offers ``poll`` / ``wait`` (engines that need the caller to drive
progress do it there) and no completion callback, so one thread waits on the oldest
pending handle for a short slice (0.5 ms, doubling to 4 ms while nothing finishes), then
polls the rest. Idle, it sleeps on a condition variable (no CPU). A handle pending
longer than ``timeout`` is released (cancelled) and reported as timed out: bytes of a
cancelled transfer may still land, so the callback is told (``timed_out=True``) and the
request must not promise its peer "no write in flight".

Thread-safety: :meth:`track` and :meth:`close` from any thread; callbacks run on the
completion thread, one at a time, and must not block for long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvhandoff.transport.base import Handle, TransferState, Transport
from kvhandoff.transport.errors import TransportClosed, TransportError

log = logging.getLogger("kvhandoff.session.completion")

Callback = Callable[[Handle, "TransportError | None", bool], None]
"""``callback(handle, error, timed_out)``: error is None when the transfer is DONE."""

_SLICE_S = 0.0005  # wait on the oldest handle this long before polling the others...
_MAX_SLICE_S = 0.004  # ...doubling while nothing finishes, up to this
_JOIN_S = 5.0


@dataclass(slots=True)
class _Item:
    handle: Handle
    callback: Callback
    deadline: float


class Completions:
    """See the module docstring."""

    def __init__(self, transport: Transport, *, timeout: float, name: str = "agent") -> None:
        self._transport = transport
        self._timeout = timeout
        self._cond = threading.Condition()
        self._pending: list[_Item] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"kvh-done-{name}", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def track(self, handle: Handle, callback: Callback) -> None:
        """Call ``callback`` once ``handle`` is final (or timed out, or the tracker closed)."""
        with self._cond:
            if self._stop:
                stopped = True
            else:
                stopped = False
                self._pending.append(_Item(handle, callback, time.monotonic() + self._timeout))
                self._cond.notify()
        if stopped:
            handle.release()
            self._call(_Item(handle, callback, 0.0),
                       TransportClosed("the agent is closing; transfer cancelled"), True)

    def close(self) -> None:
        """Stop the thread; still-pending handles are released and reported as timed out
        (their bytes may still land). Idempotent."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(_JOIN_S)
        with self._cond:
            left, self._pending = self._pending, []
        for item in left:
            item.handle.release()
            self._call(item, TransportClosed("the agent closed with this transfer pending"), True)

    def _run(self) -> None:
        slice_s = _SLICE_S
        while True:
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                batch = list(self._pending)
            try:
                # The head's own completion wakes this wait at once; the slice only bounds
                # how late an out-of-order completion is noticed. It grows while nothing
                # finishes: waking every 0.5 ms through a long transfer would steal the GIL
                # from the transport's own threads.
                self._transport.wait(batch[0].handle, slice_s)
            except TransportError as e:  # an engine that raises from wait: fail that one
                batch[0].handle.set_failed(e)
            now = time.monotonic()
            done: list[tuple[_Item, TransportError | None, bool]] = []
            for item in batch:
                state = self._state(item.handle)
                if state is TransferState.DONE:
                    done.append((item, None, False))
                elif state is TransferState.FAILED:
                    done.append((item, item.handle.error, False))
                elif now > item.deadline:
                    item.handle.release()
                    done.append((item, TransportError(
                        f"transfer to {item.handle.peer or 'peer'} still pending after "
                        f"{self._timeout:g} s (transfer_timeout); cancelled"), True))
            slice_s = _SLICE_S if done else min(2 * slice_s, _MAX_SLICE_S)
            if done:
                finished = {id(item) for item, _, _ in done}
                with self._cond:
                    self._pending = [i for i in self._pending if id(i) not in finished]
                for item, err, timed_out in done:
                    self._call(item, err, timed_out)

    def _state(self, handle: Handle) -> TransferState:
        try:
            return self._transport.poll(handle)
        except TransportError as e:
            handle.set_failed(e)
            return TransferState.FAILED

    @staticmethod
    def _call(item: _Item, err: TransportError | None, timed_out: bool) -> None:
        try:
            item.callback(item.handle, err, timed_out)
        except Exception:  # a request's bug must not stop every other request's completions
            log.exception("completion callback failed")
        finally:
            item.handle.release()
