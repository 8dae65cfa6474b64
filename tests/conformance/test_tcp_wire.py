"""The tcp transport's own pieces: wire format, frame splitting, hostile input, options."""

from __future__ import annotations

import json
import socket
import struct

import numpy as np
import pytest
from kvh_conformance import Pair, settle, thread_count

from kvhandoff.lab.testing.hostile import until_closed
from kvhandoff.lab.testing.transport import KINDS, PlanBuilder, page_plan
from kvhandoff.layout import Region
from kvhandoff.memory import raw_view
from kvhandoff.plan.execute import HostMemory, execute
from kvhandoff.plan.model import Plan, TensorPlan
from kvhandoff.transport import ProtocolError, TransferState
from kvhandoff.transport.framing.cut import split
from kvhandoff.transport.framing.handshake import (
    CLIENT_FRAME,
    SERVER_FRAME,
    ClientHandshake,
    HandshakeFailed,
)
from kvhandoff.transport.framing.served import prove
from kvhandoff.transport.framing.wire import (
    FLAG_CHECK,
    FLAG_NOTICE,
    HEADER,
    Header,
    Kind,
    Records,
    join_notice,
)
from kvhandoff.transport.regions import RegionTable
from kvhandoff.transport.tcp.data import Sink
from kvhandoff.transport.tcp.transport import TcpTransport

TIMEOUT = 30.0


def _builder(seed: int) -> PlanBuilder:
    def dst(n: int) -> tuple[int, np.ndarray]:
        a = np.zeros(n, np.uint8)
        return int(a.ctypes.data), a

    return PlanBuilder(np.random.default_rng(seed), lambda n: np.zeros(n, np.uint8), dst)


# --- wire format ---------------------------------------------------------------------


def test_header_round_trip_and_rejects() -> None:
    h = Header(Kind.WRITE, 1, 7, 100, 1 << 31)
    assert Header.unpack(h.pack()) == h
    raw = bytearray(h.pack())
    with pytest.raises(ProtocolError, match="magic"):
        Header.unpack(b"XXXX" + raw[4:])
    with pytest.raises(ProtocolError, match="version"):
        Header.unpack(raw[:4] + struct.pack("<H", 99) + raw[6:])
    with pytest.raises(ProtocolError, match="kind"):
        Header.unpack(raw[:6] + struct.pack("<H", 77) + raw[8:])
    with pytest.raises(ProtocolError, match="too large"):
        Header.unpack(Header(Kind.WRITE, 0, 0, 1 << 40, 0).pack())


def test_records_round_trip_and_rejects() -> None:
    r = Records.build([(4096, 64, 8, 16, 2, 32), (0, 0, 0, 0, 1, 0)],
                      [np.array([3, 1, 2]), np.zeros(0, np.int64)])
    back = Records.decode(r.encode())
    assert np.array_equal(back.fields, r.fields) and np.array_equal(back.idx, r.idx)
    assert back.nbytes == 3 * 16 * 2
    enc = r.encode()
    for bad in (enc[:5], enc[:-8], enc + b"\0" * 4, struct.pack("<q", -1),
                struct.pack("<q", 1) + struct.pack("<7q", 0, 0, 0, 1, 1, 0, -1)):
        with pytest.raises(ProtocolError):
            Records.decode(bad)


def test_records_bounds_checks_agree() -> None:
    """The per-record check (few records) and the vectorised one (many) give the same
    verdict on random records around two registered blocks."""
    rng = np.random.default_rng(4)
    bufs = [np.zeros(5000, np.uint8), np.zeros(3000, np.uint8)]
    table = RegionTable([(Region(ptr=int(b.ctypes.data), nbytes=b.nbytes), b) for b in bufs])
    for _ in range(300):
        rows, idxs = [], []
        for _ in range(int(rng.integers(1, 12))):
            base = int(bufs[int(rng.integers(0, 2))].ctypes.data) + int(rng.integers(-8, 64))
            unit, ln, cnt = int(rng.integers(0, 400)), int(rng.integers(0, 80)), \
                int(rng.integers(0, 5))
            rows.append((max(base, 0), unit, int(rng.integers(0, 50)), ln, cnt,
                         int(rng.integers(0, 120))))
            idxs.append(rng.integers(0, 12, int(rng.integers(0, 4))).astype(np.int64))
        r = Records.build(rows, idxs)
        assert (r._problem_few(table) is None) == (r._problem_many(table) is None), rows


def test_records_bounds_check_is_exact() -> None:
    buf = np.zeros(1000, np.uint8)
    base = int(buf.ctypes.data)
    table = RegionTable([(Region(ptr=base, nbytes=1000), raw_view(base, 1000))])

    def rec(ptr: int, unit: int, off: int, ln: int, cnt: int, stride: int, idx: list[int]
            ) -> Records:
        return Records.build([(ptr, unit, off, ln, cnt, stride)], [np.array(idx, np.int64)])

    assert rec(base, 100, 0, 100, 1, 0, [0, 9]).problem(table) is None  # up to the last byte
    assert rec(base, 100, 0, 100, 1, 0, [0, 10]).problem(table) is not None  # one unit past
    assert rec(base, 100, 1, 100, 1, 0, [9]).problem(table) is not None  # one byte past
    assert rec(base, 100, 0, 10, 10, 10, [9]).problem(table) is None
    assert rec(base, 100, 0, 10, 10, 11, [9]).problem(table) is not None  # stride overruns
    assert rec(base - 1, 100, 1, 10, 1, 0, [0]).problem(table) is not None  # ptr before region
    assert rec(base, 1 << 40, 0, 1, 1, 0, [1 << 30]).problem(table) is not None  # no overflow
    assert rec(base, 100, 0, 0, 1, 0, [1 << 30]).problem(table) is None  # moves nothing
    assert rec(base, 100, 0, 10, 1, 0, [0]).problem(RegionTable()) is not None


# --- frame splitting -----------------------------------------------------------------


@pytest.mark.parametrize("budget", [7, 1000, 4096, 100_000, 4 << 20])
@pytest.mark.parametrize("kind", ["mixed", "huge", "tiny_many", "mamba_groups"])
def test_split_frames_cover_the_plan_exactly(kind: str, budget: int) -> None:
    """Frames respect the budget and, executed chunk by chunk, move exactly the plan."""
    if budget < 1000 and kind in ("huge", "mixed", "tiny_many"):
        pytest.skip("millions of tiny frames: slow, and covered by the other budgets")
    b = _builder(0)
    p = b.plan(kind)
    frames = split(p, budget)
    sizes = [sum(c.nbytes for c in f) for f in frames]
    assert sum(sizes) == p.nbytes
    assert all(0 < s <= budget for s in sizes)
    want = b.expected(p)
    entries = tuple(
        TensorPlan(component="c", tensor="t", layer_id=0, src_ptr=c.src_ptr, dst_ptr=c.dst_ptr,
                   src_unit=c.src_unit, dst_unit=c.dst_unit, src_idx=c.src_idx,
                   dst_idx=c.dst_idx, pieces=np.array([[c.src_off, c.dst_off, c.length,
                                                        c.count, c.src_stride, c.dst_stride]]))
        for f in frames for c in f)
    execute(Plan(entries=entries), HostMemory(b.srcs), HostMemory([d for _, d in b.dsts]))
    for (_, got), exp in zip(b.dsts, want, strict=True):
        assert np.array_equal(got, exp)


# --- options that change the data path ------------------------------------------------


@pytest.mark.parametrize("opts", [
    {"frame_bytes": 1000, "connections": 1},  # many frames and sub-pieces, CHECK first
    {"frame_bytes": 16 << 20, "connections": 3},  # units larger than either bounce buffer
    {"frame_bytes": 64 << 10, "connections": 4},
])
@pytest.mark.parametrize("kind", ["mixed", "huge"])
def test_tcp_options_stay_byte_exact(opts: dict[str, int], kind: str) -> None:
    with TcpTransport(**opts) as s, TcpTransport(**opts) as r:
        pr = Pair(s, r)
        b = pr.builder(1)
        p = b.plan(kind)
        want = b.expected(p)
        h = s.submit(pr.connect(), p)
        assert s.wait(h, TIMEOUT) is TransferState.DONE, h.error
        for (_, got), exp in zip(b.dsts, want, strict=True):
            assert np.array_equal(got, exp)
        pr.close()


# --- hostile input ---------------------------------------------------------------------


def _raw(ep: bytes, *, authenticate: bool = False) -> socket.socket:
    """A raw socket to the endpoint's data port; ``authenticate``: past the handshake."""
    e = json.loads(ep)
    s = socket.create_connection((e["host"], e["port"]), timeout=5)
    if authenticate:
        prove(s, key=e["token"].encode(), endpoint_id=e["id"], timeout=5, peer="test")
    return s


PRE_AUTH = ("garbage", "bad-version", "wrong key", "frame instead of answer")


@pytest.mark.parametrize("payload", [
    *PRE_AUTH,
    "hello after handshake",
    "size mismatch",
    "bad records",
    "reply kind",
    "truncated",
    "notice overruns",
    "notice on check",
])
def test_malformed_frames_drop_the_connection_not_the_server(payload: str) -> None:
    with TcpTransport(io_timeout=2.0) as r, TcpTransport() as s:
        dst = r.allocate(1 << 16)
        ep = r.endpoint()
        threads0 = thread_count()
        good = Records.build([(int(dst.ctypes.data), 4096, 0, 4096, 1, 4096)],
                             [np.array([1])]).encode()
        noticed = join_notice(b"n", good)
        notices: list[bytes] = []
        r.on_notice(notices.append)
        frames = {
            "hello after handshake": Header(Kind.HELLO, 0, 0, 0, 0).pack(),
            "size mismatch": Header(Kind.WRITE, 0, 1, len(good), 10).pack() + good,
            "bad records": Header(Kind.WRITE, 0, 1, 9, 0).pack() + b"\x01" * 9,
            "reply kind": Header(Kind.REPLY, 0, 1, 0, 0).pack(),
            "truncated": Header(Kind.WRITE, 0, 1, len(good), 4096).pack() + good
            + b"\0" * 100,
            "notice overruns": Header(Kind.WRITE, FLAG_NOTICE, 1, 4 + len(good),
                                      4096).pack()
            + struct.pack("<I", 1000) + good,
            "notice on check": Header(Kind.WRITE, FLAG_NOTICE | FLAG_CHECK, 1,
                                      len(noticed), 0).pack() + noticed,
        }
        sock = _raw(ep, authenticate=payload not in PRE_AUTH)
        if payload in PRE_AUTH:
            challenge = sock.recv(SERVER_FRAME, socket.MSG_WAITALL)
            assert challenge.startswith(b"KVHA") and len(challenge) == SERVER_FRAME
            if payload == "wrong key":
                raw = ClientHandshake.new(b"not the token", json.loads(ep)["id"],
                                          peer="test").answer(challenge)
            elif payload == "garbage":
                raw = (b"garbage" * 11)[:CLIENT_FRAME]  # a whole ANSWER's worth
            elif payload == "bad-version":
                raw = b"KVHA\x02" + b"\xff" * (CLIENT_FRAME - 5)
            else:  # what a client of the old protocol sent first
                raw = Header(Kind.HELLO, 0, 0, 36, 0).pack() + b"t" * 36
            assert len(raw) == CLIENT_FRAME  # the server reads exactly one ANSWER
        else:
            raw = frames[payload]
        sock.sendall(raw)
        if payload == "truncated":
            sock.shutdown(socket.SHUT_WR)  # the sender vanishes mid-payload
        answer = until_closed(sock)
        sock.close()
        if payload in PRE_AUTH:  # refused with a REFUSED frame, nothing else
            assert answer.startswith(b"KVHA") and len(answer) == SERVER_FRAME, answer
            with pytest.raises(HandshakeFailed, match="refused our proof"):
                ClientHandshake.new(b"k", json.loads(ep)["id"], peer="test").answer(answer)
        elif answer:
            assert answer.startswith(b"KVHT")
        assert not dst.any() or payload == "truncated"
        assert not notices, "a malformed frame's notice was delivered"
        # the server still serves a well-behaved client
        src = np.full(4096, 7, np.uint8)
        s.register(src)
        p = page_plan(src, dst, 2)
        peer = s.connect(ep)
        h = s.submit(peer, p)
        assert s.wait(h, TIMEOUT) is TransferState.DONE, h.error
        assert (dst[8192:12288] == 7).all()
        peer.close()
        assert settle(thread_count, threads0) <= threads0


def test_header_size_is_fixed() -> None:
    assert HEADER.size == 36


def test_all_plan_kinds_are_known() -> None:
    b = _builder(0)
    for k in KINDS:
        b.plan(k)
    with pytest.raises(ValueError):
        b.plan("nope")


def test_sink_batches_gathers_and_flushes_when_full() -> None:
    """Small gathered chunks share the bounce buffer; one that does not fit flushes it.
    The byte stream is the chunks' bytes in order (unit, row, byte)."""
    src = np.arange(6000, dtype=np.uint8)
    base = int(src.ctypes.data)
    table = RegionTable([(Region(ptr=base, nbytes=len(src)), raw_view(base, len(src)))])
    e = TensorPlan(component="c", tensor="t", layer_id=0, src_ptr=base, dst_ptr=0,
                   src_unit=1000, dst_unit=1000, src_idx=np.array([4, 0, 2]),
                   dst_idx=np.array([0, 1, 2]), pieces=np.array([[0, 0, 100, 3, 200, 100]]))
    chunks = [c for f in split(Plan(entries=(e, e)), 1 << 20) for c in f]
    a, b = socket.socketpair()
    with a, b:
        sink = Sink(a, bounce_bytes=1000)  # 900 B per chunk: the second one must flush
        for c in chunks:
            sink.chunk(c, table)
        sink.flush()
        a.shutdown(socket.SHUT_WR)
        got = until_closed(b)
    rows = [src[u * 1000 + r * 200:u * 1000 + r * 200 + 100] for u in (4, 0, 2) for r in range(3)]
    assert got == np.concatenate(rows * 2).tobytes()
