"""The single-copy paths of the in-host copy (shm, memory): reordering a pair by source
and copying straight from / into a contiguous block of units, against the executor."""

from __future__ import annotations

import numpy as np
import pytest

from kvhandoff.layout import Region
from kvhandoff.plan.execute import HostMemory, execute
from kvhandoff.plan.model import Plan, TensorPlan
from kvhandoff.transport.regions import RegionTable
from kvhandoff.transport.views import by_source, copy_entry, is_range, split_work

B = 512


WHOLE = [[0, 0, B, 1, B, B]]
HEAD_SLICED = [[0, 64, 64, 4, 64, 128], [256, 320, 32, 2, 128, 96]]  # strided rows


def _pair(src_idx: list[int] | np.ndarray, dst_idx: list[int] | np.ndarray, cap: int,
          src: np.ndarray, dst: np.ndarray, pieces: list[list[int]] = WHOLE) -> TensorPlan:
    return TensorPlan(component="kv", tensor="t", layer_id=0, src_ptr=int(src.ctypes.data),
                      dst_ptr=int(dst.ctypes.data), src_unit=B, dst_unit=B,
                      src_idx=np.asarray(src_idx, np.int64), dst_idx=np.asarray(dst_idx, np.int64),
                      pieces=np.array(pieces, np.int64))


def _bufs(cap: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(cap)
    return (rng.integers(0, 256, cap * B, dtype=np.uint8),
            rng.integers(0, 256, cap * B, dtype=np.uint8))


def _table(buf: np.ndarray) -> RegionTable:
    return RegionTable([(Region(ptr=int(buf.ctypes.data), nbytes=buf.nbytes), buf)])


def test_is_range() -> None:
    assert is_range(np.arange(3, 9, dtype=np.int64))
    assert not is_range(np.array([3], np.int64))
    assert not is_range(np.array([3, 5, 4], np.int64))
    assert not is_range(np.array([3, 3, 5], np.int64))


def test_by_source_reorders_a_dense_permutation_keeping_pairs() -> None:
    cap = 200
    src, dst = _bufs(cap)
    rng = np.random.default_rng(1)
    s_idx, d_idx = rng.permutation(cap), rng.permutation(cap)
    e = _pair(s_idx, d_idx, cap, src, dst)
    r = by_source(e)
    assert r is not e and is_range(r.src_idx)
    assert dict(zip(r.src_idx.tolist(), r.dst_idx.tolist(), strict=True)) == dict(
        zip(s_idx.tolist(), d_idx.tolist(), strict=True))


@pytest.mark.parametrize("case", ["repeated_src", "repeated_dst", "sparse_src", "few"])
def test_by_source_leaves_other_pairs_alone(case: str) -> None:
    cap = 300
    src, dst = _bufs(cap)
    n = 100
    s_idx, d_idx = np.arange(n)[::-1].copy(), np.arange(n)
    if case == "repeated_src":
        s_idx[3] = s_idx[4]
    elif case == "repeated_dst":  # copy order decides which write wins: keep it
        d_idx[3] = d_idx[4]
    elif case == "sparse_src":
        s_idx = s_idx * 2
    else:
        s_idx, d_idx = s_idx[:10], d_idx[:10]
    e = _pair(s_idx, d_idx, cap, src, dst)
    assert by_source(e) is e


@pytest.mark.parametrize("pieces", [WHOLE, HEAD_SLICED], ids=["whole", "head_sliced"])
@pytest.mark.parametrize("shape", ["dense", "src_range", "dst_range", "both_range"])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_direct_copies_match_the_executor(shape: str, parts: int,
                                          pieces: list[list[int]]) -> None:
    cap = 256
    src, dst = _bufs(cap)
    rng = np.random.default_rng(7)
    n = 150
    s_idx = rng.permutation(cap)[:n]
    d_idx = rng.permutation(cap)[:n]
    if shape == "dense":
        s_idx, d_idx = rng.permutation(cap), rng.permutation(cap)
    if shape in ("src_range", "both_range"):
        s_idx = np.arange(50, 50 + n)
    if shape in ("dst_range", "both_range"):
        d_idx = np.arange(90, 90 + n)
    e = _pair(s_idx, d_idx, cap, src, dst, pieces)
    want = dst.copy()
    oracle = Plan(entries=(_pair(s_idx, d_idx, cap, src, want, pieces),))
    execute(oracle, HostMemory([src]), HostMemory([want]))
    for part in split_work((by_source(e),), parts, min_bytes=1):
        for x in part:
            copy_entry(x, _table(src), _table(dst))
    assert np.array_equal(dst, want)
