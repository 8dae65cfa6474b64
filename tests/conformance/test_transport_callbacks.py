"""Done-callbacks on handles: ``handle.add_done_callback(fn)`` runs ``fn(handle)`` exactly
once, when the handle is final, without anyone calling ``wait``/``poll``."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
from kvh_conformance import Pair, RemotePeer, make

from kvhandoff.transport import (
    Handle,
    PeerLost,
    RemoteOutOfBounds,
    TransferCancelled,
    TransferState,
    TransportClosed,
    transport_class,
)

TIMEOUT = 60.0


class Recorder:
    """Collects callback calls: (handle, its state then, the calling thread)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Handle, TransferState, threading.Thread]] = []
        self.event = threading.Event()

    def __call__(self, h: Handle) -> None:
        self.calls.append((h, h.state, threading.current_thread()))
        self.event.set()


def test_callback_fires_once_on_done_without_waiting(pair: Pair) -> None:
    """Nobody waits or polls: the transport's own threads complete the handle and call
    back (engines included: their progress thread drives them)."""
    b = pair.builder(11)
    p = b.plan("mixed")
    want = b.expected(p)
    h = pair.sender.submit(pair.connect(), p)
    rec = Recorder()
    h.add_done_callback(rec)
    assert rec.event.wait(TIMEOUT), f"no callback; handle {h}"
    assert len(rec.calls) == 1
    got, state, _ = rec.calls[0]
    assert got is h and state is TransferState.DONE, h.error
    for (_, d), exp in zip(b.dsts, want, strict=True):
        assert np.array_equal(d, exp), "the callback ran before the bytes landed"
    h.release()  # a final handle: releasing must not call back again
    assert len(rec.calls) == 1
    assert pair.sender.capabilities.self_completing, \
        "completes its handles itself (above) but its capabilities do not say so"


def test_callback_added_after_completion_runs_now_in_this_thread(pair: Pair) -> None:
    p = pair.builder(12).plan("pages_4k")  # plans register memory: build before connecting
    h = pair.sender.submit(pair.connect(), p)
    assert pair.sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
    rec = Recorder()
    h.add_done_callback(rec)
    assert [(c[1], c[2]) for c in rec.calls] == [(TransferState.DONE, threading.current_thread())]


def test_callbacks_run_in_order_on_failure(pair: Pair) -> None:
    """A refused write calls every callback, in order, with the error already set."""
    b = pair.builder(13)
    p = b.plan("pages_4k")
    last = p.entries[-1]
    bad = replace(p, entries=(replace(last, dst_ptr=last.dst_ptr + (1 << 40)),))
    order: list[str] = []
    done = threading.Event()

    def first(h: Handle) -> None:
        assert isinstance(h.error, RemoteOutOfBounds)
        order.append("first")

    def second(h: Handle) -> None:
        order.append("second")
        done.set()

    h = pair.sender.submit(pair.connect(), bad)
    h.add_done_callback(first)
    h.add_done_callback(second)
    assert done.wait(TIMEOUT)
    assert order == ["first", "second"]
    assert h.state is TransferState.FAILED


def test_empty_plan_calls_back_at_once(pair: Pair) -> None:
    p = pair.builder(14).plan("empty")
    h = pair.sender.submit(pair.connect(), p)
    rec = Recorder()
    h.add_done_callback(rec)
    assert [c[1] for c in rec.calls] == [TransferState.DONE]


def test_callback_on_a_lost_peer(name: str) -> None:
    """A receiver killed with a transfer queued: the callback reports the failure (or
    DONE for one-sided engines that finished first), once."""
    if not transport_class(name).capabilities.cross_process:
        return
    remote = RemotePeer(name, 24 << 20)
    try:
        with make(name, io_timeout=1.5) as sender:
            b = remote.builder(sender)
            p = b.plan("pages_256k")
            peer = sender.connect(remote.endpoint)
            h = sender.submit(peer, p)
            assert sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
            remote.stop()
            h = sender.submit(peer, p)
            rec = Recorder()
            h.add_done_callback(rec)
            remote.kill()
            assert rec.event.wait(TIMEOUT), "no callback after the peer died"
            assert len(rec.calls) == 1
            if rec.calls[0][1] is TransferState.FAILED:
                assert isinstance(h.error, PeerLost), h.error
            peer.close()
    finally:
        remote.kill()


def test_close_calls_back_every_pending_handle(name: str) -> None:
    """Closing the transport with transfers in flight calls every callback exactly once
    (FAILED with TransportClosed / PeerLost, or DONE if a transfer won the race)."""
    if not transport_class(name).capabilities.cross_process:
        return
    remote = RemotePeer(name, 24 << 20)
    try:
        sender = make(name)
        b = remote.builder(sender)
        p = b.plan("pages_256k")
        peer = sender.connect(remote.endpoint)
        handles = [sender.submit(peer, p) for _ in range(4)]
        recs = [Recorder() for _ in handles]
        for h, r in zip(handles, recs, strict=True):
            h.add_done_callback(r)
        sender.close()
        for h, r in zip(handles, recs, strict=True):
            assert r.event.wait(TIMEOUT), f"no callback for {h} after close"
            assert len(r.calls) == 1
            if r.calls[0][1] is TransferState.FAILED:
                assert isinstance(h.error, TransportClosed | PeerLost), h.error
    finally:
        remote.kill()


# --- the Handle itself (shared by every transport) ----------------------------------------


def test_handle_callback_runs_in_the_completing_thread() -> None:
    h = Handle(nbytes=1, peer="x")
    rec = Recorder()
    h.add_done_callback(rec)
    assert rec.calls == []
    t = threading.Thread(target=h.set_done, name="completer")
    t.start()
    t.join()
    assert [(c[1], c[2]) for c in rec.calls] == [(TransferState.DONE, t)]
    h.set_failed(TransferCancelled("late"))  # ignored: already final, no second call
    assert len(rec.calls) == 1


def test_handle_release_while_pending_calls_back_cancelled() -> None:
    released: list[Handle] = []
    h = Handle(nbytes=1, on_release=released.append)
    rec = Recorder()
    h.add_done_callback(rec)
    h.release()
    h.release()
    assert [c[1] for c in rec.calls] == [TransferState.FAILED]
    assert isinstance(h.error, TransferCancelled)
    assert released == [h]


def test_handle_callback_exceptions_are_contained() -> None:
    h = Handle(nbytes=1)
    rec = Recorder()

    def boom(_: Handle) -> None:
        raise RuntimeError("callback bug")

    h.add_done_callback(boom)
    h.add_done_callback(rec)
    assert h.set_done() is True  # the bug neither propagates nor stops later callbacks
    assert [c[1] for c in rec.calls] == [TransferState.DONE]
    h.add_done_callback(boom)  # already final: runs now, still contained


def test_handle_callback_may_wait_and_add_callbacks() -> None:
    """Inside a callback the handle is final: waiting returns at once and a callback
    added there runs immediately (no lock is held)."""
    h = Handle(nbytes=1)
    seen: list[TransferState] = []

    def nested(x: Handle) -> None:
        seen.append(x.wait(10.0))
        x.add_done_callback(lambda y: seen.append(y.state))

    h.add_done_callback(nested)
    h.set_done()
    assert seen == [TransferState.DONE, TransferState.DONE]


def test_a_handle_says_when_its_bytes_started_moving_and_when_it_ended(pair: Pair) -> None:
    """``started``: the transport began moving the bytes (the span NIXL's xferDuration
    covers, which the session's ``transfer`` phase reports); ``finished``: final."""
    p = pair.builder(13).plan("pages_4k")
    before = time.monotonic()
    h = pair.sender.submit(pair.connect(), p)
    assert pair.sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
    assert h.started is not None, "the transport does not stamp Handle.started"
    assert h.finished is not None and before <= h.started <= h.finished <= time.monotonic()


def test_handle_stamps_its_start_once_and_its_end_when_final() -> None:
    h = Handle(nbytes=1)
    assert h.started is None and h.finished is None
    h.mark_started()
    first = h.started
    h.mark_started()  # a later frame or post of the same handle does not move it
    assert h.started == first
    h.set_done()
    assert h.finished is not None and first is not None and h.finished >= first
    cancelled = Handle(nbytes=1)
    cancelled.release()  # never started: only the end is known
    assert cancelled.started is None and cancelled.finished is not None
