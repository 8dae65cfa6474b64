"""RegionTable: registration merging and exact envelope bounds checks."""

from __future__ import annotations

import numpy as np
import pytest

from kvhandoff.layout import Region
from kvhandoff.memory import raw_view
from kvhandoff.transport.regions import RegionTable, Span, piece_span


def _block(ptr: int, n: int) -> tuple[Region, np.ndarray]:
    return Region(ptr=ptr, nbytes=n), np.zeros(n, np.uint8)


def test_contained_blocks_merge_and_partial_overlaps_raise() -> None:
    t = RegionTable().with_regions([_block(1000, 100)])
    t = t.with_regions([_block(1010, 10), _block(1000, 100)])  # inside / the same again
    assert t.describe() == [(1000, 100)]
    t = t.with_regions([_block(900, 300)])  # a container replaces what it contains
    assert t.describe() == [(900, 300)]
    t = t.with_regions([_block(2000, 10), _block(1200, 0)])  # zero-length: ignored
    assert t.describe() == [(900, 300), (2000, 10)]
    with pytest.raises(ValueError, match="overlap"):
        t.with_regions([_block(1150, 100)])


def test_spans_and_views() -> None:
    buf = np.arange(256, dtype=np.uint8)
    base = int(buf.ctypes.data)
    t = RegionTable([(Region(ptr=base, nbytes=256), raw_view(base, 256))])
    assert t.contains(Span(base, base + 256)) and not t.contains(Span(base, base + 257))
    assert t.contains(Span(5, 5))  # empty spans touch nothing
    assert t.view(base + 10)[0] == 10
    idx = np.array([0, 3], np.int64)
    assert piece_span(base, 64, idx, 8, 8, 4, 12) == Span(base, base + 3 * 64 + 8 + 36 + 8)
    with pytest.raises(ValueError):
        piece_span(base, 64, np.array([-1]), 0, 8, 1, 0)
