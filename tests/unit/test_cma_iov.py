"""The cma transport's pure core: paired records → iovec windows and batches → pulls,
against the numpy executor, with a stand-in syscall that checks the kernel's limits,
copies partially, refuses or is interrupted; and the frames' parsers against hostile
input."""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.lab.testing.transport import KINDS, PlanBuilder
from kvhandoff.plan.model import Plan
from kvhandoff.transport.cma import iov
from kvhandoff.transport.cma.frames import (
    MAX_REGIONS,
    decode_hello,
    decode_moved,
    decode_write,
    encode_hello,
    encode_moved,
    encode_write,
)
from kvhandoff.transport.cma.kernel import IOV, IOV_MAX, iovecs, process_vm_readv
from kvhandoff.transport.errors import ProtocolError
from kvhandoff.transport.framing.wire import Records


class FakeReadV:
    """``process_vm_readv`` in Python, within this process: asserts the kernel's limits
    (at most ``max_iov`` rows a side, equal totals), copies at most ``limit`` bytes per
    call (a partial copy), and counts calls."""

    def __init__(self, max_iov: int = IOV_MAX, limit: int | None = None) -> None:
        self.max_iov, self.limit = max_iov, limit
        self.calls = 0
        self.widest = 0

    def __call__(self, pid: int, local: IOV, remote: IOV) -> int:
        assert pid == os.getpid()
        assert 0 < len(local) <= self.max_iov and 0 < len(remote) <= self.max_iov
        assert int(local[:, 1].sum()) == int(remote[:, 1].sum())
        self.calls += 1
        self.widest = max(self.widest, len(local), len(remote))
        budget = int(local[:, 1].sum()) if self.limit is None else self.limit
        loc = [[int(a), int(n)] for a, n in local.tolist()]
        rem = [[int(a), int(n)] for a, n in remote.tolist()]
        i = j = done = 0
        while done < budget and i < len(loc) and j < len(rem):
            n = min(loc[i][1], rem[j][1], budget - done)
            ctypes.memmove(loc[i][0], rem[j][0], n)  # both addresses are in this process
            done += n
            loc[i] = [loc[i][0] + n, loc[i][1] - n]
            rem[j] = [rem[j][0] + n, rem[j][1] - n]
            i += loc[i][1] == 0
            j += rem[j][1] == 0
        return done


def _builder(seed: int) -> PlanBuilder:
    def src(n: int) -> np.ndarray:
        return np.empty(n, np.uint8)

    def dst(n: int) -> tuple[int, np.ndarray]:
        a = np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8)
        return int(a.ctypes.data), a

    return PlanBuilder(np.random.default_rng(seed), src, dst)


def _run(plan: Plan, readv: object, *, window: int = iov.WINDOW,
         batch_bytes: int = iov.BATCH_BYTES, max_iov: int = IOV_MAX) -> int:
    """Pull ``plan`` within this process as the receiver would; returns the windows."""
    src, dst = decode_write(encode_write(plan))
    n = 0
    for local, remote in iov.windows(src, dst, window):
        assert local.nbytes == remote.nbytes
        iov.pull(readv, os.getpid(), local, remote, 0, local.nbytes,  # type: ignore[arg-type]
                 stop=lambda: None, batch_bytes=batch_bytes, max_iov=max_iov)
        n += 1
    return n


@pytest.mark.parametrize("kind", KINDS)
def test_every_plan_shape_is_byte_exact_with_the_real_syscall(kind: str) -> None:
    b = _builder(1)
    p = b.plan(kind)
    want = b.expected(p)
    _run(p, process_vm_readv)
    for i, ((_, got), exp) in enumerate(zip(b.dsts, want, strict=True)):
        assert np.array_equal(got, exp), f"{kind}: destination {i} differs"


_SHAPES = [k for k in KINDS if k not in ("huge", "empty", "tiny_many", "mixed")]  # fast ones


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(_SHAPES), seed=st.integers(0, 1000), window=st.integers(1, 5000),
       batch=st.integers(4096, 1 << 20), max_iov=st.integers(1, 40),
       limit=st.one_of(st.none(), st.integers(1000, 70000)))
def test_windows_batches_and_partial_copies_keep_every_byte(
        kind: str, seed: int, window: int, batch: int, max_iov: int, limit: int | None) -> None:
    """Whatever the window, batch and iovec limits, and however little the kernel copies
    per call, the destination ends exactly as the numpy executor leaves it."""
    b = _builder(seed)
    p = b.plan(kind)
    want = b.expected(p)
    fake = FakeReadV(max_iov, limit)
    _run(p, fake, window=window, batch_bytes=batch, max_iov=max_iov)
    for (_, got), exp in zip(b.dsts, want, strict=True):
        assert np.array_equal(got, exp)
    assert fake.widest <= max_iov


def test_no_call_exceeds_iov_max_and_long_streams_are_batched() -> None:
    """5000 scattered 1 KiB pages (5000 iovecs a side): several calls of at most 1024."""
    b = _builder(2)
    page = 1024
    p = Plan(entries=(b.pair(src_unit=page, dst_unit=page, cap=6000, n=5000,
                             pieces=[[0, 0, page, 1, page, page]]),))
    want = b.expected(p)
    fake = FakeReadV()
    _run(p, fake)
    assert fake.widest == IOV_MAX and fake.calls >= 5
    assert np.array_equal(b.dsts[0][1], want[0])


def test_contiguous_runs_merge_on_each_side_on_its_own() -> None:
    """Whole source pages into head-sliced destination rows: one remote iovec per run
    of adjacent source pages, one local iovec per row."""
    b = _builder(3)
    rows, half = 16, 256
    e = b.pair(src_unit=rows * half, dst_unit=2 * rows * half, cap=8, n=8,
               pieces=[[0, half, half, rows, half, 2 * half]])
    e = type(e)(**{**e.__dict__, "src_idx": np.arange(8, dtype=np.int64)})
    src, dst = decode_write(encode_write(Plan(entries=(e,))))
    (local, remote), = list(iov.windows(src, dst))
    assert len(remote.rows) == 1 and len(local.rows) == 8 * rows


def test_a_huge_unit_is_pulled_in_bounded_windows() -> None:
    """One unit of 70000 strided rows: no window holds more than about ``window``
    segments a side (a peer cannot make the receiver build arrays of any size)."""
    b = _builder(4)
    p = b.plan("huge")
    want = b.expected(p)
    src, dst = decode_write(encode_write(p))
    sizes = []
    for local, remote in iov.windows(src, dst, window=1000):
        sizes.append(max(len(local.rows), len(remote.rows)))
        iov.pull(process_vm_readv, os.getpid(), local, remote, 0, local.nbytes,
                 stop=lambda: None)
    assert len(sizes) >= 70 and max(sizes) <= 2000
    for (_, got), exp in zip(b.dsts, want, strict=True):
        assert np.array_equal(got, exp)


def _one_window(kind: str = "pages_4k") -> tuple[PlanBuilder, iov.Side, iov.Side]:
    b = _builder(5)
    src, dst = decode_write(encode_write(b.plan(kind)))
    (local, remote), = list(iov.windows(src, dst))
    return b, local, remote


def test_a_refusal_fails_the_copy_naming_the_errno() -> None:
    _, local, remote = _one_window()
    calls = [0]

    def refuse(pid: int, loc: IOV, rem: IOV) -> int:
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.EPERM, os.strerror(errno.EPERM))
        return int(loc[:, 1].sum())

    with pytest.raises(iov.CopyFailed) as e:
        iov.pull(refuse, 1, local, remote, 0, local.nbytes, stop=lambda: None,
                 batch_bytes=64 << 10)
    assert e.value.error is not None and e.value.error.errno == errno.EPERM
    assert e.value.copied == 64 << 10  # the first batch landed


def test_no_progress_fails_instead_of_spinning() -> None:
    _, local, remote = _one_window()
    with pytest.raises(iov.CopyFailed, match="copied 0"):
        iov.pull(lambda *a: 0, 1, local, remote, 0, local.nbytes, stop=lambda: None)


def test_an_interrupted_call_is_retried() -> None:
    _, local, remote = _one_window()
    fake, raised = FakeReadV(), [False]

    def interrupted(pid: int, loc: IOV, rem: IOV) -> int:
        if not raised[0]:
            raised[0] = True
            raise OSError(errno.EINTR, "interrupted")
        return fake(pid, loc, rem)

    iov.pull(interrupted, os.getpid(), local, remote, 0, local.nbytes, stop=lambda: None)
    assert raised[0] and fake.calls >= 1


def test_stop_is_asked_before_every_batch() -> None:
    _, local, remote = _one_window()
    fake, asked = FakeReadV(), [0]

    def stop() -> str | None:
        asked[0] += 1
        return "the sender closed the connection" if asked[0] > 3 else None

    with pytest.raises(iov.Stopped, match="sender closed"):
        iov.pull(fake, os.getpid(), local, remote, 0, local.nbytes, stop=stop,
                 batch_bytes=64 << 10)
    assert fake.calls == 3


# --- frames ---------------------------------------------------------------------------


def test_hello_round_trip() -> None:
    body = encode_hello(0x1000, b"0123456789abcdef", [(0x10000, 4096), (0x40000, 64)])
    h = decode_hello(body)
    assert (h.probe_addr, h.probe) == (0x1000, b"0123456789abcdef")
    assert h.regions.describe() == [(0x10000, 4096), (0x40000, 64)]


@pytest.mark.parametrize(("body", "why"), [
    (b"", "too short"),
    (encode_hello(1, b"x" * 65, []), "probe"),
    (encode_hello(1, b"", [(1, 2)])[:-1], "declares"),
    (encode_hello(1, b"", [(1, 2)]) + b"\0" * 16, "declares"),
    (encode_hello(1, b"", [(-5, 2)]), "negative"),
    (encode_hello(1, b"", [(100, 50), (120, 50)]), "overlap"),
])
def test_malformed_hellos_are_refused(body: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        decode_hello(body)


def test_a_hello_cannot_declare_unbounded_regions() -> None:
    body = bytearray(encode_hello(1, b"", []))
    body[-8:] = (MAX_REGIONS + 1).to_bytes(8, "little")
    with pytest.raises(ProtocolError, match="regions"):
        decode_hello(bytes(body))


def test_write_halves_must_pair_up() -> None:
    idx = [np.array([0, 1], np.int64)]
    row = (4096, 64, 0, 64, 1, 64)
    odd = Records.build([row], idx).encode()
    with pytest.raises(ProtocolError, match="pair up"):
        decode_write(odd)
    other = Records.build([row, (8192, 64, 0, 32, 1, 32)], idx * 2).encode()
    with pytest.raises(ProtocolError, match="record 0"):
        decode_write(other)
    units = Records.build([row, row], [idx[0], np.array([3], np.int64)]).encode()
    with pytest.raises(ProtocolError, match="number of units"):
        decode_write(units)


def test_the_real_syscall_in_this_process() -> None:
    """Reading oneself needs no ptrace rights: the probe ``usable()`` makes."""
    a = np.arange(64, dtype=np.uint8)
    b = np.zeros(64, np.uint8)
    n = process_vm_readv(os.getpid(), iovecs([(b.ctypes.data, 64)]),
                         iovecs([(a.ctypes.data, 64)]))
    assert n == 64 and np.array_equal(a, b)


def test_short_scattered_sources_are_pulled_in_source_order() -> None:
    """A permutation of 4 KiB pages: the window's remote side is the source pages in
    address order, merged into one iovec; the local side stays page by page."""
    b = _builder(10)
    page, n = 4096, 512
    e = b.pair(src_unit=page, dst_unit=page, cap=n, n=n, pieces=[[0, 0, page, 1, page, page]])
    want = b.expected(Plan(entries=(e,)))
    src, dst = decode_write(encode_write(Plan(entries=(e,))))
    (local, remote), = list(iov.windows(src, dst))
    assert len(remote.rows) == 1 and len(local.rows) > n // 2
    iov.pull(process_vm_readv, os.getpid(), local, remote, 0, local.nbytes, stop=lambda: None)
    assert np.array_equal(b.dsts[0][1], want[0])


def test_a_small_table_with_a_huge_row_count_is_left_to_the_windows() -> None:
    """One unit of four million 1-byte rows: 4 MiB, but far more segments than the
    Python path takes; it is refused at once (it never loops over the rows)."""
    rec = [(1 << 20, 0, 0, 1, 4 << 20, 2)]
    idx = [np.zeros(1, np.int64)]
    src, dst = (Records.build(rec, idx),) * 2
    assert iov.few(src, dst) is None


def _byte_pairs(local: iov.Side, remote: iov.Side) -> set[tuple[int, int]]:
    """Every (source address, destination address) byte pair the two sides pair up."""
    def addrs(side: iov.Side) -> list[int]:
        return [a + k for a, n in side.rows.tolist() for k in range(n)]
    return set(zip(addrs(remote), addrs(local), strict=True))


_record = st.tuples(st.integers(0, 3), st.integers(1, 6), st.integers(1, 3), st.integers(0, 1),
                    st.lists(st.integers(0, 5), min_size=0, max_size=4, unique=True))


@settings(max_examples=200, deadline=None)
@given(records=st.lists(_record, min_size=1, max_size=5), flip=st.booleans())
def test_whole_writes_pair_every_byte_as_the_naive_oracle(
        records: list[tuple[int, int, int, int, list[int]]], flip: bool) -> None:
    """Random paired records (several rows per unit, gapped or touching, either side
    strided): the vectorised build pairs exactly the bytes a loop over records, units
    and rows pairs, each once."""
    src_rows, dst_rows, s_idx, d_idx = [], [], [], []
    want: list[tuple[int, int]] = []
    for r, (off, length, count, gap, units) in enumerate(records):
        s_stride, d_stride = length + gap, length + (1 - gap if flip else gap)
        s_unit, d_unit = count * s_stride + 8, count * d_stride + 8
        s_ptr, d_ptr = (1 << 20) * (r + 1), (1 << 30) + (1 << 20) * (r + 1)
        src_rows.append((s_ptr, s_unit, off, length, count, s_stride))
        dst_rows.append((d_ptr, d_unit, off, length, count, d_stride))
        d_units = [u + 1 for u in reversed(units)]
        s_idx.append(np.array(units, np.int64))
        d_idx.append(np.array(d_units, np.int64))
        want += [(s_ptr + su * s_unit + off + j * s_stride + k,
                  d_ptr + du * d_unit + off + j * d_stride + k)
                 for su, du in zip(units, d_units, strict=True)
                 for j in range(count) for k in range(length)]
    src, dst = decode_write(Records.build(src_rows + dst_rows, s_idx + d_idx).encode())
    got = iov.whole(src, dst)
    assert got is not None
    assert got[0].nbytes == got[1].nbytes == len(want)
    assert _byte_pairs(*got) == set(want) and len(set(want)) == len(want)


def test_a_write_of_many_segments_is_left_to_bounded_windows() -> None:
    """More segments than a window: ``whole`` declines, the windows stay bounded."""
    b = _builder(11)
    page, n = 1024, 3000
    e = b.pair(src_unit=page, dst_unit=page, cap=n, n=n, pieces=[[0, 0, page, 1, page, page]])
    src, dst = decode_write(encode_write(Plan(entries=(e,))))
    assert iov.whole(src, dst, most=1000) is None
    assert iov.whole(src, dst) is not None
    sizes = [len(local.rows) for local, _ in iov.windows(src, dst, 1000)]
    assert len(sizes) == 3 and max(sizes) <= 1000


@pytest.mark.parametrize("build", [iov.few, iov.prebuilt])
@pytest.mark.parametrize("kind", KINDS)
def test_prebuilt_writes_are_one_window_and_land_every_byte(kind: str, build: object) -> None:
    """What a write's check builds — a small write in Python integers (``few``, always
    one call's worth), or any write of few units (``prebuilt``) — lands every byte as the
    numpy executor does, in one call when ``one_syscall`` says so (at most IOV_MAX
    iovecs a side, BATCH_BYTES in all); a larger write is left to the windows."""
    b = _builder(12)
    p = b.plan(kind)
    want = b.expected(p)
    src, dst = decode_write(encode_write(p))
    got = build(src, dst)  # type: ignore[operator]
    if got is None:
        assert build is iov.prebuilt or p.nbytes > iov.BATCH_BYTES \
            or p.num_segments > 4 * iov.FEW, kind
        return
    local, remote = got
    one = iov.one_syscall(got)
    assert one or build is iov.prebuilt
    assert one == (local.nbytes <= iov.BATCH_BYTES and len(local.rows) <= IOV_MAX
                   and len(remote.rows) <= IOV_MAX)
    assert local.nbytes == remote.nbytes == p.nbytes
    fake = FakeReadV()
    if p.nbytes:
        iov.pull(fake, os.getpid(), local, remote, 0, local.nbytes, stop=lambda: None)
        assert fake.calls == 1 or not one
    for (_, d), exp in zip(b.dsts, want, strict=True):
        assert np.array_equal(d, exp)


@pytest.mark.parametrize(("pages", "one"), [(800, True), (1100, False)])
def test_one_syscall_takes_up_to_iov_max_scattered_pages(pages: int, one: bool) -> None:
    """800 scattered 4 KiB pages (more than the Python path takes) are still one call;
    1100 are more iovecs than one call takes, yet built as checked all the same."""
    b = _builder(13)
    page = 4096
    e = b.pair(src_unit=page, dst_unit=page, cap=2 * pages, n=pages,
               pieces=[[0, 0, page, 1, page, page]])
    src, dst = decode_write(encode_write(Plan(entries=(e,))))
    assert iov.few(src, dst) is None
    got = iov.prebuilt(src, dst)
    assert got is not None and iov.one_syscall(got) is one


def test_the_receivers_span_is_taken_only_when_it_fits_the_senders_clock() -> None:
    assert decode_moved(encode_moved(10.5, 10.75), 10.0, 11.0) == (10.5, 10.75)
    assert decode_moved(encode_moved(10.0, 11.0), 10.0, 11.0) == (10.0, 11.0)
    # another clock (a time namespace), a span reversed, or nothing usable: no figure
    for body, sent, now in ((encode_moved(9.0, 10.5), 10.0, 11.0),
                            (encode_moved(10.5, 11.5), 10.0, 11.0),
                            (encode_moved(10.75, 10.5), 10.0, 11.0),
                            ("", 10.0, 11.0), ("10.5", 10.0, 11.0), ("a b", 10.0, 11.0),
                            ("nan 10.5", 10.0, 11.0), ("10.1 10.2 10.3", 10.0, 11.0)):
        assert decode_moved(body, sent, now) is None, body
