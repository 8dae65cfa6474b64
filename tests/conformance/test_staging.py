"""Staging (kvhandoff.transport.staging): fragmented plans through Mooncake and NIXL.

Checked: head-sliced and scattered plans arrive byte-exact through the staged path
(in process and across processes); the receiver refuses an out-of-bounds staged
write before scattering anything, even when the sender's own check was bypassed; a
hostile control connection cannot scatter; plans that are not fragmented, and peers
that get no slot, go direct; a dying receiver fails staged handles, and nothing leaks.
A sender that closes cleanly says BYE and its slots are leased again at once; one that
goes away otherwise (socket cut, process killed, an engine write possibly still
running) has its slots quarantined, and peers meanwhile get fewer slots or go direct;
a BYE out of place is refused like any malformed frame (and by tcp, which has none).
The numpy pieces (gather, scatter, the segment estimate) are checked against the
planner's executor.
"""

from __future__ import annotations

import ctypes
import json
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import replace
from multiprocessing import resource_tracker
from typing import Any

import numpy as np
import pytest
from kvh_conformance import Pair, RemotePeer, deliver, fd_count, make, settle, thread_count

from kvhandoff.lab.testing.hostile import eventually, read_frame
from kvhandoff.lab.testing.params import transport_params
from kvhandoff.lab.testing.transport import KINDS, PlanBuilder
from kvhandoff.layout import Region
from kvhandoff.plan.model import Plan, TensorPlan
from kvhandoff.transport import (
    ConnectError,
    PeerLost,
    RemoteOutOfBounds,
    TransferState,
)
from kvhandoff.transport.base import Handle, Peer
from kvhandoff.transport.engines.common import EnginePeer
from kvhandoff.transport.framing.cut import dst_records, split
from kvhandoff.transport.framing.served import prove
from kvhandoff.transport.framing.wire import FLAG_CHECK, HEADER, Header, Kind, Records, Status
from kvhandoff.transport.regions import RegionTable
from kvhandoff.transport.staging import (
    Arena,
    Staging,
    StagingConfig,
    estimate_segments,
    gather,
    scatter,
)
from kvhandoff.transport.tcp.transport import TcpTransport

ENGINES = ("mooncake", "nixl")
TIMEOUT = 30.0
SMALL = StagingConfig(slot_bytes=64 << 10, slots=8, slots_per_peer=3)  # many frames


def engines() -> list[Any]:
    return transport_params(ENGINES)


def _link(peer: Any) -> Any:
    assert isinstance(peer, EnginePeer)
    assert peer.link is not None, "the peer advertised no staging channel"
    return peer.link


@pytest.mark.parametrize("engine", engines())
@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small_slots"])
def test_head_sliced_plans_are_staged_byte_exact(engine: str, config: StagingConfig | None
                                                ) -> None:
    """Heterogeneous-TP plans (1 KiB and 256 B head slices, both directions) and
    scattered pages move through the staging channel, and land byte-exact."""
    opts = {} if config is None else {"staging": config}
    with make(engine, **opts) as s, make(engine, **opts) as r:
        pair = Pair(s, r)
        for k, kind in enumerate(("head_slice_gather", "head_slice_split", "pages_4k",
                                  "mixed")):
            assert _link(deliver(pair, kind, seed=k)).submitted == 1, f"{kind} was not staged"
        pair.close()


@pytest.mark.parametrize("engine", engines())
def test_unfragmented_plans_go_direct(engine: str) -> None:
    with make(engine) as s, make(engine) as r:
        pair = Pair(s, r)
        for kind in ("pages_256k", "wide_rows"):  # ("huge" has 70000 rows of 128 B)
            assert _link(deliver(pair, kind)).submitted == 0, f"{kind} was staged"
        pair.close()


@pytest.mark.parametrize("engine", engines())
def test_staging_off_sends_everything_direct(engine: str) -> None:
    with make(engine, staging=False) as s, make(engine) as r:
        pair = Pair(s, r)
        deliver(pair, "head_slice_gather")
        assert isinstance(pair.peer, EnginePeer) and pair.peer.link is None
        pair.close()


@pytest.mark.parametrize("engine", engines())
@pytest.mark.parametrize("kind", ["one_frame", "pages_4k", "mixed"])
def test_receiver_refuses_out_of_bounds_staged_write(engine: str, kind: str) -> None:
    """The sender's own destination check is bypassed (its copy of the peer's table is
    forged to cover everything), so only the receiver stands between the plan and its
    memory: the staged write is refused with RemoteOutOfBounds and no destination
    byte changes, for single- and multi-frame plans; the link stays usable."""
    with make(engine, staging=SMALL) as s, make(engine, staging=SMALL) as r:
        pair = Pair(s, r)
        b = pair.builder(3)
        if kind == "one_frame":  # 100 segments of 16 B: staged, and no CHECK first
            e = b.entries("tiny_many")[0]
            p = Plan(entries=(replace(e, src_idx=e.src_idx[:100], dst_idx=e.dst_idx[:100]),))
        else:
            p = b.plan(kind)
        last = p.entries[-1]
        cap = len(b.dsts[-1][1]) // last.dst_unit
        bad = replace(p, entries=(*p.entries[:-1], replace(
            last, dst_idx=np.concatenate((last.dst_idx[:-1], [cap + 3])).astype(np.int64))))
        peer = pair.connect()
        assert isinstance(peer, EnginePeer)
        everything = RegionTable([(r_, np.zeros(0, np.uint8)) for r_ in _cover(b)])
        honest = peer.table, peer.host_table
        peer.table = peer.host_table = everything
        before = [d.copy() for _, d in b.dsts]
        h = s.submit(peer, bad)
        assert s.wait(h, TIMEOUT) is TransferState.FAILED
        assert isinstance(h.error, RemoteOutOfBounds), h.error
        assert _link(peer).submitted == 1
        for (_, d), old in zip(b.dsts, before, strict=True):
            assert np.array_equal(d, old), "a refused staged write changed destination memory"
        peer.table, peer.host_table = honest
        want = b.expected(p)
        h = s.submit(peer, p)
        assert s.wait(h, TIMEOUT) is TransferState.DONE, h.error
        for (_, d), exp in zip(b.dsts, want, strict=True):
            assert np.array_equal(d, exp)
        pair.close()


def _cover(b: PlanBuilder) -> list[Region]:
    lo = min(ptr for ptr, _ in b.dsts)
    hi = max(ptr + len(d) for ptr, d in b.dsts)
    return [Region(ptr=lo, nbytes=hi - lo + (1 << 24))]


def _dial(endpoint: bytes) -> tuple[socket.socket, list[list[int]]]:
    return _dial_option(json.loads(endpoint)["options"]["staging"])


def _authed(option: str) -> socket.socket:
    """A socket to the staging server of an endpoint's ``staging`` option, past the
    data-plane handshake (the token is the key: no deployment secret)."""
    info = json.loads(option)
    sock = socket.create_connection((info["host"], info["port"]), timeout=5)
    prove(sock, key=info["token"].encode(), endpoint_id=info["id"], timeout=5, peer="test")
    sock.settimeout(5)
    return sock


def _dial_option(option: str) -> tuple[socket.socket, list[list[int]]]:
    """HELLO to the staging server of an endpoint's ``staging`` option: (socket, slots)."""
    sock = _authed(option)
    sock.sendall(_HELLO)
    h, body = _reply(sock)
    assert h.code == Status.OK
    return sock, json.loads(body)["slots"]


def _reply(sock: socket.socket) -> tuple[Header, bytes]:
    got = read_frame(sock)
    if got is None:
        raise EOFError("the staging server closed the connection")
    return got


def _commit(sock: socket.socket, seq: int, slot: int, rec: Records) -> int:
    desc = np.array([seq, slot], "<i8").tobytes() + rec.encode()
    sock.sendall(Header(Kind.WRITE, 0, seq, len(desc), 0).pack() + desc)
    return _reply(sock)[0].code


@pytest.mark.parametrize("engine", engines())
def test_hostile_control_connections_cannot_scatter(engine: str) -> None:
    """A client speaking the control protocol directly: a wrong key is refused in the
    handshake, before any frame is read; a commit naming memory outside the
    registrations, a slot not leased to it, or more bytes than a slot is refused and
    nothing is written."""
    with make(engine, staging=SMALL) as r:
        dst = r.allocate(1 << 20)
        base = int(dst.ctypes.data)
        ep = r.endpoint()
        info = json.loads(json.loads(ep)["options"]["staging"])
        with (socket.create_connection((info["host"], info["port"]), timeout=5) as bad,
              pytest.raises(ConnectError, match="refused our proof")):
            prove(bad, key=b"nope", endpoint_id=info["id"], timeout=5, peer="test")
        page = 4096
        inside = Records.build([(base, page, 0, page, 1, page)], [np.array([2])])
        sock, slots = _dial(ep)
        with sock:
            assert slots and all(n == SMALL.slot_bytes for _, n in slots)
            too_big = Records.build([(base, page, 0, page, 1, page)],
                                    [np.arange(SMALL.slot_bytes // page + 1)])
            assert _commit(sock, 1, 0, too_big) == Status.MALFORMED
            with pytest.raises((EOFError, OSError)):
                _commit(sock, 2, 0, inside)  # the server dropped the connection
        sock, slots = _dial(ep)
        with sock:
            outside = Records.build([(base, page, 0, page, 1, page)], [np.array([256])])
            assert _commit(sock, 1, 0, outside) == Status.OUT_OF_BOUNDS
            assert _commit(sock, 2, 0, inside) == Status.OK  # scatters the (zero) slot
            assert _commit(sock, 3, len(slots), inside) == Status.MALFORMED  # not leased
        assert not dst.any()


@pytest.mark.parametrize("engine", engines())
def test_a_peer_without_slots_goes_direct(engine: str) -> None:
    """The receiver's arena is leased out to the first sender; the second gets no
    slot and sends its fragmented plans through the engine, still byte-exact."""
    tight = StagingConfig(slots=2, slots_per_peer=2)
    with make(engine, staging=tight) as r, make(engine) as s1, make(engine) as s2:
        p1, p2 = Pair(s1, r), Pair(s2, r)
        b1, b2 = p1.builder(1), p2.builder(2)
        plans = [(p1, b1, b1.plan("head_slice_gather")), (p2, b2, b2.plan("head_slice_gather"))]
        wants = [b.expected(p) for _, b, p in plans]
        peers = [pr.connect() for pr, _, _ in plans]
        assert isinstance(peers[1], EnginePeer) and peers[1].link is None
        for (pr, _, p), peer in zip(plans, peers, strict=True):
            h = pr.sender.submit(peer, p)
            assert pr.sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
        for (_, b, _), want in zip(plans, wants, strict=True):
            for (_, got), exp in zip(b.dsts, want, strict=True):
                assert np.array_equal(got, exp)
        assert _link(peers[0]).submitted == 1
        p1.close()
        p2.close()


@pytest.mark.parametrize("engine", engines())
def test_wrong_staging_token_fails_connect(engine: str) -> None:
    with make(engine) as a, make(engine) as b:
        ep = json.loads(b.endpoint())
        info = json.loads(ep["options"]["staging"])
        info["token"] = "0" * len(info["token"])
        ep["options"]["staging"] = json.dumps(info)
        with pytest.raises(ConnectError, match="staging"):
            a.connect(json.dumps(ep).encode())


@pytest.mark.parametrize("engine", engines())
def test_release_and_close_with_staged_work_in_flight(engine: str) -> None:
    """Handles released while staged work is queued fail TransferCancelled; closing the
    sender with work in flight fails what is left; no thread or fd outlives it."""
    threads0, fds0 = thread_count(), fd_count()
    with make(engine, staging=SMALL) as r:
        s = make(engine, staging=SMALL)
        pair = Pair(s, r)
        b = pair.builder(4)
        p = b.plan("tiny_many")
        peer = pair.connect()
        handles = [s.submit(peer, p) for _ in range(4)]
        handles[1].release()
        s.close()
        states = [h.wait(TIMEOUT) for h in handles]
        assert TransferState.PENDING not in states
        assert handles[1].state is TransferState.FAILED
    assert settle(thread_count, threads0) <= threads0
    assert settle(fd_count, fds0) <= fds0


@pytest.mark.parametrize("engine", engines())
def test_receiver_killed_mid_staged_transfer(engine: str) -> None:
    """A frozen, then killed, receiver: staged handles fail with PeerLost within the
    timeouts (the reply never comes), later staged submits fail too, nothing leaks."""
    resource_tracker.ensure_running()
    threads0, fds0 = thread_count(), fd_count()
    remote = RemotePeer(engine, 48 << 20)
    try:
        with make(engine) as sender:
            b = remote.builder(sender)
            p = Plan(entries=(b.pair(src_unit=4096, dst_unit=4096, cap=5000, n=5000,
                                     pieces=[[0, 0, 4096, 1, 4096, 4096]]),))  # 20 MB
            peer = sender.connect(remote.endpoint)
            h = sender.submit(peer, p)
            assert sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
            remote.stop()
            handles = [sender.submit(peer, p) for _ in range(3)]
            time.sleep(0.3)
            remote.kill()
            states = [sender.wait(x, TIMEOUT) for x in handles]
            assert states == [TransferState.FAILED] * 3
            for x in handles:
                assert isinstance(x.error, PeerLost), x.error
            assert _link(peer).submitted == 4
            later = sender.submit(peer, p)
            assert sender.wait(later, TIMEOUT) is TransferState.FAILED
            peer.close()
    finally:
        remote.kill()
    assert settle(thread_count, threads0) <= threads0
    assert settle(fd_count, fds0) <= fds0


# --- slots after a sender leaves: BYE, or quarantine ---------------------------------------

_BYE = Header(Kind.BYE, 0, 0, 0, 0).pack()
_HELLO = Header(Kind.HELLO, 0, 0, 0, 0).pack()  # after the handshake: lease me slots
_FOREVER = 600.0  # a quarantine no test outlives: slots held back stay held back


def _held(slots: int, quarantine: float) -> StagingConfig:
    """An arena of ``slots`` slots, all leased to the first sender."""
    return StagingConfig(slot_bytes=64 << 10, slots=slots, slots_per_peer=slots,
                         quarantine=quarantine)


def _arena(transport: Any) -> Arena:
    arena = transport._staging._arena
    assert isinstance(arena, Arena)
    return arena


def _lease_again(option: str, want: int, timeout: float) -> tuple[int, float]:
    """Dial until a HELLO leases ``want`` slots or ``timeout`` passes (each try says BYE,
    so what it got is free again at once): (slots leased last, when that reply came)."""
    deadline = time.monotonic() + timeout
    while True:
        sock, slots = _dial_option(option)
        at = time.monotonic()
        sock.sendall(_BYE)
        sock.close()
        if len(slots) >= want or at > deadline:
            return len(slots), at
        time.sleep(0.01)


def _option(endpoint: bytes) -> str:
    return str(json.loads(endpoint)["options"]["staging"])


@pytest.mark.parametrize("engine", engines())
@pytest.mark.parametrize("how", ["peer", "transport"])
def test_a_clean_close_says_bye_and_frees_the_slots_at_once(engine: str, how: str) -> None:
    """A sender that closes (its peer, or its whole transport) with no engine write in
    flight says BYE: the next sender is leased the whole arena again at once, although
    the receiver's quarantine would hold the slots back for minutes."""
    with make(engine, staging=_held(3, _FOREVER)) as r:
        s = make(engine, staging=SMALL)
        try:
            pair = Pair(s, r)
            peer = deliver(pair, "head_slice_gather")  # staged: the engine wrote into slots
            assert _link(peer).submitted == 1
            if how == "peer":
                peer.close()
            else:
                s.close()
            got, _ = _lease_again(_option(r.endpoint()), 3, timeout=10.0)  # BYE is async
            assert got == 3, "a clean close left the sender's slots out of the free list"
            assert _arena(r).quarantined == 0
        finally:
            s.close()


_CHILD = """
import json, socket, sys, time
from kvhandoff.transport.framing.served import prove
from kvhandoff.transport.framing.wire import HEADER, Header, Kind
info = json.loads(sys.argv[1])
s = socket.create_connection((info["host"], info["port"]), timeout=5)
prove(s, key=info["token"].encode(), endpoint_id=info["id"], timeout=5, peer="test")
s.settimeout(5)
s.sendall(Header(Kind.HELLO, 0, 0, 0, 0).pack())
buf = b""
while len(buf) < HEADER.size or len(buf) < HEADER.size + Header.unpack(buf[:HEADER.size]).desc_len:
    part = s.recv(65536)
    if not part:
        sys.exit(1)
    buf += part
print(len(json.loads(buf[HEADER.size:])["slots"]), flush=True)
time.sleep(60)
"""


def _vanish(option: str, end: str) -> tuple[int, float]:
    """A sender leases slots, then goes away without BYE: (how many it held, a time
    before it went, so before the receiver can have noticed)."""
    if end == "killed":  # a sender process killed outright (the kernel closes its socket)
        child = subprocess.Popen([sys.executable, "-c", _CHILD, option],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            ready, _, _ = select.select([child.stdout], [], [], 60)
            assert ready, "the sender process did not dial within 60 s"
            held = int(child.stdout.readline())
        finally:
            gone = time.monotonic()
            child.kill()
            child.wait(10)
            if child.stdout is not None:
                child.stdout.close()
        return held, gone
    sock, slots = _dial_option(option)
    if end == "reset":  # the connection is cut: RST, not FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    gone = time.monotonic()
    sock.close()
    return len(slots), gone


@pytest.mark.parametrize("engine", engines())
@pytest.mark.parametrize("end", ["closed", "reset", "killed"])
def test_slots_of_a_sender_gone_without_bye_are_quarantined(engine: str, end: str) -> None:
    """A sender leaves without BYE (closed, reset, killed): its slots are held back for
    the quarantine (a sender meanwhile gets none and goes direct, byte-exact), then
    leased again, lazily, by the next HELLO."""
    quarantine = 1.0
    with make(engine, staging=_held(3, quarantine)) as r, make(engine) as s:
        pair = Pair(s, r)
        b = pair.builder(5)
        p = b.plan("head_slice_gather")
        want = b.expected(p)
        option = _option(r.endpoint())
        held, gone = _vanish(option, end)  # the receiver starts the quarantine after gone
        assert held == 3
        arena = _arena(r)
        assert eventually(lambda: arena.quarantined == 3), "the slots were not quarantined"
        sock, slots = _dial_option(option)
        early = time.monotonic() < gone + quarantine
        sock.close()
        if early:
            assert slots == [], "a quarantined slot was leased"
        peer = pair.connect()
        if time.monotonic() < gone + quarantine:
            assert isinstance(peer, EnginePeer) and peer.link is None
        h = s.submit(peer, p)
        assert s.wait(h, TIMEOUT) is TransferState.DONE, h.error
        for (_, got), exp in zip(b.dsts, want, strict=True):
            assert np.array_equal(got, exp)
        got, at = _lease_again(option, 3, timeout=quarantine + 10.0)
        assert got == 3, "quarantined slots never came back"
        assert at >= gone + quarantine
        assert arena.quarantined == 0
        assert _link(deliver(pair, "head_slice_gather", seed=6)).submitted == 1
        pair.close()


class _FakePeer(Peer):
    @property
    def closed(self) -> bool:
        return False

    def close(self) -> None:
        pass


def _no_register(_region: Region) -> None:
    pass


def _unused(*_args: Any) -> Any:
    raise AssertionError("the receiver made an engine call")


def _receiver(table: RegionTable, slots: int) -> Staging:
    """A staging receiver without an engine (the control server is all there is)."""
    config = StagingConfig(slot_bytes=64 << 10, slots=slots, slots_per_peer=3,
                           quarantine=_FOREVER)
    return Staging("rx", config, register=_no_register, write=_unused,
                   wait=_unused, table=lambda: table, host="127.0.0.1", io_timeout=2.0,
                   connect_timeout=2.0)


@pytest.mark.parametrize("mode", ["done", "failed", "frozen"])
def test_the_sender_says_bye_only_when_no_engine_write_may_land(mode: str) -> None:
    """The sender's side of the rule, with a scripted engine: when every engine write it
    posted completed, closing says BYE (slots free at once); when one failed (as a
    transport close fails them, with the write maybe still running) or never completed,
    closing says nothing and the receiver quarantines the slots."""
    b, srcs, dsts = _host_builder(21)
    p = b.plan("pages_4k")
    want = b.expected(p)
    rx = _receiver(_table(dsts), slots=3)
    posted = threading.Event()

    def write(_peer: Peer, src: int, dst: int, n: int) -> Handle:
        h = Handle(nbytes=n, peer="rx")
        if mode == "done":
            ctypes.memmove(dst, src, n)
            h.set_done()
        elif mode == "failed":
            h.set_failed(PeerLost("scripted: the engine write failed"))
        posted.set()
        return h  # "frozen": never completes

    tx = Staging("tx", SMALL, register=_no_register, write=write,
                 wait=lambda h, t: h.wait(t), table=lambda: _table(srcs), host="127.0.0.1",
                 io_timeout=0.5, connect_timeout=2.0)
    try:
        option = dict(rx.advertise())[Staging.OPTION]
        arena = rx._arena
        assert arena is not None
        link = tx.connect({Staging.OPTION: option}, _FakePeer(b"", "rx"))
        assert link is not None
        h = link.submit(p)
        assert posted.wait(5)
        if mode == "done":
            assert h.wait(TIMEOUT) is TransferState.DONE, h.error
            for got, exp in zip(dsts, want, strict=True):
                assert np.array_equal(got, exp)
        link.close()  # "frozen": waits out io_timeout for the write, then gives up
        assert h.state is TransferState.FAILED or mode == "done"
        if mode == "done":
            got, _ = _lease_again(option, 3, timeout=10.0)
            assert got == 3 and arena.quarantined == 0
        else:
            assert eventually(lambda: arena.quarantined == 3), "no quarantine after an unsure write"
            assert _lease_again(option, 1, timeout=0.2)[0] == 0
    finally:
        tx.close()
        rx.close()


def _frames(data: bytes) -> list[tuple[Header, bytes]]:
    out = []
    while len(data) >= HEADER.size:
        h = Header.unpack(data[:HEADER.size])
        out.append((h, data[HEADER.size:HEADER.size + h.desc_len]))
        data = data[HEADER.size + h.desc_len:]
    return out


def _answer(sock: socket.socket) -> list[tuple[Header, bytes]]:
    """Every frame the server sends until it drops the connection (it must)."""
    out = b""
    while True:
        try:
            part = sock.recv(65536)
        except ConnectionResetError:
            break
        if not part:
            break
        out += part
    return _frames(out)


@pytest.mark.parametrize("case", ["before hello", "with description", "with payload",
                                  "with flags", "twice"])
def test_a_bye_out_of_place_is_refused(case: str) -> None:
    """BYE (after the handshake) from a sender never greeted by HELLO, or with anything
    in it: REPLY MALFORMED, the
    connection dropped and (if slots were leased) quarantined, not freed; the server
    goes on serving."""
    dst = np.zeros(1 << 16, np.uint8)
    base = int(dst.ctypes.data)
    rx = _receiver(_table([dst]), slots=8)
    try:
        option = dict(rx.advertise())[Staging.OPTION]
        arena = rx._arena
        assert arena is not None
        threads0 = thread_count()
        hello = _HELLO
        raw = {
            "before hello": _BYE,
            "with description": hello + Header(Kind.BYE, 0, 0, 4, 0).pack() + b"oops",
            "with payload": hello + Header(Kind.BYE, 0, 0, 0, 8).pack() + b"\0" * 8,
            "with flags": hello + Header(Kind.BYE, FLAG_CHECK, 0, 0, 0).pack(),
            "twice": _BYE + _BYE,  # the first is before HELLO already
        }[case]
        with _authed(option) as sock:
            sock.sendall(raw)
            frames = _answer(sock)
        assert frames, "the server said nothing"
        last, message = frames[-1]
        assert last.kind is Kind.REPLY and last.code == Status.MALFORMED, (last, message)
        greeted = raw.startswith(hello)
        assert len(frames) == 1 + greeted
        if greeted:
            assert eventually(lambda: arena.quarantined == 3), "a malformed BYE freed the slots"
        else:
            assert arena.quarantined == 0
        sock, slots = _dial_option(option)  # still serving
        with sock:
            assert len(slots) == 3
            page = Records.build([(base, 4096, 0, 4096, 1, 4096)], [np.array([1])])
            assert _commit(sock, 1, 0, page) == Status.OK
            sock.sendall(_BYE)
            assert _answer(sock) == [], "BYE has no reply"
        assert eventually(lambda: arena.quarantined == 3 * greeted)  # that BYE freed its slots
        assert settle(thread_count, threads0) <= threads0
    finally:
        rx.close()


def test_tcp_refuses_a_bye_frame() -> None:
    """BYE is a staging control frame: the tcp server treats it as any unexpected kind
    (REPLY MALFORMED, connection dropped) and goes on serving. (Before the handshake no
    frame is read at all: see test_tcp_wire.)"""
    with TcpTransport(io_timeout=2.0) as r, TcpTransport() as s:
        r.allocate(1 << 16)
        ep = r.endpoint()
        with _authed(ep.decode()) as sock:
            sock.sendall(_BYE)
            frames = _answer(sock)
        assert len(frames) == 1
        last, message = frames[-1]
        assert last.kind is Kind.REPLY and last.code == Status.MALFORMED
        assert b"BYE" in message
        deliver(Pair(s, r), "pages_4k").close()


# --- the numpy pieces, no engine ----------------------------------------------------------


def _host_builder(seed: int) -> tuple[PlanBuilder, list[np.ndarray], list[np.ndarray]]:
    srcs: list[np.ndarray] = []
    dsts: list[np.ndarray] = []

    def src(n: int) -> np.ndarray:
        srcs.append(np.zeros(n, np.uint8))
        return srcs[-1]

    def dst(n: int) -> tuple[int, np.ndarray]:
        dsts.append(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8))
        return int(dsts[-1].ctypes.data), dsts[-1]

    return PlanBuilder(np.random.default_rng(seed), src, dst), srcs, dsts


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("frame", [4096, 1 << 20])
def test_gather_then_scatter_is_the_executor(kind: str, frame: int) -> None:
    """Every frame gathered on one side and scattered from the bytes on the other
    reproduces the planner's executor."""
    b, srcs, dsts = _host_builder(11)
    p = b.plan(kind)
    want = b.expected(p)
    src_table = _table(srcs)
    dst_table = _table(dsts)
    buf = np.empty(frame, np.uint8)
    for chunks in split(p, frame):
        n = gather(chunks, src_table, buf)
        assert n == sum(c.nbytes for c in chunks) <= frame
        records = dst_records(chunks)
        assert records.problem(dst_table) is None
        scatter(records, dst_table, buf[:n])
    for got, exp in zip(dsts, want, strict=True):
        assert np.array_equal(got, exp)


def _table(bufs: list[np.ndarray]) -> RegionTable:
    return RegionTable((Region(ptr=int(a.ctypes.data), nbytes=a.nbytes), a)
                       for a in bufs if a.nbytes)


@pytest.mark.parametrize("kind", KINDS)
def test_segment_estimate_bounds_the_coalesced_count(kind: str) -> None:
    b, _, _ = _host_builder(12)
    p = b.plan(kind)
    segs = p.coalesce()
    assert p.num_segments >= estimate_segments(p) >= int((segs.length > 0).sum())


def test_estimate_is_exact_for_whole_pages() -> None:
    e = TensorPlan(component="kv", tensor="k", layer_id=0, src_ptr=0, dst_ptr=1 << 20,
                   src_unit=4096, dst_unit=4096, src_idx=np.array([1, 2, 3, 7, 9, 10]),
                   dst_idx=np.array([5, 6, 7, 0, 2, 4]),
                   pieces=np.array([[0, 0, 4096, 1, 4096, 4096]]))
    assert estimate_segments(Plan(entries=(e,))) == len(Plan(entries=(e,)).coalesce()) == 4


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        StagingConfig(slot_bytes=10)
    with pytest.raises(ValueError):
        StagingConfig(slots_per_peer=0)
