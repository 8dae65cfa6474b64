"""The receiving side's bounds check (``Records.problem``: cma, tcp and shm run it on
every frame) against a naive oracle, on random region tables and random records, both
ways it is computed (Python integers for a few records, numpy for many).

The check is on each record's *envelope*: from the lower of the tensor's ``ptr`` and
its lowest described byte to its highest, which must lie in one registered region
(regions.py explains why that is exact for a Layout's tensors). The oracle walks every
unit and row of every record with Python integers. Whatever the tables, a record with
a byte outside every region is refused, and the sentence names the first record whose
envelope is not inside one region."""

from __future__ import annotations

import re

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.layout import Region
from kvhandoff.transport.framing.wire import SRC, Records
from kvhandoff.transport.regions import RegionTable

BASE = 1 << 20


@st.composite
def tables(draw: st.DrawFn) -> list[tuple[int, int]]:
    """Sorted, non-overlapping ``(ptr, nbytes)``, some touching, some apart."""
    out, at = [], BASE
    for _ in range(draw(st.integers(0, 5))):
        at += draw(st.sampled_from([0, 0, 1, 64, 700]))
        size = draw(st.integers(1, 3000))
        out.append((at, size))
        at += size
    return out


@st.composite
def records(draw: st.DrawFn, regions: list[tuple[int, int]]) -> tuple[tuple[int, ...], list[int]]:
    """One record: mostly near a region (inside it, across its end), sometimes anywhere,
    sometimes huge."""
    huge = st.integers(1 << 40, (1 << 63) - 1)
    if regions and draw(st.integers(0, 3)):
        ptr, size = draw(st.sampled_from(regions))
        ptr += draw(st.integers(0, size + 8))
    else:
        ptr = draw(st.one_of(st.integers(0, BASE + 20000), huge))
    unit = draw(st.one_of(st.integers(0, 300), huge)) if draw(st.integers(0, 9)) == 0 \
        else draw(st.integers(0, 300))
    fields = (ptr, unit, draw(st.integers(0, 200)), draw(st.integers(0, 80)),
              draw(st.integers(0, 4)), draw(st.integers(0, 200)))
    idx = draw(st.lists(st.integers(0, 12), max_size=5))
    return fields, idx


def _table(regions: list[tuple[int, int]]) -> RegionTable:
    return RegionTable((Region(ptr=p, nbytes=n), np.zeros(0, np.uint8)) for p, n in regions)


def _inside(regions: list[tuple[int, int]], lo: int, hi: int) -> bool:
    return hi == lo or any(p <= lo and hi <= p + n for p, n in regions)


def _envelope_ok(regions: list[tuple[int, int]], fields: tuple[int, ...],
                 idx: list[int]) -> bool:
    """The oracle: every unit and row, one by one; the span from ``ptr`` (or the lowest
    byte) to the highest byte lies in one region."""
    ptr, unit, off, length, count, stride = fields
    segments = [(ptr + u * unit + off + j * stride, length)
                for u in idx for j in range(count)] if length else []
    if not segments:
        return True
    lo = min(ptr, *(a for a, _ in segments))
    hi = max(a + n for a, n in segments)
    return _inside(regions, lo, hi)


def _each_byte_ok(regions: list[tuple[int, int]], fields: tuple[int, ...],
                  idx: list[int]) -> bool:
    ptr, unit, off, length, count, stride = fields
    return all(_inside(regions, a, a + length) for a in
               (ptr + u * unit + off + j * stride for u in idx for j in range(count)))


@settings(max_examples=200, deadline=None)
@given(data=st.data(), regions=tables(), many=st.booleans())
def test_the_bounds_check_agrees_with_the_naive_oracle(
        data: st.DataObject, regions: list[tuple[int, int]], many: bool) -> None:
    n = data.draw(st.integers(70, 90) if many else st.integers(1, 8))
    recs = [data.draw(records(regions)) for _ in range(n)]
    table = Records.build([f for f, _ in recs], [np.array(i, np.int64) for _, i in recs])
    got = table.problem(_table(regions))
    bad = [r for r, (f, i) in enumerate(recs) if not _envelope_ok(regions, f, i)]
    if any(not _each_byte_ok(regions, f, i) for f, i in recs):
        assert got is not None, "a byte outside every region was let through"
    if not bad:
        assert got is None, got
        return
    assert got is not None
    beyond = re.fullmatch(r"record (\d+) addresses bytes beyond 2\*\*62", got)
    if beyond:  # numpy's path refuses any such record first, naming it
        assert many and int(beyond[1]) in bad, (got, bad)
        return
    assert f"of record {bad[0]} lie outside" in got, (got, bad)
    assert got.startswith("destination bytes") and "the receiver's registered memory" in got
    src = table.problem(_table(regions), SRC)
    assert src is not None and src.startswith("source bytes") and "the sender's" in src


def test_an_empty_table_refuses_every_byte_and_takes_empty_records() -> None:
    empty = Records.build([(BASE, 64, 0, 0, 1, 0), (BASE, 64, 0, 8, 0, 8)],
                          [np.array([1], np.int64), np.array([1], np.int64)])
    assert empty.problem(_table([])) is None
    one = Records.build([(BASE, 64, 0, 8, 1, 8)], [np.array([0], np.int64)])
    assert "record 0" in (one.problem(_table([])) or "")
