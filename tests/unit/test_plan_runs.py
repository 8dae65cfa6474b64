"""The one run-coalescer (``kvhandoff.plan.runs``) against a naive loop, and each of its
users against the coalescer it replaced."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from kvhandoff.plan.model import Plan, Segments, TensorPlan
from kvhandoff.plan.runs import run_starts, runs

I64 = npt.NDArray[np.int64]


def naive(sides: list[list[int]], steps: list[int]) -> tuple[list[int], list[int]]:
    """Element by element: i continues the run when every side moved by step[i - 1]."""
    first: list[int] = []
    count: list[int] = []
    for i in range(len(sides[0])):
        if i and all(a[i] == a[i - 1] + steps[i - 1] for a in sides):
            count[-1] += 1
        else:
            first.append(i)
            count.append(1)
    return first, count


def random_starts(rng: np.random.Generator, n: int, steps: I64) -> I64:
    """Starts that mostly continue each other, with some jumps back and forth."""
    jump = rng.integers(-3, 4, n) * (rng.random(n) < 0.3)
    return np.cumsum(np.concatenate(([rng.integers(0, 100)], steps[:-1] + jump[1:]))
                     ).astype(np.int64)[:n]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("sides", [1, 2, 3])
def test_runs_match_a_naive_loop(seed: int, sides: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 40))
    step: int | I64
    if seed % 2:
        step = int(rng.integers(1, 9))
        steps = np.full(max(n, 1), step, np.int64)
    else:
        step = steps = rng.integers(1, 9, max(n, 1)).astype(np.int64)
        step = step[:n]
    arrays = [random_starts(rng, n, steps) for _ in range(sides)]
    first, count = runs(*arrays, step=step)
    want_first, want_count = naive([a.tolist() for a in arrays], steps.tolist())
    assert first.tolist() == want_first and count.tolist() == want_count
    assert first.dtype == count.dtype == np.int64
    assert run_starts(*arrays, step=step).tolist() == want_first


def test_edges() -> None:
    empty = np.zeros(0, np.int64)
    assert [a.tolist() for a in runs(empty)] == [[], []]
    assert [a.tolist() for a in runs(np.array([7]), step=4)] == [[0], [1]]
    assert [a.tolist() for a in runs(np.array([3, 4, 5, 7, 8]))] == [[0, 3], [3, 2]]
    # both sides must continue: the destination jumps at position 2
    assert [a.tolist() for a in runs(np.array([0, 1, 2, 3]), np.array([5, 6, 9, 10]))] == \
        [[0, 2], [2, 2]]


# The coalescers this replaced, verbatim, as oracles for their former call sites.

def old_segments_coalesce(s: Segments) -> Segments:
    if len(s) < 2:
        return s
    end_s = s.src[:-1] + s.length[:-1]
    end_d = s.dst[:-1] + s.length[:-1]
    brk = np.flatnonzero((end_s != s.src[1:]) | (end_d != s.dst[1:])) + 1
    starts = np.concatenate(([0], brk))
    return Segments(s.src[starts], s.dst[starts], np.add.reduceat(s.length, starts))


def old_joint_runs(s_starts: I64, d_starts: I64, size: int) -> tuple[I64, I64, I64]:
    if len(s_starts) < 2:
        return s_starts, d_starts, np.full(len(s_starts), size, np.int64)
    brk = np.flatnonzero((s_starts[1:] != s_starts[:-1] + size)
                         | (d_starts[1:] != d_starts[:-1] + size)) + 1
    first = np.concatenate(([0], brk))
    sizes = np.diff(np.concatenate((first, [len(s_starts)]))) * size
    return s_starts[first], d_starts[first], sizes.astype(np.int64)


def old_block_runs(blocks: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for b in sorted(set(blocks)):
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_former_call_sites_are_unchanged(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 30))
    s_idx = random_starts(rng, n, np.ones(max(n, 1), np.int64))
    d_idx = random_starts(rng, n, np.ones(max(n, 1), np.int64))
    unit = int(rng.integers(1, 64))
    # Segments.coalesce, and TensorPlan.runs (old: the same breaks on np.diff != 1)
    e = TensorPlan(component="c", tensor="t", layer_id=0, src_ptr=1 << 20, dst_ptr=1 << 30,
                   src_unit=unit, dst_unit=unit, src_idx=s_idx, dst_idx=d_idx,
                   pieces=np.array([[0, 0, unit, 1, 0, 0]], np.int64))
    flat = e.segments()
    for got, want in ((flat.coalesce(), old_segments_coalesce(flat)),
                      (e.runs(), old_segments_coalesce(flat))):
        assert [a.tolist() for a in (got.src, got.dst, got.length)] == \
            [a.tolist() for a in (want.src, want.dst, want.length)]
    # views.copy_entry's joint runs, and tcp_data's one-sided runs
    first, count = runs(s_idx * unit, d_idx * unit, step=unit)
    want3 = old_joint_runs(s_idx * unit, d_idx * unit, unit)
    assert [(s_idx * unit)[first].tolist(), (d_idx * unit)[first].tolist(),
            (count * unit).tolist()] == [a.tolist() for a in want3]
    # host staging's block runs
    blocks = rng.integers(0, 20, n).tolist()
    ids = np.unique(np.asarray(blocks, np.int64))
    f, c = runs(ids)
    assert list(zip(ids[f].tolist(), c.tolist(), strict=True)) == old_block_runs(blocks)


@pytest.mark.parametrize("seed", range(20))
def test_layers_sharing_index_arrays_coalesce_like_every_segment_one_by_one(seed: int) -> None:
    """Plan.coalesce finds the runs of neighbouring layers that share index arrays once
    (as the planner's entries do); the result is that of coalescing every segment."""
    rng = np.random.default_rng(seed)
    entries = []
    for group in range(int(rng.integers(1, 4))):
        n = int(rng.integers(0, 12))
        s_idx = random_starts(rng, n, np.ones(max(n, 1), np.int64))
        d_idx = random_starts(rng, n, np.ones(max(n, 1), np.int64))
        unit = int(rng.integers(1, 64))
        strided = rng.random() < 0.3  # not whole units: a part of its own
        piece = [0, 0, unit // 2 or 1, 1, 0, 0] if strided else [0, 0, unit, 1, 0, 0]
        for layer in range(int(rng.integers(1, 5))):
            base = (group * 8 + layer) << 24
            entries.append(TensorPlan(
                component=f"c{group}", tensor="t", layer_id=layer,
                src_ptr=base + int(rng.integers(0, 2)) * 1000,  # some layers abut
                dst_ptr=(1 << 40) + base, src_unit=unit, dst_unit=unit,
                src_idx=s_idx, dst_idx=d_idx,
                pieces=np.array([piece], np.int64)))
    plan = Plan(entries=tuple(entries))
    got, want = plan.coalesce(), old_segments_coalesce(plan.flatten())
    assert [a.tolist() for a in (got.src, got.dst, got.length)] == \
        [a.tolist() for a in (want.src, want.dst, want.length)]
