"""The small-plan path (tiny handoffs): pure-Python views, the tcp small frame, the
inline non-blocking write and its backlog."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import time

import numpy as np
import pytest
from kvh_conformance import RemotePeer, make

from kvhandoff.lab.testing.transport import PlanBuilder
from kvhandoff.plan.model import Plan
from kvhandoff.transport import TransferState
from kvhandoff.transport.framing.cut import dst_records, split
from kvhandoff.transport.framing.io import write_some
from kvhandoff.transport.framing.wire import Records
from kvhandoff.transport.regions import RegionTable
from kvhandoff.transport.small import MAX_SEGMENTS, copy_views, plan_views
from kvhandoff.transport.tcp.client import TcpPeer
from kvhandoff.transport.tcp.data import Sink
from kvhandoff.transport.tcp.small import build, dst_views

SMALL_KINDS = ("tiny_handoff", "tiny_head_sliced", "mamba_groups", "zero_units")
TIMEOUT = 30.0


class Local:
    """Sources and destinations in this process, each with its region table."""

    def __init__(self, seed: int) -> None:
        self.src = RegionTable()
        self.dst = RegionTable()
        self.builder = PlanBuilder(np.random.default_rng(seed), self._src, self._dst)

    def _src(self, n: int) -> np.ndarray:
        from kvhandoff.layout import Region

        a = np.empty(n, np.uint8)
        self.src = self.src.with_regions([(Region(ptr=int(a.ctypes.data), nbytes=n), a)])
        return a

    def _dst(self, n: int) -> tuple[int, np.ndarray]:
        from kvhandoff.layout import Region

        a = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
        self.dst = self.dst.with_regions([(Region(ptr=int(a.ctypes.data), nbytes=n), a)])
        return int(a.ctypes.data), a


@pytest.mark.parametrize("kind", SMALL_KINDS)
def test_small_frame_equals_the_general_frame(kind: str) -> None:
    """Same records and same payload bytes as the general path, so receivers may take
    either path."""
    loc = Local(1)
    p = loc.builder.plan(kind)
    small = build(p, loc.src, "test")
    frames = split(p, 4 << 20)
    if small is None:  # declined: nothing to move, or too many segments
        assert not frames or p.num_segments > MAX_SEGMENTS
        return
    assert small is not None and len(frames) == 1
    general = dst_records(frames[0])
    got = Records.decode(small.desc)
    assert np.array_equal(got.fields, general.fields)
    assert np.array_equal(got.idx, general.idx)
    assert np.array_equal(got.bounds, general.bounds)
    a, b = socket.socketpair()
    with a, b:
        sink = Sink(a, 1 << 20)
        for c in frames[0]:
            sink.chunk(c, loc.src)
        sink.flush()
        b.settimeout(TIMEOUT)
        want = bytearray()
        while len(want) < small.nbytes:
            want += b.recv(small.nbytes - len(want))
    assert len(want) == small.nbytes
    assert b"".join(bytes(v) for v in small.views) == want


@pytest.mark.parametrize("kind", SMALL_KINDS)
def test_small_views_deliver_like_the_executor(kind: str) -> None:
    loc = Local(2)
    p = loc.builder.plan(kind)
    want = loc.builder.expected(p)
    src, dst = plan_views(p, loc.src, "src"), plan_views(p, loc.dst, "dst")
    if src is None or dst is None:
        assert p.nbytes == 0 or p.num_segments > MAX_SEGMENTS
        return
    assert isinstance(src, list) and isinstance(dst, list)
    copy_views(dst, src)
    for (_, got), exp in zip(loc.builder.dsts, want, strict=True):
        assert np.array_equal(got, exp)


def test_small_receiver_refuses_the_whole_frame_before_writing() -> None:
    """The last record reaches past its tensor: ``dst_views`` names it, and the views of
    the records before it were never handed out (nothing can be written)."""
    loc = Local(3)
    p = loc.builder.plan("tiny_handoff")
    small = build(p, loc.src, "test")
    assert small is not None
    rec = Records.decode(small.desc)
    fields = rec.fields.copy()
    fields[-1, 2] += len(loc.builder.dsts[-1][1])  # off: one tensor further
    bad = Records(fields, rec.idx, rec.bounds)
    problem = dst_views(bad, loc.dst)
    assert isinstance(problem, str) and f"record {len(rec) - 1}" in problem
    assert isinstance(dst_views(rec, loc.dst), list)


def test_plan_views_refuses_and_declines() -> None:
    loc = Local(4)
    tiny = loc.builder.plan("tiny_handoff")
    big = loc.builder.plan("pages_4k")  # 400 pages: not small
    assert plan_views(big, loc.src, "src") is None
    assert plan_views(tiny, loc.src, "src", make=False) == []
    assert isinstance(plan_views(tiny, loc.dst, "src"), str)  # sources are not there
    assert isinstance(plan_views(tiny, RegionTable(), "dst"), str)
    assert MAX_SEGMENTS < 400


def test_copy_views_across_different_cuts() -> None:
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 5000, dtype=np.uint8)
    out = np.zeros(5000, np.uint8)

    def cut(buf: np.ndarray) -> list[memoryview]:
        edges = sorted({0, 5000, *rng.integers(1, 5000, 30).tolist()})
        return [buf.data[a:z] for a, z in itertools.pairwise(edges)]

    copy_views(cut(out), cut(data))
    assert np.array_equal(out, data)


def test_write_some_never_blocks_and_returns_the_rest() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
        a.settimeout(5.0)
        data = np.random.default_rng(6).integers(0, 256, 8 << 20, dtype=np.uint8)
        views = [data.data[k:k + 4096 + 7] for k in range(0, len(data), 4096 + 7)]
        rest = write_some(a, views)  # the peer reads nothing: the kernel takes only part
        assert rest and sum(len(v) for v in rest) < len(data)
        sent = len(data) - sum(len(v) for v in rest)
        got = bytearray()
        while len(got) < sent:
            got += b.recv(1 << 20)
        assert bytes(got) == data[:sent].tobytes()
        assert write_some(a, []) == []


def test_inline_backlog_with_a_frozen_receiver() -> None:
    """Tiny submits to a receiver that reads nothing: the inline writes fill the socket
    buffers and leave a backlog for the sender threads; once the receiver runs again,
    every transfer completes, in order with bigger ones, byte-exact."""
    remote = RemotePeer("tcp", 16 << 20)
    try:
        with make("tcp") as sender:
            b = remote.builder(sender, seed=3)
            tiny = Plan(entries=tuple(b.tiny_handoff()))
            big = b.plan("pages_256k")
            want = b.expected(Plan(entries=tiny.entries + big.entries))
            peer = sender.connect(remote.endpoint)
            assert isinstance(peer, TcpPeer)
            h = sender.submit(peer, tiny)
            assert sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
            remote.stop()
            handles, backlog = [], False
            for _ in range(200):  # 20 MB: more than the socket buffers hold
                handles.append(sender.submit(peer, tiny))
                backlog = backlog or any(c.backlog for c in peer._conns)
            handles += [sender.submit(peer, big), sender.submit(peer, tiny)]
            time.sleep(0.2)
            os.kill(remote.proc.pid or 0, signal.SIGCONT)
            states = [sender.wait(x, TIMEOUT) for x in handles]
            assert states == [TransferState.DONE] * len(handles), [x.error for x in handles]
            assert backlog, "the socket buffers never filled: the backlog path did not run"
            remote.assert_holds(b.dsts, want)
            peer.close()
    finally:
        remote.kill()
