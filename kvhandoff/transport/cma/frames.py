"""The cma transport's frame bodies, on the framing wire's headers. Pure: no sockets.

After the data-plane handshake the sender speaks first; every frame gets one REPLY, in
order::

    HELLO  <Q probe address, I probe length> probe bytes, then the regions table
           <q n> n × <q ptr, q nbytes>
           The first HELLO opens the session: the receiver reads ``probe length`` bytes
           at ``probe address`` in the sender and compares them with the probe bytes
           (proving, before any request, that it may read the sender and reads the right
           process). A later HELLO (probe length 0) replaces the sender's regions after
           it registered more memory.
    WRITE  [a notice, with FLAG_NOTICE] then one record table of 2n records: the n
           source records, then the n destination records of the same pieces, in the
           same order (:mod:`~kvhandoff.transport.framing.wire`). Record ``r`` and
           ``n + r`` have the same length, count and number of units: both sides of one
           byte stream. No payload: the receiver pulls the bytes itself.
    REPLY  to a WRITE pulled whole (OK): ``"<from> <to>"``, the receiver's monotonic
           seconds from having the frame to its last byte pulled (:func:`encode_moved`);
           to anything else, empty or the reason it failed.

Every decoder raises :class:`ProtocolError` naming what is wrong.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvhandoff.layout import Region
from kvhandoff.plan.model import Plan
from kvhandoff.transport.errors import ProtocolError
from kvhandoff.transport.framing.wire import Records
from kvhandoff.transport.regions import U8, RegionTable

I64 = npt.NDArray[np.int64]

MAX_REGIONS = 1 << 16
"""The most regions one HELLO may declare (a rank registers one per tensor at most)."""
MAX_PROBE = 64
_HELLO = struct.Struct("<QI")
_COUNT = struct.Struct("<q")
MAX_HELLO = _HELLO.size + MAX_PROBE + _COUNT.size + 16 * MAX_REGIONS
"""The largest HELLO body (a receiver reads no more)."""
_NOBUF: U8 = np.zeros(0, np.uint8)


@dataclass(frozen=True, slots=True)
class Hello:
    """A decoded HELLO: the probe (empty in a regions update) and the sender's regions,
    as a table for bounds checks only (no views: the memory is the sender's)."""

    probe_addr: int
    probe: bytes
    regions: RegionTable


def encode_hello(probe_addr: int, probe: bytes, regions: list[tuple[int, int]]) -> bytes:
    """A HELLO body: ``probe`` lies at ``probe_addr`` here; ``regions`` are
    ``(ptr, nbytes)`` of every registered source. ValueError beyond
    :data:`MAX_REGIONS` regions (register whole pools, not their pages)."""
    if len(regions) > MAX_REGIONS:
        raise ValueError(f"cma: {len(regions)} registered regions exceed the {MAX_REGIONS} a "
                         f"receiver accepts; register whole pools, not each page")
    table = np.array(regions, dtype="<i8").reshape(len(regions), 2)
    return b"".join((_HELLO.pack(probe_addr, len(probe)), probe, _COUNT.pack(len(regions)),
                     table.tobytes()))


def decode_hello(body: bytes | bytearray) -> Hello:
    if len(body) < _HELLO.size + _COUNT.size:
        raise ProtocolError(f"cma HELLO of {len(body)} B is too short")
    addr, n_probe = _HELLO.unpack_from(body)
    if n_probe > MAX_PROBE:
        raise ProtocolError(f"cma HELLO probe of {n_probe} B exceeds {MAX_PROBE} B")
    at = _HELLO.size + n_probe
    if len(body) < at + _COUNT.size:
        raise ProtocolError("cma HELLO ends inside its probe")
    (n,) = _COUNT.unpack_from(body, at)
    at += _COUNT.size
    if not 0 <= n <= MAX_REGIONS or len(body) != at + 16 * n:
        raise ProtocolError(f"cma HELLO declares {n} regions in {len(body) - at} B "
                            f"(at most {MAX_REGIONS}, 16 B each)")
    spans = np.frombuffer(body, "<i8", 2 * n, at).reshape(n, 2)
    if (spans < 0).any():
        raise ProtocolError("cma HELLO declares a region with a negative address or size")
    try:
        table = RegionTable((Region(ptr=p, nbytes=s), _NOBUF) for p, s in spans.tolist())
    except ValueError as e:  # overlapping regions
        raise ProtocolError(f"cma HELLO: {e}") from None
    return Hello(int(addr), bytes(body[_HELLO.size:_HELLO.size + n_probe]), table)


def encode_write(plan: Plan) -> bytes:
    """The record table of a WRITE: every (tensor pair, piece)'s source record, then
    every destination record, in the same order."""
    src: list[tuple[int, int, int, int, int, int]] = []
    dst: list[tuple[int, int, int, int, int, int]] = []
    s_idx: list[I64] = []
    d_idx: list[I64] = []
    for e in plan.entries:
        if not len(e.src_idx):
            continue
        for so, do, ln, cnt, ss, ds in e.pieces.tolist():
            if ln and cnt:
                src.append((e.src_ptr, e.src_unit, so, ln, cnt, ss))
                dst.append((e.dst_ptr, e.dst_unit, do, ln, cnt, ds))
                s_idx.append(e.src_idx)
                d_idx.append(e.dst_idx)
    return Records.build(src + dst, s_idx + d_idx).encode()


def decode_write(table: bytes | bytearray | memoryview) -> tuple[Records, Records]:
    """``(sources, destinations)`` of a WRITE's record table; ProtocolError unless the
    two halves pair up (same lengths, counts and unit counts, record by record)."""
    both = Records.decode(table)
    if len(both) % 2:
        raise ProtocolError(f"cma WRITE of {len(both)} records: sources and destinations "
                            f"must pair up")
    n = len(both) // 2
    cut = int(both.bounds[n])
    src = Records(both.fields[:n], both.idx[:cut], both.bounds[:n + 1])
    dst = Records(both.fields[n:], both.idx[cut:], both.bounds[n:] - cut)
    sizes = np.diff(both.bounds)
    same = ((src.fields[:, 3:5] == dst.fields[:, 3:5]).all(axis=1)
            & (sizes[:n] == sizes[n:]))
    if not same.all():
        r = int(np.argmin(same))
        raise ProtocolError(f"cma WRITE record {r}: source and destination differ in "
                            f"length, count or number of units")
    return src, dst


def encode_moved(start: float, end: float) -> str:
    """An OK REPLY's body: when the receiver began and ended moving the bytes."""
    return f"{start:.9f} {end:.9f}"


def decode_moved(message: str, sent: float, now: float) -> tuple[float, float] | None:
    """The receiver's ``(start, end)`` from an OK REPLY to a frame sent at ``sent`` and
    answered at ``now`` (both this process's monotonic seconds), or None when the body
    says nothing usable: empty, malformed, or not within ``sent`` … ``now`` (the two
    processes' monotonic clocks differ, as across time namespaces). Never raises: the
    figure is the sender's to lose, never the transfer."""
    parts = message.split()
    try:
        start, end = (float(p) for p in parts) if len(parts) == 2 else (0.0, -1.0)
    except ValueError:
        return None
    return (start, end) if sent <= start <= end <= now else None
