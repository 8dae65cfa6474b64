"""Refused writes, vanished peers and caller bugs: failures are ours, bounded, and clean."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from multiprocessing import resource_tracker

import numpy as np
import pytest
from kvh_conformance import Pair, RemotePeer, fd_count, make, settle, thread_count

from kvhandoff.errors import OutOfBounds
from kvhandoff.plan.model import Plan
from kvhandoff.transport import (
    PeerLost,
    RemoteOutOfBounds,
    TransferState,
    TransportError,
    transport_class,
)

TIMEOUT = 30.0
TWO_SIDED = ("tcp", "shm", "cma", "auto")  # DONE means the receiver acknowledged


def _shift_last(p: Plan, by: int) -> Plan:
    """The same plan with its last entry's destination moved ``by`` bytes."""
    last = p.entries[-1]
    return replace(p, entries=(*p.entries[:-1], replace(last, dst_ptr=last.dst_ptr + by)))


@pytest.mark.parametrize("kind", ["pages_4k", "huge", "mixed", "tiny_handoff",
                                  "tiny_head_sliced"])
def test_out_of_bounds_destination_refused_nothing_written(pair: Pair, kind: str) -> None:
    """The last entry reaches one unit past its tensor (and its region): the whole
    submit is refused and no destination byte changes, even for multi-frame writes."""
    b = pair.builder(3)
    p = b.plan(kind)
    last = p.entries[-1]
    cap = len(b.dsts[-1][1]) // last.dst_unit
    bad = replace(p, entries=(*p.entries[:-1], replace(
        last, dst_idx=np.concatenate((last.dst_idx[:-1], [cap])).astype(np.int64))))
    before = [d.copy() for _, d in b.dsts]
    h = pair.sender.submit(pair.connect(), bad)
    assert pair.sender.wait(h, TIMEOUT) is TransferState.FAILED
    assert isinstance(h.error, RemoteOutOfBounds), h.error
    for (_, d), old in zip(b.dsts, before, strict=True):
        assert np.array_equal(d, old), "a refused write changed destination memory"
    # the peer is still usable afterwards
    want = b.expected(p)
    h = pair.sender.submit(pair.peer, p)
    assert pair.sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
    for (_, d), exp in zip(b.dsts, want, strict=True):
        assert np.array_equal(d, exp)


def test_unregistered_destination_refused(pair: Pair) -> None:
    b = pair.builder(4)
    p = _shift_last(b.plan("pages_256k"), 1 << 40)
    h = pair.sender.submit(pair.connect(), p)
    assert pair.sender.wait(h, TIMEOUT) is TransferState.FAILED
    assert isinstance(h.error, RemoteOutOfBounds)


@pytest.mark.parametrize("kind", ["pages_4k", "tiny_handoff"])
@pytest.mark.parametrize("where", ["first", "last"])
def test_unregistered_source_raises_at_submit(pair: Pair, kind: str, where: str) -> None:
    b = pair.builder(5)
    p = b.plan(kind)
    k = 0 if where == "first" else len(p.entries) - 1
    e = p.entries[k]
    entries = list(p.entries)
    cap = len(b.srcs[k]) // e.src_unit  # one unit past the end of its region
    entries[k] = replace(e, src_idx=np.concatenate((e.src_idx[:-1], [cap])).astype(np.int64))
    peer = pair.connect()
    with pytest.raises(OutOfBounds):
        pair.sender.submit(peer, replace(p, entries=tuple(entries)))
    bad = replace(p, entries=(replace(e, src_ptr=e.src_ptr + (1 << 40)),))
    with pytest.raises(OutOfBounds):
        pair.sender.submit(peer, bad)


def _cross_process(name: str) -> None:
    if not transport_class(name).capabilities.cross_process:
        pytest.skip(f"{name} peers live in one process")


@pytest.mark.parametrize("how", ["killed", "stopped", "stopped_small"])
def test_peer_disappears_mid_transfer(name: str, how: str) -> None:
    """The receiver (a child process) is frozen with 24 MiB queued to it, then killed
    (or left frozen, with 24 MiB or with a transfer small enough to sit in socket
    buffers). Every handle becomes final within the timeouts (one-sided engines
    may legitimately finish writing into a frozen process); failures are PeerLost; after
    the kill, new transfers fail instead of hanging; closing the peer releases its
    threads and sockets."""
    _cross_process(name)
    resource_tracker.ensure_running()  # spawn starts it once and keeps its pipe open
    threads0, fds0 = thread_count(), fd_count()
    remote = RemotePeer(name, 48 << 20)
    try:  # a frozen peer is noticed after io_timeout (up to twice that for a reply)
        with make(name, io_timeout=1.5) as sender:
            b = remote.builder(sender)
            p = b.plan("pages_256k")  # 4 MiB
            peer = sender.connect(remote.endpoint)
            h = sender.submit(peer, p)  # a warm-up transfer that must succeed
            assert sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
            small = b.plan("pages_4k") if how == "stopped_small" else p  # fits socket buffers
            remote.stop()
            handles = [sender.submit(peer, small) for _ in range(6 if small is p else 1)]
            time.sleep(0.3)
            if how == "killed":
                remote.kill()
            t0 = time.monotonic()
            states = [sender.wait(x, TIMEOUT) for x in handles]
            waited = time.monotonic() - t0
            assert TransferState.PENDING not in states, f"still pending after {waited:.1f}s"
            if name in TWO_SIDED:  # completion needs the receiver: it cannot have acked
                assert TransferState.FAILED in states
            for x in handles:
                if x.state is TransferState.FAILED:
                    assert isinstance(x.error, PeerLost), x.error
                x.release()
            if how == "killed":
                try:
                    later = sender.submit(peer, p)
                except TransportError:
                    pass  # refusing at once is fine too
                else:
                    assert sender.wait(later, TIMEOUT) is TransferState.FAILED, \
                        "a transfer to a dead peer succeeded"
                    assert isinstance(later.error, TransportError), later.error
            peer.close()
    finally:
        remote.kill()
    assert settle(thread_count, threads0) <= threads0
    assert settle(fd_count, fds0) <= fds0


def test_cross_process_byte_exact(name: str) -> None:
    _cross_process(name)
    remote = RemotePeer(name, 40 << 20)
    try:
        with make(name) as sender:
            b = remote.builder(sender, seed=9)
            p = b.plan("mixed")
            want = b.expected(p)
            peer = sender.connect(remote.endpoint)
            h = sender.submit(peer, p)
            assert sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
            remote.assert_holds(b.dsts, want)
            peer.close()
    finally:
        remote.close()


def test_connect_to_nothing_fails_cleanly(name: str) -> None:
    with make(name) as a, make(name) as b:
        ep = b.endpoint()
        b.close()
        with pytest.raises(TransportError):
            a.connect(ep)
        with pytest.raises(TransportError):
            a.connect(b"not an endpoint")


def test_endpoint_with_a_wrong_token_is_refused(name: str) -> None:
    with make(name) as a, make(name) as b:
        try:
            ep = json.loads(b.endpoint())
        except ValueError:
            pytest.skip(f"{name} endpoints are not JSON")
        if "token" not in ep:
            pytest.skip(f"{name} endpoints carry no token")
        ep["token"] = "0" * len(str(ep["token"]))
        with pytest.raises(TransportError):
            a.connect(json.dumps(ep).encode())
