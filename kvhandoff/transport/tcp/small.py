"""Small tcp frames in pure Python: the latency path of a tiny handoff.

Plans that :mod:`kvhandoff.transport.small` calls small take one frame built with
Python integers, in one pass per side. The wire format is the general one
(:mod:`tcp_wire` records, one per tensor pair and piece; payload unit-major, then row),
so either side may take either path.

* :func:`build` (sender): checks every source byte (``OutOfBounds``, as ``submit``
  must), encodes the record table and lists the source memoryviews in payload order.
* :func:`dst_views` (receiver): bounds-checks *every* record of a decoded frame before
  a single destination view is made (RDMA-write semantics), then lists them.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from kvhandoff.errors import OutOfBounds
from kvhandoff.plan.model import Plan
from kvhandoff.transport.framing.wire import Records
from kvhandoff.transport.regions import RegionTable
from kvhandoff.transport.small import MAX_BYTES, MAX_SEGMENTS, plan_views, unit_views


class SmallFrame(NamedTuple):
    desc: bytes  # the record table (tcp_wire format)
    views: list[memoryview]  # source bytes, in payload order
    nbytes: int


def build(plan: Plan, table: RegionTable, name: str, max_bytes: int = MAX_BYTES
          ) -> SmallFrame | None:
    """The frame of a small ``plan`` read from ``table``, or None when the plan is not
    small or moves nothing (use the general path). Raises ``OutOfBounds`` for a source
    byte outside ``table`` (nothing is sent)."""
    views = plan_views(plan, table, "src", max_bytes)
    if views is None:
        return None
    if isinstance(views, str):
        raise OutOfBounds(f"{name}: {views} of this transport")
    head: list[int] = []
    idxs: list[int] = []
    nbytes = 0
    for e in plan.entries:
        n = len(e.dst_idx)
        if not n:
            continue
        for _so, do, ln, cnt, _ss, ds in e.pieces.tolist():
            if ln and cnt:
                head += (e.dst_ptr, e.dst_unit, do, ln, cnt, ds, n)
                idxs += e.dst_idx.tolist()
                nbytes += n * ln * cnt
    desc = struct.pack(f"<{1 + len(head) + len(idxs)}q", len(head) // 7, *head, *idxs)
    return SmallFrame(desc, views, nbytes)


def dst_views(records: Records, table: RegionTable) -> list[memoryview] | str | None:
    """The destination views of a small decoded frame, in payload order; a sentence if
    a record lies outside ``table`` (then nothing was touched); None if the frame is
    not small (use the general path). ``records`` come from ``Records.decode``, which
    refused negative fields and indices."""
    if len(records) > MAX_SEGMENTS or len(records.idx) > MAX_SEGMENTS:
        return None
    fields, bounds, idx = records.fields.tolist(), records.bounds.tolist(), records.idx.tolist()
    todo: list[tuple[tuple[memoryview, int], int, int, list[int], int, int, int]] = []
    segments = 0
    for r, (ptr, unit, off, ln, cnt, stride) in enumerate(fields):
        units = idx[bounds[r]:bounds[r + 1]]
        if not units or not ln or not cnt:
            continue
        segments += len(units) if (cnt == 1 or stride == ln) else len(units) * cnt
        if segments > MAX_SEGMENTS:
            return None
        hi = ptr + max(units) * unit + off + (cnt - 1) * stride + ln
        got = table.span_view(ptr, hi)
        if got is None:
            lo = ptr + min(units) * unit + off
            return (f"destination bytes [{lo:#x}, {hi:#x}) of record {r} lie outside the "
                    f"receiver's registered memory")
        todo.append((got, ptr + off, unit, units, ln, cnt, stride))
    views: list[memoryview] = []
    for args in todo:  # every record passed the check: only now make writable views
        views += unit_views(*args)
    return views
