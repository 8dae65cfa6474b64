"""What only the cma transport has to prove, beyond the shared suite: the kernel's
refusal is a clear connect error; a hostile sender's descriptors are refused on both
sides before anything is copied; partial copies and iovec batching through the real
syscall; registrations after connect on both sides; and no copy after ``close``."""

from __future__ import annotations

import ctypes
import json
import mmap
import multiprocessing as mp
import os
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from kvh_conformance import Pair, connect_undumpable, make, serve_as_nobody

from kvhandoff.lab.testing.transport import noise
from kvhandoff.plan.model import Plan
from kvhandoff.transport import (
    ConnectError,
    TransferFailed,
    TransferState,
    TransportClosed,
    available_transports,
)
from kvhandoff.transport.cma import server as cma_server
from kvhandoff.transport.cma.frames import encode_hello
from kvhandoff.transport.cma.kernel import IOV, process_vm_readv
from kvhandoff.transport.cma.transport import CmaEndpoint
from kvhandoff.transport.framing.handshake import derive_key
from kvhandoff.transport.framing.io import FrameReader, recv_exact
from kvhandoff.transport.framing.served import prove, recv_reply
from kvhandoff.transport.framing.wire import Header, Kind, Records, Status

pytestmark = pytest.mark.skipif(not available_transports()["cma"].ok,
                                reason=f"cma: {available_transports()['cma'].reason}")
TIMEOUT = 30.0


@pytest.fixture
def cma() -> Iterator[Pair]:
    with make("cma") as sender, make("cma") as receiver:
        p = Pair(sender, receiver)
        yield p
        p.close()


# --- the kernel says no ------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a receiver as another "
                                              "user (test_undumpable_sender covers non-root)")
def test_a_receiver_of_another_user_is_refused_at_connect() -> None:
    """The receiver runs as ``nobody``; this process (root) is the sender. The kernel
    forbids the read, so ``connect`` fails naming the users and the fix, before any
    request."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=serve_as_nobody, args=(child, "cma", 1 << 20, 1), daemon=True)
    proc.start()
    child.close()
    try:
        assert conn.poll(60), "the receiver did not start"
        endpoint, _ = conn.recv()
        with make("cma") as sender:
            sender.register(np.zeros(4096, np.uint8))
            with pytest.raises(ConnectError) as e:
                sender.connect(endpoint)
        msg = str(e.value)
        assert "refused this sender" in msg and "EPERM" in msg, msg
        assert "uid 0)" in msg and "uid 65534" in msg and "different users" in msg, msg
        assert "CAP_SYS_PTRACE" in msg and "tcp" in msg, msg
    finally:
        proc.kill()
        proc.join(10)
        conn.close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads non-dumpable processes anyway "
                                              "(CAP_SYS_PTRACE); the nobody test covers root")
def test_undumpable_sender_is_refused_at_connect() -> None:
    ctx = mp.get_context("spawn")
    with make("cma") as receiver:
        receiver.allocate(4096)
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=connect_undumpable, args=(child, "cma", receiver.endpoint()),
                           daemon=True)
        proc.start()
        try:
            assert conn.poll(60), "the sender did not answer"
            got = conn.recv()
        finally:
            proc.kill()
            proc.join(10)
    assert got.startswith("ConnectError") and "EPERM" in got and "non-dumpable" in got, got


def test_a_peer_on_another_host_is_refused_by_name(cma: Pair) -> None:
    ep = json.loads(cma.receiver.endpoint())
    ep["host"] = ["another-boot-id", ep["host"][1]]
    with pytest.raises(ConnectError, match="another machine"):
        cma.sender.connect(json.dumps(ep).encode())
    ep["host"] = [json.loads(cma.receiver.endpoint())["host"][0], "net:[1]"]
    with pytest.raises(ConnectError, match="another network namespace"):
        cma.sender.connect(json.dumps(ep).encode())


# --- a hostile sender ----------------------------------------------------------------------


class RawSender:
    """A sender that speaks the wire by hand after a genuine handshake (it holds the
    key): what a buggy or hostile authenticated peer can send."""

    def __init__(self, endpoint: bytes, regions: list[tuple[int, int]]) -> None:
        ep = CmaEndpoint.parse(endpoint)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect("\0" + ep.address)
        prove(self.sock, key=derive_key(ep.token.encode(), None), endpoint_id=ep.id,
              timeout=10, peer="receiver")
        self.reader = FrameReader(self.sock)
        self.probe = np.frombuffer(os.urandom(16), np.uint8).copy()
        self.regions = regions
        self.seq = 0

    def frame(self, kind: Kind, desc: bytes) -> tuple[Status, str]:
        self.seq += 1
        self.sock.sendall(Header(kind, 0, self.seq, len(desc), 0).pack() + desc)
        got = recv_reply(self.reader, "receiver", lambda: None, 10)
        assert got is not None, "no reply"
        return Status(got[0].code), got[1]

    def hello(self) -> tuple[Status, str]:
        return self.frame(Kind.HELLO, encode_hello(int(self.probe.ctypes.data),
                                                   self.probe.tobytes(), self.regions))

    def write(self, src: tuple[int, ...], dst: tuple[int, ...], idx: list[int]) -> tuple[
            Status, str]:
        """One record pair: ``(ptr, unit, off, length, count, stride)`` on each side."""
        units = [np.array(idx, np.int64)] * 2
        return self.frame(Kind.WRITE, Records.build([src, dst], units).encode())  # type: ignore[list-item]

    def closed(self) -> bool:
        try:
            recv_exact(self.sock, memoryview(bytearray(1)))
        except EOFError:
            return True
        return False


@pytest.fixture
def hostile() -> Iterator[tuple[RawSender, np.ndarray, np.ndarray, np.ndarray]]:
    """A receiver with one registered destination; a raw sender that declared ``src``
    as its only region; ``secret``: memory of the sender it did not declare."""
    with make("cma") as receiver:
        dst = receiver.allocate(1 << 16)
        dst[:] = noise(np.random.default_rng(1), len(dst))
        src = noise(np.random.default_rng(2), 1 << 16)
        secret = noise(np.random.default_rng(3), 1 << 16)
        raw = RawSender(receiver.endpoint(), [(int(src.ctypes.data), src.nbytes)])
        try:
            assert raw.hello() == (Status.OK, "")
            yield raw, src, dst, secret
        finally:
            raw.sock.close()


def test_in_bounds_descriptors_are_pulled(hostile: tuple[RawSender, np.ndarray, np.ndarray,
                                                         np.ndarray]) -> None:
    raw, src, dst, _ = hostile
    status, msg = raw.write((int(src.ctypes.data), 4096, 0, 4096, 1, 4096),
                            (int(dst.ctypes.data), 4096, 0, 4096, 1, 4096), [3, 5])
    assert status is Status.OK, msg
    assert np.array_equal(dst[3 * 4096:6 * 4096].reshape(3, -1)[[0, 2]],
                          src[3 * 4096:6 * 4096].reshape(3, -1)[[0, 2]])


@pytest.mark.parametrize("where", ["past_the_end", "elsewhere", "beyond_2_62"])
def test_out_of_bounds_destinations_are_refused(
        hostile: tuple[RawSender, np.ndarray, np.ndarray, np.ndarray], where: str) -> None:
    raw, src, dst, _ = hostile
    before = dst.copy()
    base = {"past_the_end": int(dst.ctypes.data), "elsewhere": int(src.ctypes.data),
            "beyond_2_62": 1 << 62}[where]
    idx = [16] if where == "past_the_end" else [0]  # unit 16 of 4 KiB: one past the end
    status, msg = raw.write((int(src.ctypes.data), 4096, 0, 4096, 1, 4096),
                            (base, 4096, 0, 4096, 1, 4096), idx)
    assert status is Status.OUT_OF_BOUNDS and "destination" in msg, msg
    assert np.array_equal(dst, before), "a refused write changed the receiver's memory"
    # the connection stays usable
    assert raw.write((int(src.ctypes.data), 64, 0, 64, 1, 64),
                     (int(dst.ctypes.data), 64, 0, 64, 1, 64), [0])[0] is Status.OK


def test_sources_outside_the_declared_regions_are_refused(
        hostile: tuple[RawSender, np.ndarray, np.ndarray, np.ndarray]) -> None:
    """A sender may not make the receiver read memory it did not declare (here: memory
    that is really there, in the same process)."""
    raw, _, dst, secret = hostile
    before = dst.copy()
    status, msg = raw.write((int(secret.ctypes.data), 4096, 0, 4096, 1, 4096),
                            (int(dst.ctypes.data), 4096, 0, 4096, 1, 4096), [0, 1])
    assert status is Status.OUT_OF_BOUNDS and "source bytes" in msg, msg
    assert "sender's registered memory" in msg
    assert np.array_equal(dst, before)


def test_unpaired_descriptors_drop_the_connection(
        hostile: tuple[RawSender, np.ndarray, np.ndarray, np.ndarray]) -> None:
    raw, src, dst, _ = hostile
    before = dst.copy()
    status, msg = raw.write((int(src.ctypes.data), 4096, 0, 4096, 1, 4096),
                            (int(dst.ctypes.data), 4096, 0, 2048, 2, 2048), [0])
    assert status is Status.MALFORMED and "differ" in msg, msg
    assert raw.closed()
    assert np.array_equal(dst, before)


def test_a_connection_must_open_with_a_probe() -> None:
    with make("cma") as receiver:
        dst = receiver.allocate(4096)
        raw = RawSender(receiver.endpoint(), [])
        try:
            status, msg = raw.write((0, 64, 0, 64, 1, 64), (int(dst.ctypes.data), 64, 0, 64, 1,
                                                             64), [0])
            assert status is Status.MALFORMED and "opens with HELLO" in msg
            assert raw.closed()
        finally:
            raw.sock.close()
        raw = RawSender(receiver.endpoint(), [])
        try:  # a probe at an address that holds other bytes: not the sending process
            raw.probe = np.zeros(16, np.uint8)
            other = encode_hello(int(raw.probe.ctypes.data), b"\1" * 16, [])
            status, msg = raw.frame(Kind.HELLO, other)
            assert status is Status.REFUSED and "not the sending process" in msg, msg
        finally:
            raw.sock.close()


# --- the real syscall: partial copies and batches ---------------------------------------------


@pytest.mark.parametrize("pages", [3, 4096])
def test_a_source_page_that_faults_fails_the_transfer_after_a_partial_copy(
        cma: Pair, pages: int) -> None:
    """Registered source pages with one unreadable (PROT_NONE) in the middle: the kernel
    copies up to it and stops (a partial copy); the retry faults; the transfer fails
    naming the cause. Three pages: one syscall, the first page landed, the last not.
    4096 pages (16 MiB): shared by the copy threads; the part that faults names the
    cause, and the other stops."""
    page = mmap.PAGESIZE
    mm = mmap.mmap(-1, pages * page)
    src = np.frombuffer(mm, np.uint8)
    src[:] = noise(np.random.default_rng(4), len(src))
    libc = ctypes.CDLL(None, use_errno=True)
    addr = int(src.ctypes.data)
    bad = addr + (pages // 2 + 1) * page
    assert libc.mprotect(ctypes.c_void_p(bad), page, 0) == 0  # PROT_NONE
    try:
        cma.sender.register(src)
        dst = cma.receiver.allocate(pages * page)
        want_first = src[:page].copy()
        n = pages * page
        e = cma.builder().pair(src_unit=n, dst_unit=n, cap=1, n=1,
                               pieces=[[0, 0, n, 1, n, n]])
        e = type(e)(**{**e.__dict__, "src_ptr": addr, "dst_ptr": int(dst.ctypes.data),
                       "src_idx": np.zeros(1, np.int64), "dst_idx": np.zeros(1, np.int64)})
        h = cma.sender.submit(cma.connect(), Plan(entries=(e,)))
        assert cma.sender.wait(h, TIMEOUT) is TransferState.FAILED
        assert isinstance(h.error, TransferFailed) and "EFAULT" in str(h.error), h.error
        if pages == 3:
            assert np.array_equal(dst[:page], want_first)
            assert not dst[2 * page:].any()
    finally:
        libc.mprotect(ctypes.c_void_p(bad), page, 3)  # readable again, to unmap
        del src


class Syscalls:
    """Wraps the real ``process_vm_readv`` on the receiving side: records each call's
    iovec counts, optionally copies at most ``limit`` bytes per call (a partial copy
    through the real kernel), optionally blocks one call until released."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.widths: list[int] = []
        self.after_close = 0
        self.closed = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self.hold: int | None = None

    def __call__(self, pid: int, local: IOV, remote: IOV) -> int:
        self.widths.append(max(len(local), len(remote)))
        self.after_close += self.closed
        if self.hold is not None and len(self.widths) == self.hold:
            self.entered.set()
            self.release.wait(TIMEOUT)
        if self.limit is not None:
            local, remote = _first(local, self.limit), _first(remote, self.limit)
        return process_vm_readv(pid, local, remote)


def _through(monkeypatch: pytest.MonkeyPatch, calls: Syscalls) -> None:
    """Every pull of receivers made from now on goes through ``calls``: the copy that
    keeps the GIL (small windows) and the one that releases it (large ones)."""
    monkeypatch.setattr(cma_server, "process_vm_readv", calls)
    monkeypatch.setattr(cma_server, "process_vm_readv_held", calls)


def _first(rows: IOV, n: int) -> IOV:
    """The iovecs of the first ``n`` bytes of ``rows``."""
    ends = np.cumsum(rows[:, 1].astype(np.int64))
    k = int(np.searchsorted(ends, n, side="left"))
    out = rows[:k + 1].copy()
    out[-1, 1] -= int(ends[min(k, len(ends) - 1)]) - n if ends[-1] > n else 0
    return out


PAGE = 1024


def _hand_off_pages(cma: Pair, seed: int, pages: int) -> None:
    """Hand off ``pages`` scattered 1 KiB pages; they land byte-exact."""
    b = cma.builder(seed)
    p = Plan(entries=(b.pair(src_unit=PAGE, dst_unit=PAGE, cap=6000, n=pages,
                             pieces=[[0, 0, PAGE, 1, PAGE, PAGE]]),))
    want = b.expected(p)
    h = cma.sender.submit(cma.connect(), p)
    assert cma.sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
    assert np.array_equal(b.dsts[0][1], want[0])


@pytest.mark.parametrize("limit", [None, 10000])
@pytest.mark.parametrize("pages", [1500, 5000])
def test_iovec_batches_and_partial_copies_through_the_kernel(
        cma: Pair, monkeypatch: pytest.MonkeyPatch, limit: int | None, pages: int) -> None:
    """Scattered 1 KiB pages: every call takes at most 1024 iovecs a side; with ``limit``
    the kernel is made to copy at most 10000 B per call (partial copies), and every byte
    still lands. 1500 pages: built as one window when checked, pulled by the copier in
    two calls; 5000: the copier's windows."""
    calls = Syscalls(limit)
    _through(monkeypatch, calls)
    _hand_off_pages(cma, 6, pages)
    assert max(calls.widths) <= 1024
    assert len(calls.widths) >= (pages * PAGE // limit if limit else -(-pages // 1024))


@pytest.mark.parametrize("pages", [64, 3000])
def test_small_windows_keep_the_gil_and_large_ones_release_it(
        cma: Pair, monkeypatch: pytest.MonkeyPatch, pages: int) -> None:
    """A window of at most ``HELD_MAX`` is pulled by the call that keeps the GIL (no
    wait to get it back from a busy engine); a larger one by the releasing call."""
    held, released = Syscalls(None), Syscalls(None)
    monkeypatch.setattr(cma_server, "process_vm_readv_held", held)
    monkeypatch.setattr(cma_server, "process_vm_readv", released)
    _hand_off_pages(cma, 8, pages)
    small = pages * PAGE <= cma_server.HELD_MAX
    assert (len(held.widths) > 0) == small and (sum(released.widths) > 1) == (not small), (
        held.widths, released.widths)


def test_registrations_after_connect_are_seen_on_both_sides(cma: Pair) -> None:
    """The receiver checks its live registrations; the sender sends its new regions
    before the first write that needs them."""
    peer = cma.connect()
    b = cma.builder(7)
    p = b.plan("pages_4k")  # registers a new source and a new destination, after connect
    want = b.expected(p)
    h = cma.sender.submit(peer, p)
    assert cma.sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
    assert np.array_equal(b.dsts[0][1], want[0])


def test_no_copy_starts_after_close_returns(cma: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 64 MiB pull is held inside its second syscall while the sender closes its peer;
    the receiver sees the sender hang up and stops between batches, and ``close``
    waits for it: no syscall of the transfer starts once ``close`` has returned, and the
    handle ends FAILED (TransportClosed) or, had the copy won the race, DONE. (Where
    the copy stops is a race; that none starts after ``close`` is not.)"""
    calls = Syscalls()
    calls.hold = 2
    _through(monkeypatch, calls)
    b = cma.builder(8)
    p = Plan(entries=(b.pair(src_unit=256 << 10, dst_unit=256 << 10, cap=256, n=256,
                             pieces=[[0, 0, 256 << 10, 1, 256 << 10, 256 << 10]]),))
    peer = cma.connect()
    h = cma.sender.submit(peer, p)
    assert calls.entered.wait(TIMEOUT)
    closer = threading.Thread(target=peer.close)
    closer.start()
    calls.release.set()
    closer.join(TIMEOUT)
    assert not closer.is_alive()
    calls.closed = True
    assert cma.sender.wait(h, TIMEOUT) is not TransferState.PENDING
    assert h.state is TransferState.DONE or isinstance(h.error, TransportClosed), h.error
    cma.peer = None
    assert calls.after_close == 0


def test_a_sender_that_outruns_the_copier_is_held_back_by_the_socket(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While the copier is busy the receiver queues at most QUEUE_BYTES of descriptors
    (here: one frame), then stops reading: a sender that keeps sending blocks on its
    socket instead of growing the receiver's memory. Once the copier goes on, every
    frame is served, in order."""
    calls = Syscalls()
    calls.hold = 2  # the first pull (the first call reads the connect's probe)
    _through(monkeypatch, calls)
    monkeypatch.setattr(cma_server, "QUEUE_BYTES", 1)
    conns: list[cma_server._Connection] = []
    init = cma_server._Connection.__init__

    def spy(self: cma_server._Connection, *a: object) -> None:
        init(self, *a)  # type: ignore[arg-type]
        conns.append(self)

    monkeypatch.setattr(cma_server._Connection, "__init__", spy)
    with make("cma") as receiver:
        units, size, frames = 6000, 64, 200  # 6000 segments: not small, so queued
        dst = receiver.allocate(units * size)
        src = noise(np.random.default_rng(5), units * size)
        raw = RawSender(receiver.endpoint(), [(int(src.ctypes.data), src.nbytes)])
        try:
            assert raw.hello() == (Status.OK, "")
            idx = np.arange(units, dtype=np.int64)
            table = Records.build([(int(src.ctypes.data), size, 0, size, 1, size),
                                   (int(dst.ctypes.data), size, 0, size, 1, size)],
                                  [idx, idx]).encode()  # ~96 KB: 200 frames ~19 MB
            raw.sock.settimeout(TIMEOUT)
            sender = threading.Thread(target=lambda: [raw.sock.sendall(
                Header(Kind.WRITE, 0, k, len(table), 0).pack() + table)
                for k in range(2, frames + 2)], daemon=True)
            sender.start()
            assert calls.entered.wait(TIMEOUT)
            (conn,) = conns
            assert conn.held_back.wait(TIMEOUT), "the receiver never stopped reading"
            assert conn._queued <= 2 and sender.is_alive()  # the rest waits in the socket
            calls.hold = None
            calls.release.set()
            for seq in range(2, frames + 2):
                got = recv_reply(raw.reader, "receiver", lambda: None, TIMEOUT)
                assert got is not None and got[0].seq == seq and got[0].code == Status.OK, got
            sender.join(TIMEOUT)
            assert np.array_equal(dst, src)
        finally:
            raw.sock.close()
