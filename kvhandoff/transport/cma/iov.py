"""Paired record tables → iovec batches, and the loop that pulls them. Pure numpy; the
syscall is passed in (:data:`~kvhandoff.transport.cma.kernel.ReadV`).

A WRITE's source record ``r`` and destination record ``r`` describe one byte stream in
the same order (record by record, unit-major, then row; :mod:`.frames`). A window's
segments are paired (a source and a destination run of one length), put in source
order when they are short (the kernel's cost is per *remote* iovec: adjacent source
pages become one), and each side becomes its own list of contiguous runs:
``process_vm_readv`` reads the remote iovecs and fills the local ones as two streams
of equal length, so the sides need not be cut alike — a head-sliced destination fed
from whole source pages costs one remote iovec per run of pages and one local iovec
per row.

Bounded whatever a peer sends: the stream is cut into *windows* of about
:data:`WINDOW` segments per side (a record's units in slices, a huge unit's rows in
slices); a window's iovecs are built, pulled and dropped before the next one is built.
Within a window, each call takes at most ``IOV_MAX`` iovecs per side and
``batch_bytes`` bytes (so a stop request is seen within one batch); a partial copy
continues where the kernel stopped.

Tiny handoffs (a page per layer) are bound by per-call overhead: a small write is
built in one pass of Python integers (:func:`few`), and items of at most :data:`FEW`
segments are addressed with Python integers, not numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvhandoff.plan.runs import run_starts
from kvhandoff.transport.cma.kernel import IOV, IOV_MAX, ReadV
from kvhandoff.transport.errors import TransferFailed
from kvhandoff.transport.framing.wire import Records
from kvhandoff.transport.views import unit_contiguous

I64 = npt.NDArray[np.int64]
Record = tuple[int, int, int, int, int, int, I64]  # as Records.record() returns it

WINDOW = 1 << 16
"""Segments per side a window aims at (its arrays: a few MB at most)."""
BATCH_BYTES = 4 << 20
"""Bytes per syscall at most: a stop request waits for one batch (~1 ms)."""
FEW = 64
"""Items of at most this many segments per side are built with Python integers."""
SORT_BELOW = 64 << 10
"""Windows whose segments average less are put in source order (see ``_window``)."""


class Stopped(TransferFailed):
    """The pull was stopped between two batches (the sender went away, the receiver is
    closing, or the transfer outlived its deadline); what was copied stays copied."""


class CopyFailed(TransferFailed):
    """The kernel refused or stopped a copy; ``copied`` bytes of the transfer landed."""

    def __init__(self, message: str, copied: int, error: OSError | None) -> None:
        super().__init__(message)
        self.copied = copied
        self.error = error


@dataclass(frozen=True, slots=True)
class Side:
    """One side's iovecs of a window: ``rows`` as the syscall takes them and ``ends``,
    the stream offset where each one ends. Immutable."""

    rows: IOV
    ends: I64

    @staticmethod
    def of(starts: I64, lens: I64) -> Side:
        """The runs of segments ``starts[i], lens[i]`` (stream order), merged where one
        ends where the next begins."""
        first = run_starts(starts, step=lens)
        merged = np.add.reduceat(lens, first) if len(first) else lens
        rows = np.empty((len(first), 2), np.uint64)
        rows[:, 0] = starts[first]
        rows[:, 1] = merged
        return Side(rows, np.cumsum(merged, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def reach(self, pos: int, k: int) -> int:
        """Where the ``k``-th iovec counted from the one holding stream offset ``pos``
        ends (the stream's end if fewer remain)."""
        i = int(np.searchsorted(self.ends, pos, side="right"))
        return int(self.ends[min(i + k - 1, len(self.ends) - 1)])

    def cut(self, pos: int, end: int) -> IOV:
        """The iovecs covering stream bytes ``[pos, end)``, the first and last trimmed."""
        i = int(np.searchsorted(self.ends, pos, side="right"))
        j = int(np.searchsorted(self.ends, end, side="left"))
        out = self.rows[i:j + 1].copy()
        skip = pos - (int(self.ends[i]) - int(self.rows[i, 1]))
        out[0, 0] += skip
        out[0, 1] -= skip
        out[-1, 1] -= int(self.ends[j]) - end
        return out


def few(src: Records, dst: Records, most: int = 4 * FEW) -> tuple[Side, Side] | None:
    """``(local, remote)`` of a small write in one pass of Python integers — at most
    ``most`` segments a side and :data:`BATCH_BYTES` in all, so one syscall —; None for
    a larger one (use :func:`windows`). A tiny handoff's dozen numpy calls per record
    cost more than its copy."""
    if len(src.idx) > most:
        return None
    bounds, s_idx, d_idx = src.bounds.tolist(), src.idx.tolist(), dst.idx.tolist()
    local: list[list[int]] = []
    remote: list[list[int]] = []
    total = segs = 0
    for r, (s_rec, d_rec) in enumerate(zip(src.fields.tolist(), dst.fields.tolist(),
                                            strict=True)):
        a, z = bounds[r], bounds[r + 1]
        total += (z - a) * s_rec[3] * s_rec[4]
        segs += (z - a) * max(_rows_per_unit(s_rec), _rows_per_unit(d_rec))
        if total > BATCH_BYTES or segs > most:
            return None
        _few(d_rec, d_idx[a:z], local)
        _few(s_rec, s_idx[a:z], remote)
    return _rows(local), _rows(remote)


def prebuilt(src: Records, dst: Records) -> tuple[Side, Side] | None:
    """``(local, remote)`` of a write cheap to build when it is checked, as one window: a
    small one in Python integers (:func:`few`), one of at most ``2 * IOV_MAX`` units by
    :func:`whole` (the window :func:`windows` would build); None for a larger one, left
    to the windows. :func:`one_syscall` says whether one call pulls it."""
    got = few(src, dst)
    if got is None and len(src.idx) <= 2 * IOV_MAX:
        got = whole(src, dst, 4 * IOV_MAX)
    return got


def one_syscall(sides: tuple[Side, Side]) -> bool:
    """Whether one syscall pulls ``(local, remote)``: at most ``IOV_MAX`` iovecs a side
    once merged and :data:`BATCH_BYTES` in all."""
    local, remote = sides
    return (local.nbytes <= BATCH_BYTES and len(local.rows) <= IOV_MAX
            and len(remote.rows) <= IOV_MAX)


def _rows_per_unit(rec: list[int]) -> int:
    _, _, _, length, count, stride = rec
    return 1 if count <= 1 or stride == length else count


def _few(rec: list[int], units: list[int], out: list[list[int]]) -> None:
    """Append the segments of one record's side to ``out``, merging runs."""
    ptr, unit, off, length, count, stride = rec
    if not units or not length or not count:
        return
    n = _rows_per_unit(rec)
    step = length * count if n == 1 else length
    for u in units:
        base = ptr + u * unit + off
        for j in range(n):
            at = base + j * stride
            if out and out[-1][0] + out[-1][1] == at:
                out[-1][1] += step
            else:
                out.append([at, step])


def _rows(segs: list[list[int]]) -> Side:
    lens = [n for _, n in segs]
    ends = np.cumsum(np.array(lens, np.int64)) if lens else np.zeros(0, np.int64)
    return Side(np.array(segs, np.uint64).reshape(len(segs), 2), ends)


def windows(src: Records, dst: Records, window: int = WINDOW) -> Iterator[tuple[Side, Side]]:
    """``(local, remote)`` iovecs of consecutive windows of the stream that the paired
    tables ``src`` (remote: the sender's addresses) and ``dst`` (local) describe. The
    records were validated: every address lies in registered memory. A write of at
    most ``window`` segments a side is one window, built by :func:`whole`."""
    one = whole(src, dst, window)
    if one is not None:
        if one[0].nbytes:
            yield one
        return
    items: list[tuple[Record, Record, int, int, int, int]] = []
    weight = 0
    for r in range(len(src)):
        s, d = src.record(r), dst.record(r)
        n, length, count = len(s[6]), s[3], s[4]
        if not n or not length or not count:
            continue
        per = max(_per_unit(s), _per_unit(d))
        if per <= window:
            step = max(1, window // per)
            cuts = [(a, min(n, a + step), 0, count) for a in range(0, n, step)]
        else:  # a unit of very many rows: its rows in slices
            cuts = [(u, u + 1, j, min(count, j + window)) for u in range(n)
                    for j in range(0, count, window)]
        for a, b, j0, j1 in cuts:
            items.append((s, d, a, b, j0, j1))
            weight += (b - a) * min(per, j1 - j0)
            if weight >= window:
                yield _window(items)
                items, weight = [], 0
    if items:
        yield _window(items)


def whole(src: Records, dst: Records, most: int = WINDOW) -> tuple[Side, Side] | None:
    """``(local, remote)`` of a whole write as one window, every record at once — a
    fixed number of numpy calls, however many records (the windows' per-record calls
    cost several times the copy of a handoff of a few MB) —; None when it is more than
    ``most`` segments a side (use :func:`windows`). Same segments, order and merging
    as a window of :func:`windows` (:func:`_sides`)."""
    s, d = src.fields, dst.fields
    sizes = np.diff(src.bounds)
    length, count = s[:, 3], s[:, 4]
    flat = (count <= 1) | ((s[:, 5] == length) & (d[:, 5] == length))
    rows = np.where((length > 0) & (count > 0), np.where(flat, 1, count), 0)
    if float((sizes.astype(np.float64) * rows).sum()) > most:  # float: hostile counts
        return None
    rid = np.repeat(np.arange(len(s)), sizes)  # each unit's record
    sb = s[rid, 0] + s[rid, 2] + src.idx * s[rid, 1]
    db = d[rid, 0] + d[rid, 2] + dst.idx * d[rid, 1]
    per = rows[rid]
    if bool((per != 1).any()):  # some units are several rows (or none): one per row
        k = np.repeat(np.arange(len(rid)), per)
        j = np.arange(len(k)) - np.repeat(np.cumsum(per) - per, per)
        rid = rid[k]
        sb, db = sb[k] + j * s[rid, 5], db[k] + j * d[rid, 5]
    return _sides(sb, db, np.where(flat, length * count, length)[rid])


def _per_unit(rec: Record) -> int:
    """Segments one unit of a record is on its side: 1 when its rows touch."""
    _, _, _, length, count, stride, _ = rec
    return 1 if unit_contiguous(count, stride, length) else count


def _window(items: list[tuple[Record, Record, int, int, int, int]]) -> tuple[Side, Side]:
    """``(local, remote)`` of a window: its segments paired (a source and a destination
    run of one length), put in source order when they are short, then merged on each
    side. The kernel pins the sender's pages per remote iovec (a lock and a page-table
    walk each): short scattered sources cost several times their copy, while runs of
    adjacent source pages cost one; the receiver's side is written page by page at
    memory speed either way. A plan writes each destination byte once, so the order in
    which its segments land is free (as with RDMA writes)."""
    return _sides(*_pairs(items))


def _sides(src: I64, dst: I64, lens: I64) -> tuple[Side, Side]:
    """``(local, remote)`` of paired segments (see :func:`_window` on the order)."""
    if len(src) > 1 and int(lens.sum()) < SORT_BELOW * len(src) \
            and bool((src[1:] < src[:-1]).any()):
        order = np.argsort(src, kind="stable")
        src, dst, lens = src[order], dst[order], lens[order]
    return Side.of(dst, lens), Side.of(src, lens)


def _pairs(items: list[tuple[Record, Record, int, int, int, int]]) -> tuple[I64, I64, I64]:
    """Every segment of the items: ``(source starts, destination starts, lengths)``,
    cut where either side's rows part (a few with Python integers, more with numpy)."""
    arrays: list[tuple[I64, I64, I64]] = []
    few: list[tuple[int, int, int]] = []
    for s, d, a, b, j0, j1 in items:
        rows, length = j1 - j0, s[3]
        whole = rows == 1 or (s[5] == length and d[5] == length)
        n, step = (1, length * rows) if whole else (rows, length)
        if (b - a) * n <= FEW:
            few += [(xs + j * s[5], xd + j * d[5], step)
                    for xs, xd in zip(_bases(s, a, b, j0), _bases(d, a, b, j0), strict=True)
                    for j in range(n)]
            continue
        sb = s[0] + s[2] + j0 * s[5] + s[6][a:b] * s[1]
        db = d[0] + d[2] + j0 * d[5] + d[6][a:b] * d[1]
        if not whole:
            sb = (sb[:, None] + np.arange(rows, dtype=np.int64) * s[5]).ravel()
            db = (db[:, None] + np.arange(rows, dtype=np.int64) * d[5]).ravel()
        arrays.append((sb, db, np.full(len(sb), step, np.int64)))
    if few:
        arrays.append(tuple(np.array(few, np.int64).reshape(-1, 3).T))  # type: ignore[arg-type]
    if len(arrays) == 1:
        return arrays[0]
    return (np.concatenate([x[0] for x in arrays]), np.concatenate([x[1] for x in arrays]),
            np.concatenate([x[2] for x in arrays]))


def _bases(rec: Record, a: int, b: int, j0: int) -> list[int]:
    """Where units ``a:b`` of a record start, from row ``j0`` (Python integers)."""
    ptr, unit, off, _, _, stride, idx = rec
    base = ptr + off + j0 * stride
    return [base + u * unit for u in idx[a:b].tolist()]


def pull(readv: ReadV, pid: int, local: Side, remote: Side, lo: int, hi: int, *,
         stop: Callable[[], str | None], batch_bytes: int = BATCH_BYTES,
         max_iov: int = IOV_MAX) -> None:
    """Copy stream bytes ``[lo, hi)`` of a window from process ``pid``: calls of at most
    ``max_iov`` iovecs per side and ``batch_bytes`` bytes; a partial copy continues
    where it stopped. Before each call ``stop()`` may name a reason to stop
    (:class:`Stopped`). :class:`CopyFailed` when the kernel refuses or copies nothing;
    its ``copied`` counts the bytes of ``[lo, hi)`` that landed."""
    pos = lo
    while pos < hi:
        why = stop()
        if why is not None:
            raise Stopped(f"copy stopped after {pos - lo} of {hi - lo} B: {why}")
        end = min(hi, pos + batch_bytes, local.reach(pos, max_iov), remote.reach(pos, max_iov))
        try:
            n = readv(pid, local.cut(pos, end), remote.cut(pos, end))
        except InterruptedError:
            continue
        except OSError as e:
            raise CopyFailed(f"copy failed after {pos - lo} of {hi - lo} B", pos - lo,
                             e) from e
        if not 0 < n <= end - pos:
            raise CopyFailed(f"process_vm_readv copied {n} of {end - pos} B (after "
                             f"{pos - lo} of {hi - lo} B)", pos - lo, None)
        pos += n
