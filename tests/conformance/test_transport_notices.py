"""Notices (``capabilities.notices``): ``submit(..., notice=)`` hands bytes to the
receiving transport's ``on_notice`` handler only after every byte of the plan landed,
before or just after the sender's handle is DONE (cma answers first: the tests wait
for the handler, bounded); a refused write delivers nothing. Transports without the
capability refuse a notice with ``ValueError``."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest
from kvh_conformance import Pair, make

from kvhandoff.lab.testing.hostile import eventually
from kvhandoff.lab.testing.transport import PlanBuilder
from kvhandoff.transport import RemoteOutOfBounds, TransferState, Transport
from kvhandoff.transport.base import MAX_NOTICE

TIMEOUT = 60.0


class Inbox:
    """A notice handler that checks, when called, that the plan's bytes are there."""

    def __init__(self, builder: PlanBuilder | None = None,
                 want: list[np.ndarray] | None = None) -> None:
        self.got: list[tuple[bytes, bool]] = []
        self.event = threading.Event()
        self.builder, self.want = builder, want

    def __call__(self, notice: bytes) -> None:
        landed = self.builder is None or self.want is None or all(
            np.array_equal(d, w) for (_, d), w in zip(self.builder.dsts, self.want,
                                                      strict=True))
        self.got.append((notice, landed))
        self.event.set()


def _needs_notices(t: Transport) -> None:
    if not t.capabilities.notices:
        pytest.skip(f"{t.name} has no notices (checked by test_without_notices_refuses)")


@pytest.mark.parametrize("kind", ["tiny_handoff", "mixed", "pages_256k"])
def test_notice_arrives_after_the_bytes(pair: Pair, kind: str) -> None:
    _needs_notices(pair.sender)
    b = pair.builder(31)
    p = b.plan(kind)
    want = b.expected(p)
    inbox = Inbox(b, want)
    pair.receiver.on_notice(inbox)
    h = pair.sender.submit(pair.connect(), p, notice=b"request 7 done")
    assert pair.sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
    eventually(lambda: bool(inbox.got), TIMEOUT)
    assert inbox.got == [(b"request 7 done", True)], "notice missing, repeated or early"
    h.release()


def test_notice_after_many_frames_over_every_connection() -> None:
    """A plan cut into many frames (spread over the connections): the notice follows
    only once every frame was acknowledged."""
    with make("tcp", frame_bytes=64 << 10, connections=3) as s, make("tcp") as r:
        pair = Pair(s, r)
        b = pair.builder(32)
        p = b.plan("pages_256k")
        want = b.expected(p)
        inbox = Inbox(b, want)
        r.on_notice(inbox)
        for i in range(3):
            h = s.submit(pair.connect(), p, notice=bytes([i]) * (MAX_NOTICE if i else 1))
            assert s.wait(h, TIMEOUT) is TransferState.DONE, h.error
            eventually(lambda i=i: len(inbox.got) > i, TIMEOUT)  # type: ignore[misc]
            assert inbox.got[-1][1], "notice delivered before every frame landed"
        assert [len(n) for n, _ in inbox.got] == [1, MAX_NOTICE, MAX_NOTICE]
        pair.close()


def test_notice_of_an_empty_plan_is_delivered(pair: Pair) -> None:
    _needs_notices(pair.sender)
    p = pair.builder(33).plan("empty")
    inbox = Inbox()
    pair.receiver.on_notice(inbox)
    h = pair.sender.submit(pair.connect(), p, notice=b"nothing to write")
    assert pair.sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
    eventually(lambda: bool(inbox.got), TIMEOUT)
    assert inbox.got == [(b"nothing to write", True)]


@pytest.mark.parametrize("kind", ["tiny_handoff", "pages_256k"])
def test_refused_write_delivers_no_notice(pair: Pair, kind: str) -> None:
    _needs_notices(pair.sender)
    b = pair.builder(34)
    p = b.plan(kind)
    last = p.entries[-1]
    bad = replace(p, entries=(*p.entries[:-1], replace(last, dst_ptr=last.dst_ptr + (1 << 40))))
    inbox = Inbox()
    pair.receiver.on_notice(inbox)
    peer = pair.connect()
    h = pair.sender.submit(peer, bad, notice=b"must not arrive")
    assert pair.sender.wait(h, TIMEOUT) is TransferState.FAILED
    assert isinstance(h.error, RemoteOutOfBounds), h.error
    assert not inbox.got
    # the connection (and the handler) still work
    h = pair.sender.submit(pair.connect(), p, notice=b"fine")
    assert pair.sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
    eventually(lambda: bool(inbox.got), TIMEOUT)
    assert [n for n, _ in inbox.got] == [b"fine"]


def test_failing_handler_is_contained(pair: Pair) -> None:
    _needs_notices(pair.sender)
    b = pair.builder(35)
    p = b.plan("tiny_handoff")
    calls: list[bytes] = []

    def boom(notice: bytes) -> None:
        calls.append(notice)
        raise RuntimeError("handler bug")

    pair.receiver.on_notice(boom)
    peer = pair.connect()
    for i in range(2):
        h = pair.sender.submit(peer, p, notice=bytes([i]))
        assert pair.sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
    eventually(lambda: len(calls) == 2, TIMEOUT)
    assert calls == [b"\0", b"\1"]
    pair.receiver.on_notice(None)  # dropped from now on; writes still work
    h = pair.sender.submit(peer, p, notice=b"x")
    assert pair.sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
    assert len(calls) == 2


def test_without_notices_refuses(pair: Pair) -> None:
    p = pair.builder(36).plan("tiny_handoff")
    peer = pair.connect()
    if pair.sender.capabilities.notices:
        with pytest.raises(ValueError, match="exceeds"):
            pair.sender.submit(peer, p, notice=b"\0" * (MAX_NOTICE + 1))
        return
    with pytest.raises(ValueError, match="does not deliver notices"):
        pair.sender.submit(peer, p, notice=b"x")
    with pytest.raises(ValueError, match="does not deliver notices"):
        pair.receiver.on_notice(print)
    h = pair.sender.submit(peer, p)  # nothing was half-started
    assert pair.sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
