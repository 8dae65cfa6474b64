"""The tcp transport's wire format: fixed headers and record tables. Pure: no sockets.

A connection carries frames only once the handshake of
:mod:`~kvhandoff.transport.framing.handshake` succeeded. Every frame is a header, then
``desc_len`` description bytes, then ``payload_len`` payload bytes::

    header  <4s H H I Q Q Q>  magic b"KVHT", version, kind, code, seq, desc_len, payload_len

``code`` is the flags of a request (``FLAG_CHECK``, ``FLAG_NOTICE``) and the
:class:`Status` of a reply. With ``FLAG_NOTICE`` the description starts with a notice
(``<I n>`` then ``n`` bytes) that the receiver hands to its notice handler once the
frame's payload has landed, before it replies.
A WRITE's description is a record table, the destination side of factored pieces::

    <q n>  then n × <q ptr, unit, off, length, count, stride, n_idx>  then Σ n_idx × <q idx>

Record ``r`` covers bytes ``ptr + idx[u]*unit + off + j*stride + [0, length)`` for each
of its units ``u`` and rows ``j < count``; the payload carries them in that order
(unit-major, then row, then byte), records one after another.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvhandoff.transport.errors import (
    ConnectError,
    ProtocolError,
    RemoteOutOfBounds,
    RemoteRefused,
    TransferFailed,
    TransportError,
)
from kvhandoff.transport.regions import RegionTable, piece_span

I64 = npt.NDArray[np.int64]

MAGIC = b"KVHT"
VERSION = 1
HEADER = struct.Struct("<4sHHIQQQ")
FLAG_CHECK = 1  # validate the records, expect no payload, write nothing
FLAG_NOTICE = 2  # the description starts with a notice (see the module docstring)
_NOTICE_LEN = struct.Struct("<I")
NO_RECORDS = struct.pack("<q", 0)
"""The record table of a frame that writes nothing (a notice on its own)."""

MAX_DESC = 64 << 20  # larger descriptions or payloads are malformed: they bound what
MAX_PAYLOAD = 1 << 32  # a hostile frame can make a receiver allocate or wait for
MAX_RECORDS = 1 << 22
_FIELDS = 7
_FEW = 64  # record tables up to this size are bounds-checked without vectorising
_FEW_UNITS = 4096  # ... with their index ranges in Python up to this many indices
_LIMIT = float(1 << 62)  # any address arithmetic beyond this is refused, never wrapped
_DST = ("destination", "the receiver's")
SRC = ("source", "the sender's")
"""``whose`` for :meth:`Records.problem` on a table of the sender's sources."""


class Kind(enum.IntEnum):
    HELLO = 1  # client → server (staging, shm, cma): open the session after the handshake
    # (empty; cma: the sender's probe and regions, and later its updated regions)
    WRITE = 2  # client → server, description = records, payload = bytes
    REPLY = 3  # server → client, code = Status, description = utf-8 message
    BYE = 4  # client → server (staging control only), no description: a clean goodbye


class Status(enum.IntEnum):
    OK = 0
    OUT_OF_BOUNDS = 1
    MALFORMED = 2
    INTERNAL = 3
    BAD_TOKEN = 4  # no longer sent (keys are proven by handshake_auth); kept for the code
    REFUSED = 5  # the receiver will not do it (cma: the kernel forbids reading the sender)


def reply_error(status: int, message: str, peer: str) -> TransportError:
    """The one place a REPLY's status becomes an error (tcp frames, shm commits, staging
    commits): the receiver's verdict, in the words it sent."""
    if status == Status.OUT_OF_BOUNDS:
        return RemoteOutOfBounds(f"{peer} refused the write: {message}")
    if status == Status.MALFORMED:
        return ProtocolError(f"{peer} rejected our frame as malformed: {message}")
    if status == Status.BAD_TOKEN:
        return ConnectError(f"{peer}: {message}")
    if status == Status.INTERNAL:
        return TransferFailed(f"{peer} failed internally: {message}")
    if status == Status.REFUSED:
        return RemoteRefused(f"{peer} refused: {message}")
    return RemoteRefused(f"{peer} answered status {status}: {message}")


def join_notice(notice: bytes, desc: bytes) -> bytes:
    """A ``FLAG_NOTICE`` description: ``notice``, then the record table ``desc``."""
    return _NOTICE_LEN.pack(len(notice)) + notice + desc


def split_notice(desc: bytearray) -> tuple[bytes, memoryview]:
    """``(notice, record table)`` of a ``FLAG_NOTICE`` description; ProtocolError if
    it does not hold one."""
    if len(desc) < _NOTICE_LEN.size:
        raise ProtocolError(f"a notice frame's description of {len(desc)} B has no length")
    (n,) = _NOTICE_LEN.unpack_from(desc)
    end = _NOTICE_LEN.size + n
    if end > len(desc):
        raise ProtocolError(f"notice of {n} B does not fit a {len(desc)} B description")
    return bytes(desc[_NOTICE_LEN.size:end]), memoryview(desc)[end:]


class Header(NamedTuple):
    """A frame header (a NamedTuple: built and parsed for every frame)."""

    kind: Kind
    code: int
    seq: int
    desc_len: int
    payload_len: int

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.kind, self.code, self.seq, self.desc_len,
                           self.payload_len)

    @staticmethod
    def unpack(buf: bytes | bytearray | memoryview) -> Header:
        """Parse and sanity-check a header; raises ProtocolError saying what is wrong."""
        magic, version, kind, code, seq, desc_len, payload_len = HEADER.unpack(buf)
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {bytes(magic)!r} (want {MAGIC!r})")
        if version != VERSION:
            raise ProtocolError(f"peer speaks tcp wire version {version}, we speak {VERSION}")
        try:
            k = Kind(kind)
        except ValueError:
            raise ProtocolError(f"unknown frame kind {kind}") from None
        if desc_len > MAX_DESC or payload_len > MAX_PAYLOAD:
            raise ProtocolError(f"frame too large: description {desc_len} B, payload "
                                f"{payload_len} B")
        return Header(k, code, seq, desc_len, payload_len)


@dataclass(frozen=True, slots=True)
class Records:
    """A table of destination records (see the module docstring). Immutable."""

    fields: I64  # (n, 6): ptr, unit, off, length, count, stride
    idx: I64  # all records' unit indices, concatenated
    bounds: I64  # (n + 1,): record r's indices are idx[bounds[r]:bounds[r+1]]

    @staticmethod
    def build(rows: list[tuple[int, int, int, int, int, int]], idxs: list[I64]) -> Records:
        fields = np.array(rows, dtype=np.int64).reshape(len(rows), 6)
        sizes = np.array([len(i) for i in idxs], dtype=np.int64)
        idx = np.concatenate(idxs).astype(np.int64, copy=False) if idxs else np.zeros(0, np.int64)
        return Records(fields, idx, np.concatenate(([0], np.cumsum(sizes))).astype(np.int64))

    def __len__(self) -> int:
        return len(self.fields)

    @property
    def nbytes(self) -> int:
        """Payload bytes the records describe; ProtocolError if that is 2**62 or more
        (hostile counts must not wrap around int64 to a small number)."""
        n_idx = np.diff(self.bounds)
        length, count = self.fields[:, 3], self.fields[:, 4]
        if float((n_idx.astype(np.float64) * length * count).sum()) >= _LIMIT:
            raise ProtocolError("records describe 2**62 payload bytes or more")
        return int((n_idx * length * count).sum())

    def record(self, r: int) -> tuple[int, int, int, int, int, int, I64]:
        ptr, unit, off, length, count, stride = self.fields[r].tolist()
        a, z = self.bounds[r:r + 2].tolist()
        return ptr, unit, off, length, count, stride, self.idx[a:z]

    def encode(self) -> bytes:
        n = len(self.fields)
        table = np.empty((n, _FIELDS), dtype="<i8")
        table[:, :6] = self.fields
        table[:, 6] = np.diff(self.bounds)
        return b"".join((struct.pack("<q", n), table.tobytes(), self.idx.astype("<i8").tobytes()))

    @staticmethod
    def decode(buf: bytes | bytearray | memoryview) -> Records:
        """Parse a record table; raises ProtocolError on any inconsistency."""
        if len(buf) < 8:
            raise ProtocolError(f"record table of {len(buf)} B has no count")
        (n,) = struct.unpack_from("<q", buf)
        if not 0 <= n <= MAX_RECORDS:
            raise ProtocolError(f"record count {n} outside 0..{MAX_RECORDS}")
        head = 8 + n * _FIELDS * 8
        if len(buf) < head or (len(buf) - head) % 8:
            raise ProtocolError(f"record table of {len(buf)} B does not fit {n} records")
        table = np.frombuffer(buf, dtype="<i8", count=n * _FIELDS, offset=8).reshape(n, _FIELDS)
        idx = np.frombuffer(buf, dtype="<i8", offset=head)
        if (table < 0).any() or (idx < 0).any():
            raise ProtocolError("record table holds negative fields or indices")
        sizes = table[:, 6]
        if int(sizes.sum()) != len(idx):
            raise ProtocolError(f"records announce {int(sizes.sum())} indices, table has "
                                f"{len(idx)}")
        bounds = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        return Records(table[:, :6].astype(np.int64), idx.astype(np.int64), bounds)

    def problem(self, table: RegionTable, whose: tuple[str, str] = _DST) -> str | None:
        """None if every described byte lies in ``table``, else a sentence naming the
        first offending record. Vectorised; exact (see regions.py on envelopes). A few
        records (a typical frame) are checked with Python integers instead: one numpy
        call per record beats twenty on arrays of three. ``whose``: what the bytes and
        the table are, for the sentence (by default the receiver's destinations)."""
        if len(self) <= _FEW:
            return self._problem_few(table, whose)
        return self._problem_many(table, whose)

    def _problem_many(self, table: RegionTable, whose: tuple[str, str] = _DST) -> str | None:
        sizes = np.diff(self.bounds)
        ptr, unit, off, length, count, stride = (self.fields[:, k] for k in range(6))
        active = (sizes > 0) & (length > 0) & (count > 0)
        if not active.any():
            return None
        nonempty = np.flatnonzero(sizes > 0)
        imin = np.zeros(len(sizes), np.int64)
        imax = np.zeros(len(sizes), np.int64)
        imin[nonempty] = np.minimum.reduceat(self.idx, self.bounds[nonempty])
        imax[nonempty] = np.maximum.reduceat(self.idx, self.bounds[nonempty])
        a = np.flatnonzero(active)
        f = self.fields[a].astype(np.float64)
        hi_f = f[:, 0] + imax[a] * f[:, 1] + f[:, 2] + (f[:, 4] - 1) * f[:, 5] + f[:, 3]
        if (hi_f >= _LIMIT).any():
            r = int(a[np.argmax(hi_f >= _LIMIT)])
            return f"record {r} addresses bytes beyond 2**62"
        lo = np.minimum(ptr[a], ptr[a] + imin[a] * unit[a] + off[a])
        hi = ptr[a] + imax[a] * unit[a] + off[a] + (count[a] - 1) * stride[a] + length[a]
        region = np.searchsorted(table.starts, lo, side="right") - 1
        safe = np.clip(region, 0, max(len(table) - 1, 0))
        ok = (region >= 0) & (len(table) > 0)
        if len(table):
            ok &= hi <= table.ends[safe]
        if ok.all():
            return None
        bad = int(np.argmin(ok))
        return _outside(whose, int(lo[bad]), int(hi[bad]), int(a[bad]))

    def _problem_few(self, table: RegionTable, whose: tuple[str, str] = _DST) -> str | None:
        fields, bounds = self.fields.tolist(), self.bounds.tolist()
        # few indices: one conversion, each record's range in Python; else numpy's
        units = self.idx.tolist() if len(self.idx) <= _FEW_UNITS else None
        for r, (ptr, unit, off, length, count, stride) in enumerate(fields):
            a, z = bounds[r], bounds[r + 1]
            if a == z or not length or not count:
                continue
            mine = None if units is None else units[a:z]
            span = piece_span(ptr, unit, self.idx[a:z], off, length, count, stride,
                              None if mine is None else (min(mine), max(mine)))
            if not table.contains(span):
                return _outside(whose, span.lo, span.hi, r)
        return None


def _outside(whose: tuple[str, str], lo: int, hi: int, record: int) -> str:
    return (f"{whose[0]} bytes [{lo:#x}, {hi:#x}) of record {record} lie outside "
            f"{whose[1]} registered memory")
