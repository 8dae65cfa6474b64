"""Byte-exact delivery: every transport reproduces the numpy executor, bit for bit."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
from kvh_conformance import Pair, deliver, make

from kvhandoff.lab.testing.transport import KINDS
from kvhandoff.layout import Component, Layout, RowKind, ShardSpec, TensorSpec
from kvhandoff.plan import Indices, execute, plan
from kvhandoff.plan.execute import HostMemory
from kvhandoff.state_types import StateType
from kvhandoff.transport import TransferState

TIMEOUT = 60.0


@pytest.mark.parametrize("kind", KINDS)
def test_random_plan_kinds(pair: Pair, kind: str) -> None:
    deliver(pair, kind)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_mixed_plans_several_seeds(pair: Pair, seed: int) -> None:
    deliver(pair, "mixed", seed)


def test_submits_in_sequence_reuse_the_peer(pair: Pair) -> None:
    for seed in range(5):
        deliver(pair, "pages_4k", seed)


def _kv_layout(tp: int, rank: int, rng: np.random.Generator | None,
               alloc: Callable[[int], np.ndarray] = lambda n: np.zeros(n, np.uint8)
               ) -> tuple[Layout, list[np.ndarray]]:
    """Three layers of K and V pages, sharded by head over ``tp`` ranks."""
    heads, head_bytes, page, pages = 8, 64, 16, 64
    local = heads // tp
    tensors, bufs = [], []
    for layer in range(3):
        for n in ("k", "v"):
            buf = alloc(pages * page * local * head_bytes)
            if rng is not None:
                buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
            bufs.append(buf)
            tensors.append(TensorSpec(
                name=n, layer_id=layer, ptr=int(buf.ctypes.data), nbytes=buf.size,
                item_bytes=page * local * head_bytes, rows=page, row_kind=RowKind.TOKEN,
                shard=ShardSpec.axis(outer=page, axis=heads, inner_bytes=head_bytes)))
    layout = Layout(page_size=page, tp_rank=rank, tp_size=tp, components=(
        Component(type=StateType.KV, name="kv", tensors=tuple(tensors)),))
    return layout, bufs


def test_real_planner_heterogeneous_tp(name: str) -> None:
    """Prefill TP2 → decode TP1 through the real planner: each prefill rank writes its
    half of the heads into the same decode pages (head-sliced pieces)."""
    rng = np.random.default_rng(5)
    with make(name) as r0, make(name) as r1, make(name) as dec:
        dst, dst_bufs = _kv_layout(1, 0, None, dec.allocate)
        ep = dec.endpoint()
        expect = [b.copy() for b in dst_bufs]
        moved = {int(b.ctypes.data): int(e.ctypes.data)
                 for b, e in zip(dst_bufs, expect, strict=True)}
        handles, keep = [], []  # keep: every source stays alive until its write is done
        for rank, t in enumerate((r0, r1)):
            src, src_bufs = _kv_layout(2, rank, rng)
            keep.append(src_bufs)
            t.register(src)
            p = plan(src, dst, {"kv": Indices([3, 4, 9, 10, 11], [60, 2, 17, 18, 19])})
            assert len(p.entries) == 6 and p.num_segments > p.num_pieces * 5
            handles.append((t, t.submit(t.connect(ep), p)))
            # the oracle: the same plan, retargeted at copies of the destination
            oracle = replace(p, entries=tuple(replace(e, dst_ptr=moved[e.dst_ptr])
                                              for e in p.entries))
            execute(oracle, HostMemory(src_bufs), HostMemory(expect))
        for t, h in handles:
            assert t.wait(h, TIMEOUT) is TransferState.DONE, h.error
        for got, exp in zip(dst_bufs, expect, strict=True):
            assert np.array_equal(got, exp)


def test_concurrent_submits_to_several_peers(name: str) -> None:
    """Four threads submit to three receivers through one sender, all at once."""
    with make(name) as sender:
        receivers = [make(name) for _ in range(3)]
        try:
            pairs = [Pair(sender, r) for r in receivers]
            jobs = []
            for i, pr in enumerate(pairs):
                for j in range(2):
                    b = pr.builder(seed=10 * i + j)
                    p = b.plan("mixed" if j else "pages_4k")
                    jobs.append((pr, b, p, b.expected(p)))
            peers = [pr.connect() for pr in pairs]
            results: list[object] = [None] * len(jobs)

            def go(k: int) -> None:
                pr, _, p, _ = jobs[k]
                h = sender.submit(peers[pairs.index(pr)], p)
                results[k] = sender.wait(h, TIMEOUT)

            threads = [threading.Thread(target=go, args=(k,)) for k in range(len(jobs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT)
            assert results == [TransferState.DONE] * len(jobs)
            for _pr, b, _p, want in jobs:
                for (_, got), exp in zip(b.dsts, want, strict=True):
                    assert np.array_equal(got, exp)
        finally:
            for r in receivers:
                r.close()
