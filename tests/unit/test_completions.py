"""The session's completion tracker: done-callbacks, polling only for transports that
need it, deadlines, declined callbacks, close."""

from __future__ import annotations

import threading
from typing import cast

from kvhandoff.session.control.completion import Completions
from kvhandoff.transport.base import Capabilities, Handle, TransferState, Transport
from kvhandoff.transport.errors import TransportClosed, TransportError

BOUND = 10.0  # generous: only detects a hang


class FakeTransport:
    """Just what Completions uses: capabilities and poll."""

    def __init__(self, *, self_completing: bool, polls_to_finish: int = 3) -> None:
        self.capabilities = Capabilities(self_completing=self_completing)
        self.polls = 0
        self.polls_to_finish = polls_to_finish

    def poll(self, handle: Handle) -> TransferState:
        self.polls += 1
        if self.polls >= self.polls_to_finish:
            handle.set_done()
        return handle.state


class Calls:
    def __init__(self, decline_first: bool = False) -> None:
        self.calls: list[tuple[TransportError | None, bool, bool, str]] = []
        self.decline_first = decline_first
        self.event = threading.Event()

    def __call__(self, handle: Handle, err: TransportError | None, timed_out: bool,
                 blocking: bool) -> bool:
        if self.decline_first and not blocking and not self.calls:
            self.calls.append((err, timed_out, blocking, "declined"))
            return False
        self.calls.append((err, timed_out, blocking, threading.current_thread().name))
        self.event.set()
        return True


def _tracker(t: FakeTransport, timeout: float = 60.0) -> Completions:
    return Completions(cast(Transport, t), timeout=timeout, name="test")


def test_a_polling_transport_is_driven_by_polls() -> None:
    t = FakeTransport(self_completing=False)
    c = _tracker(t)
    try:
        h = Handle(nbytes=1)
        calls = Calls()
        c.track(h, calls)
        assert calls.event.wait(BOUND)
        assert t.polls >= 3
        assert calls.calls[0][:2] == (None, False)  # done, not timed out
        assert c.pending == 0
    finally:
        c.close()


def test_a_self_completing_transport_is_never_polled() -> None:
    t = FakeTransport(self_completing=True)
    c = _tracker(t)
    try:
        h = Handle(nbytes=1)
        calls = Calls()
        c.track(h, calls)
        threading.Timer(0.05, h.set_done).start()
        assert calls.event.wait(BOUND)
        err, timed_out, blocking, thread = calls.calls[0]
        assert (err, timed_out, blocking) == (None, False, False)  # inline, in the completer
        assert thread != "kvh-done-test"
        assert c.pending == 0
        assert t.polls == 0, "a self-completing transport was polled"
    finally:
        c.close()


def test_a_declined_callback_runs_again_from_the_completion_thread() -> None:
    c = _tracker(FakeTransport(self_completing=True))
    try:
        h = Handle(nbytes=1)
        calls = Calls(decline_first=True)
        c.track(h, calls)
        h.set_done()
        assert calls.event.wait(BOUND)
        assert [x[2:] for x in calls.calls] == [(False, "declined"), (True, "kvh-done-test")]
    finally:
        c.close()


def test_a_handle_that_never_finishes_times_out_and_is_cancelled() -> None:
    c = _tracker(FakeTransport(self_completing=True), timeout=0.2)
    try:
        h = Handle(nbytes=1)
        calls = Calls()
        c.track(h, calls)
        assert calls.event.wait(BOUND)
        err, timed_out, _, _ = calls.calls[0]
        assert timed_out and err is not None and "transfer_timeout" in str(err)
        assert h.state is TransferState.FAILED  # released: cancelled
    finally:
        c.close()


def test_deadlines_hold_for_handles_tracked_while_the_thread_sleeps() -> None:
    c = _tracker(FakeTransport(self_completing=True), timeout=0.3)
    try:
        first, second = Handle(nbytes=1), Handle(nbytes=1)
        a, b = Calls(), Calls()
        c.track(first, a)
        threading.Event().wait(0.1)
        c.track(second, b)
        assert a.event.wait(BOUND) and b.event.wait(BOUND)
        assert a.calls[0][1] and b.calls[0][1]
    finally:
        c.close()


def test_close_reports_every_pending_handle() -> None:
    c = _tracker(FakeTransport(self_completing=True))
    handles = [Handle(nbytes=1) for _ in range(3)]
    calls = [Calls() for _ in handles]
    for h, k in zip(handles, calls, strict=True):
        c.track(h, k)
    c.close()
    for k in calls:
        assert k.event.wait(BOUND)
        err, timed_out, _, _ = k.calls[0]
        assert timed_out and isinstance(err, TransportClosed)
    assert c.pending == 0


def test_tracking_after_close_reports_at_once() -> None:
    c = _tracker(FakeTransport(self_completing=True))
    c.close()
    h = Handle(nbytes=1)
    k = Calls()
    c.track(h, k)
    assert k.event.is_set() and isinstance(k.calls[0][0], TransportClosed)
