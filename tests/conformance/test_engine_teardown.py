"""Closing a transport whose peer is frozen (SIGSTOP) is bounded.

The receiver runs in a child process and is frozen with transfers in flight (or
before the first transfer ever reached it). The sender's handles become final within
its timeouts, and ``close`` returns promptly: the engine adapters give their engine's
own teardown ``close_timeout`` seconds, then finish this side and leave the engine to a
daemon thread. Every wait is bounded; the only timing checks are generous bounds that
tell a hang from a slow machine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from typing import Any

import pytest
from kvh_conformance import RemotePeer, make

from kvhandoff.lab.testing.params import transport_params
from kvhandoff.transport import (
    PeerLost,
    TransferState,
    TransportClosed,
    TransportError,
    transport_class,
)

HANG = 30.0  # longer than this is a hang, not a slow machine
ENGINES = ("mooncake", "nixl")


def _options(name: str, io_timeout: float) -> dict[str, Any]:
    opts: dict[str, Any] = {"io_timeout": io_timeout}
    if name in ENGINES:
        opts["close_timeout"] = 2.0
    return opts


def _resume_and_kill(remote: RemotePeer) -> None:
    pid = remote.proc.pid
    if pid is not None and remote.proc.is_alive():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)
    remote.kill()


@pytest.mark.parametrize("case", ["close_in_flight", "fail_then_close", "frozen_before_first"])
def test_close_with_a_frozen_peer_is_bounded(name: str, case: str) -> None:
    """``close_in_flight``: close while 24 MiB are still queued to the frozen peer
    (handles fail with TransportClosed, or are DONE for one-sided engines that could
    write into the frozen process). ``fail_then_close``: the handles fail first with
    PeerLost after ``io_timeout``, then close. ``frozen_before_first``: the peer is
    frozen after connect but before any transfer reached it (the engine's first
    contact with a peer must not happen in ``submit`` or ``close``)."""
    if not transport_class(name).capabilities.cross_process:
        pytest.skip(f"{name} peers live in one process")
    remote = RemotePeer(name, 48 << 20)
    try:
        sender = make(name, **_options(name, 60.0 if case == "close_in_flight" else 1.5))
        handles = []
        try:
            b = remote.builder(sender)
            p = b.plan("pages_256k")  # 4 MiB of scattered 256 KiB pages
            peer = sender.connect(remote.endpoint)
            if case != "frozen_before_first":
                h = sender.submit(peer, p)
                assert sender.wait(h, HANG) is TransferState.DONE, h.error
            remote.stop()
            t0 = time.monotonic()
            handles = [sender.submit(peer, p) for _ in range(6)]
            submitted = time.monotonic() - t0
            assert submitted < HANG, f"submit blocked for {submitted:.0f}s on a frozen peer"
            if case == "close_in_flight":
                time.sleep(0.2)  # let the engine start writing
            else:
                states = [sender.wait(x, HANG) for x in handles]
                assert TransferState.PENDING not in states, "a handle outlived io_timeout"
                for x in handles:
                    if x.state is TransferState.FAILED:
                        assert isinstance(x.error, PeerLost), x.error
        finally:
            t0 = time.monotonic()
            sender.close()
            took = time.monotonic() - t0
        assert took < HANG, f"close took {took:.0f}s with a frozen peer"
        for x in handles:  # close fails whatever was still pending
            state = sender.poll(x)
            assert state is not TransferState.PENDING, "close left a handle pending"
            if state is TransferState.FAILED:
                assert isinstance(x.error, (TransportClosed, PeerLost)), x.error
            x.release()
        with pytest.raises(TransportError):
            sender.submit(peer, p)
    finally:
        _resume_and_kill(remote)


@pytest.mark.parametrize("engine", transport_params(ENGINES))
def test_close_leaves_a_stuck_engine_teardown_behind(
        engine: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The engine's own teardown never finishes (simulated): ``close`` still returns
    after ``close_timeout``, fails what was pending with TransportClosed, and warns,
    naming the peer; the teardown finishes later on its daemon thread."""
    name = engine
    cls = transport_class(engine)
    stuck = threading.Event()
    real = cls._close_engine  # type: ignore[attr-defined]

    def close_engine(self: Any) -> None:
        stuck.wait(HANG)
        real(self)

    monkeypatch.setattr(cls, "_close_engine", close_engine)
    remote = RemotePeer(name, 16 << 20)
    try:
        sender = make(name, io_timeout=60.0, close_timeout=0.5)
        b = remote.builder(sender)
        p = b.plan("pages_256k")
        peer = sender.connect(remote.endpoint)
        remote.stop()
        staged = sender.submit(peer, b.plan("pages_4k"))  # staged: needs the peer's reply
        direct = sender.submit(peer, p)
        with caplog.at_level(logging.WARNING, logger="kvhandoff.transport"):
            t0 = time.monotonic()
            sender.close()
            took = time.monotonic() - t0
        assert took < HANG, f"close took {took:.0f}s"
        assert staged.state is TransferState.FAILED, staged
        assert isinstance(staged.error, TransportClosed), staged.error
        assert direct.state is not TransferState.PENDING
        assert any("close_timeout" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        stuck.set()
        _resume_and_kill(remote)
