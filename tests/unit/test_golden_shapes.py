"""Golden tests: real model shapes, real bytes, every (prefill rank → decode rank) pair.

Each case builds numpy buffers for every rank of both sides, fills the prefill
ranks from one *global* random tensor per (component, tensor, layer), plans and
executes every pair, and compares each decode rank with a reconstruction written
with array reshapes and slices (head / channel groups cut per rank, pages paired
by position) — a check that shares nothing with the planner's byte arithmetic.
The geometry of each tensor comes from the model dims (``sem`` below), not from
the layouts' ShardSpecs, so it checks :mod:`kvhandoff.lab.shapes` as well.

Also here: the worked GDN conv example of sglang_facts.md §4.6 as exact pieces,
and one regression test per planner-relevant bug of sglang_facts.md §7.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvhandoff.errors import (
    IndexLengthMismatch,
    LayoutError,
    LayoutMismatch,
    OutOfBounds,
    PlanError,
    TrimWarning,
)
from kvhandoff.lab import shapes
from kvhandoff.lab.shapes import ConvInput, LayerKind, ModelShape
from kvhandoff.layout import NO_LAYER, Component, Layout, RowKind, TensorSpec
from kvhandoff.plan import Indices, Plan, check_compatible, plan
from kvhandoff.plan.execute import HostMemory, execute
from kvhandoff.state_types import LengthPolicy, StateType, policy

TP_PAIRS = [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2), (8, 2)]
NAMES = sorted(shapes.SHAPES)
Key = tuple[int, int]  # (pp_rank, tp_rank)


# ---------------------------------------------------------------------------------------
# Test geometry, from the model dims


@dataclass(frozen=True)
class Sem:
    """One unit (token row, ring row or item) is ``outer`` × concat(groups) × ``inner`` bytes;
    each group is cut per rank on its own (GQA: replicated once TP exceeds its length)."""

    outer: int
    groups: tuple[int, ...]
    inner: int


def sem(shape: ModelShape, comp: Component, t: TensorSpec) -> Sem | None:
    """How ``t`` is split over TP ranks, from the model's published dims; None = replicated."""
    s = shape
    if comp.type in (StateType.KV, StateType.SWA):  # NHD page rows: heads × head_dim
        heads, k_dim, v_dim = s.kv_geometry(t.layer_id)  # the layer's KV group
        return Sem(1, (heads,), (k_dim if t.name == "k" else v_dim) * s.kv_dtype_bytes)
    if comp.type is StateType.SHORT_CONV and t.name == "conv":  # (channels, K-1): one axis
        return Sem(1, (s.short_conv_channels,), (s.short_conv_kernel - 1) * s.conv_dtype_bytes)
    if comp.type is StateType.SHORT_CONV:  # a conv beside attention: over K / V heads, or
        c = next(c for c in s.layer_convs if c.name == t.name)  # the replicated hidden stream
        if c.input is ConvInput.HIDDEN:
            return None
        heads, k_dim, v_dim = s.kv_geometry(t.layer_id)
        dim = k_dim if c.input is ConvInput.KEYS else v_dim
        return Sem(1, (heads,), dim * (c.kernel - 1) * s.conv_dtype_bytes)
    if comp.type is StateType.MAMBA:
        w = s.conv_kernel - 1
        kd = s.linear_k_heads * s.linear_k_dim
        vd = s.linear_v_heads * s.linear_v_dim
        if t.name == "conv":
            if s.has(LayerKind.GDN):  # (channels, K-1), channels = q | k | v
                return Sem(1, (kd, kd, vd), w * s.conv_dtype_bytes)
            if s.has(LayerKind.KDA):  # transposed: (K-1, channels)
                return Sem(w, (vd, kd, kd), s.conv_dtype_bytes)
            if s.has(LayerKind.MAMBA1):  # (d_inner, K-1), one channel axis
                return Sem(1, (s.mamba_intermediate,), w * s.conv_dtype_bytes)
            x = s.mamba_heads * s.mamba_head_dim  # Mamba2: x | B | C
            bc = s.mamba_groups * s.mamba_state
            return Sem(1, (x, bc, bc), w * s.conv_dtype_bytes)
        if s.has(LayerKind.MAMBA1):  # (d_inner, state) fp32
            return Sem(1, (s.mamba_intermediate,), s.mamba_state * 4)
        if s.has(LayerKind.MAMBA2, LayerKind.ATTN_MAMBA2):  # (heads, head_dim, state) fp32
            return Sem(1, (s.mamba_heads,), s.mamba_head_dim * s.mamba_state * 4)
        return Sem(1, (s.linear_v_heads,), s.linear_v_dim * s.linear_k_dim * 4)
    return None


def cut(g: np.ndarray, sm: Sem, rank: int, tp: int) -> np.ndarray:
    """What TP rank ``rank`` of ``tp`` holds of global units ``g`` (n, outer, axis, inner)."""
    parts, off = [], 0
    for length in sm.groups:
        if tp <= length:
            n = length // tp
            parts.append(g[:, :, off + rank * n: off + (rank + 1) * n])
        else:  # more ranks than entries: consecutive ranks share one
            h = rank // (tp // length)
            parts.append(g[:, :, off + h: off + h + 1])
        off += length
    return np.concatenate(parts, axis=2).reshape(len(g), -1)


def num_units(t: TensorSpec) -> int:
    return t.capacity * (1 if t.row_kind is RowKind.ITEM else t.rows)


# ---------------------------------------------------------------------------------------
# Ranks with real buffers


@dataclass
class Side:
    tp: int
    pp: int
    layouts: dict[Key, Layout] = field(default_factory=dict)
    mems: dict[Key, HostMemory] = field(default_factory=dict)
    bufs: dict[Key, dict[int, np.ndarray]] = field(default_factory=dict)

    def tensors(self, key: Key) -> Iterator[tuple[Component, TensorSpec, np.ndarray]]:
        for c in self.layouts[key].components:
            for t in c.tensors:
                if t.nbytes:
                    yield c, t, self.bufs[key][t.ptr][: t.nbytes].reshape(num_units(t), -1)


def build(shape: ModelShape, tp: int, pp: int = 1, **kw: Any) -> Side:
    side = Side(tp, pp)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            mem, bufs = HostMemory(), dict[int, np.ndarray]()

            def alloc(nbytes: int, mem: HostMemory = mem, bufs: dict[int, np.ndarray] = bufs
                      ) -> int:
                buf = np.zeros(nbytes, dtype=np.uint8)
                ptr = mem.add(buf)
                bufs[ptr] = buf
                return ptr

            key = (pp_rank, tp_rank)
            side.layouts[key] = shapes.layout_for(
                shape, tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp, alloc=alloc, **kw
            )
            side.mems[key], side.bufs[key] = mem, bufs
    return side


def owner(src: Side, t: TensorSpec) -> int:
    """The prefill PP stage whose bytes of ``t`` land on decode."""
    if t.layer_id == NO_LAYER:
        return src.pp - 1  # only the last stage (it sampled the first token) writes
    return next(p for p in range(src.pp)
                if src.layouts[(p, 0)].layers[0] <= t.layer_id < src.layouts[(p, 0)].layers[1])


def unit_pairs(ctype: StateType, idx: Indices, ts: TensorSpec, td: TensorSpec
               ) -> list[tuple[int, int]]:
    """(prefill unit, decode unit) pairs: pages/slots/rows paired position by position."""
    s, d = [int(v) for v in idx.src], [int(v) for v in idx.dst]
    rows_differ = ts.rows != td.rows
    if ts.row_kind is RowKind.TOKEN and (rows_differ or idx.src_first_row or idx.dst_first_row):
        rs = [p * ts.rows + r for p in s for r in range(ts.rows)][idx.src_first_row:]
        rd = [p * td.rows + r for p in d for r in range(td.rows)][idx.dst_first_row:]
        n = idx.num_rows if idx.num_rows is not None else min(len(rs), len(rd))
        return list(zip(rs[:n], rd[:n], strict=True))
    if policy(ctype).length is LengthPolicy.TRIM:
        s, d = s[: len(d)], d[: len(s)]
    assert len(s) == len(d)
    if ts.row_kind is RowKind.RING and rows_differ:
        assert idx.positions is not None
        return [(i * ts.rows + p % ts.rows, j * td.rows + p % td.rows)
                for i, j in zip(s, d, strict=True) for p in idx.positions.tolist()]
    if ts.row_kind is RowKind.ITEM:
        return list(zip(s, d, strict=True))
    return [(i * ts.rows + r, j * ts.rows + r) for i, j in zip(s, d, strict=True)
            for r in range(ts.rows)]


@dataclass
class Outcome:
    plans: dict[tuple[Key, Key], Plan]
    moved: dict[Key, int]  # bytes moved into each decode rank


def run_golden(
    shape: ModelShape, src: Side, dst: Side, *, num_tokens: int, seed: int = 0,
    contiguous: bool = False, prefix_len: int = 0,
) -> Outcome:
    rng = np.random.default_rng(seed)
    # prefill: every rank's bytes are its cut of one global tensor per key
    glob: dict[tuple[object, ...], np.ndarray] = {}
    for key in src.layouts:
        for c, t, view in src.tensors(key):
            sm = sem(shape, c, t)
            gk: tuple[object, ...] = (c.name, t.name, t.layer_id)
            if t.layer_id == NO_LAYER:
                gk += (key[0],)  # each stage has its own rows
            if gk not in glob:
                shape_ = ((num_units(t), view.shape[1]) if sm is None
                          else (num_units(t), sm.outer, sum(sm.groups), sm.inner))
                glob[gk] = rng.integers(0, 256, shape_, dtype=np.uint8)
            g = glob[gk]
            local = g if sm is None else cut(g, sm, key[1], src.tp)
            assert local.shape == view.shape, (c.name, t.name, t.layer_id, local.shape, view.shape)
            view[:] = local
    before = {k: {p: b.copy() for p, b in src.bufs[k].items()} for k in src.bufs}
    for key in dst.layouts:
        for _, _, view in dst.tensors(key):
            view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)
    sentinel = {k: {p: b.copy() for p, b in dst.bufs[k].items()} for k in dst.bufs}

    plans: dict[tuple[Key, Key], Plan] = {}
    moved = {k: 0 for k in dst.layouts}
    requests: dict[tuple[Key, Key], dict[str, Indices | None]] = {}
    for dk, dl in dst.layouts.items():
        for sk, sl in src.layouts.items():
            req = shapes.request_for(shape, sl, dl, num_tokens, seed=seed,
                                     contiguous=contiguous, prefix_len=prefix_len)
            requests[(sk, dk)] = req
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", TrimWarning)
                p = plan(sl, dl, req)
            plans[(sk, dk)] = p
            moved[dk] += execute(p, src.mems[sk], dst.mems[dk])

    for k in src.bufs:  # the planner never writes the source
        for ptr, b in src.bufs[k].items():
            np.testing.assert_array_equal(b, before[k][ptr])

    for dk in dst.layouts:
        expect_bytes = 0
        for c, td, view in dst.tensors(dk):
            stage = owner(src, td)
            src_by = {t.key: t for t in src.layouts[(stage, 0)].component(c.name).tensors}
            ts = src_by[td.key]
            dk_key: tuple[object, ...] = (c.name, td.name, td.layer_id)
            if td.layer_id == NO_LAYER:
                dk_key += (stage,)
            g = glob[dk_key]
            idx = requests[((stage, 0), dk)][c.name]
            want = sentinel[dk][td.ptr][: td.nbytes].reshape(view.shape).copy()
            if idx is not None and not td.elided:
                pairs = unit_pairs(c.type, idx, ts, td)
                if pairs:
                    su, du = (np.array(v) for v in zip(*pairs, strict=True))
                    assert len(set(du.tolist())) == len(du)
                    sm = sem(shape, c, td)
                    want[du] = g[su] if sm is None else cut(g[su], sm, dk[1], dst.tp)
                    expect_bytes += len(du) * view.shape[1]
            where = f"{shape.name} decode {dk} {c.name}/{td.name} layer {td.layer_id}"
            assert np.array_equal(view, want), where
        assert moved[dk] == expect_bytes, f"decode {dk}: moved {moved[dk]} B, want {expect_bytes}"
    check_segments(src, dst, plans, sentinel)
    return Outcome(plans, moved)


def check_segments(src: Side, dst: Side, plans: dict[tuple[Key, Key], Plan],
                   sentinel: dict[Key, dict[int, np.ndarray]]) -> None:
    """The flat forms move the same bytes as the factored plan, and no decode byte is
    written twice (by one source or by two)."""
    for dk in dst.layouts:
        result = {ptr: b.copy() for ptr, b in dst.bufs[dk].items()}
        for form in ("flatten", "coalesce"):
            for ptr, b in dst.bufs[dk].items():
                b[:] = sentinel[dk][ptr]
            starts, ends = [], []
            for (sk, k), p in plans.items():
                if k != dk:
                    continue
                segs = getattr(p, form)()
                assert segs.nbytes == p.nbytes
                for a, b_, n in zip(segs.src.tolist(), segs.dst.tolist(), segs.length.tolist(),
                                    strict=True):
                    dst.mems[dk].view(b_)[:n] = src.mems[sk].view(a)[:n]
                starts.append(segs.dst)
                ends.append(segs.dst + segs.length)
            for ptr, b in dst.bufs[dk].items():
                np.testing.assert_array_equal(b, result[ptr], err_msg=f"{form} decode {dk}")
            if starts:
                order = np.argsort(np.concatenate(starts), kind="stable")
                lo, hi = np.concatenate(starts)[order], np.concatenate(ends)[order]
                assert (hi[:-1] <= lo[1:]).all(), f"{form}: overlapping writes into decode {dk}"


# sizes for the tiny golden cases
def sizes(shape: ModelShape) -> dict[str, int]:
    if shape.has(LayerKind.DSV4_C4):
        return dict(page_size=256, num_pages=6, num_slots=4, swa_page_size=8, num_swa_pages=16)
    return dict(page_size=4, num_pages=16, num_slots=4)


def tokens(shape: ModelShape) -> int:
    return 601 if shape.has(LayerKind.DSV4_C4) else 37


# ---------------------------------------------------------------------------------------
# Golden cases


@pytest.mark.parametrize(("tp_src", "tp_dst"), TP_PAIRS, ids=[f"tp{a}to{b}" for a, b in TP_PAIRS])
@pytest.mark.parametrize("name", NAMES)
def test_golden_tp(name: str, tp_src: int, tp_dst: int) -> None:
    shape = shapes.tiny(shapes.get(name))
    src, dst = build(shape, tp_src, **sizes(shape)), build(shape, tp_dst, **sizes(shape))
    out = run_golden(shape, src, dst, num_tokens=tokens(shape), seed=tp_src * 10 + tp_dst)
    assert all(out.moved.values())


@pytest.mark.parametrize("name", NAMES)
def test_golden_pp2_to_pp1(name: str) -> None:
    shape = shapes.tiny(shapes.get(name))
    src = build(shape, 2, pp=2, **sizes(shape))
    dst = build(shape, 1, **sizes(shape))
    run_golden(shape, src, dst, num_tokens=tokens(shape), seed=7, contiguous=True)


@pytest.mark.parametrize("name", ["llama", "gpt_oss", "qwen3_next"])
@pytest.mark.parametrize(("page_src", "page_dst", "tp_src", "tp_dst"),
                         [(4, 8, 2, 1), (8, 4, 2, 1), (2, 8, 1, 4)])
def test_golden_repaging(name: str, page_src: int, page_dst: int, tp_src: int, tp_dst: int
                         ) -> None:
    """Prefill and decode page sizes differ: token rows move one by one, windows included."""
    shape = shapes.tiny(shapes.get(name))
    src = build(shape, tp_src, page_size=page_src, num_pages=24, num_slots=4)
    dst = build(shape, tp_dst, page_size=page_dst, num_pages=24, num_slots=4)
    run_golden(shape, src, dst, num_tokens=45, seed=3)
    run_golden(shape, src, dst, num_tokens=45, prefix_len=16, seed=4)  # mid-page on prefill


@pytest.mark.parametrize("name", NAMES)
def test_golden_edge_lengths(name: str) -> None:
    """Empty, one-token and page-aligned sequences (for DSv4: C128-aligned, so nothing
    request-scoped is pending)."""
    shape = shapes.tiny(shapes.get(name))
    src, dst = build(shape, 2, **sizes(shape)), build(shape, 4, **sizes(shape))
    aligned = 512 if shape.has(LayerKind.DSV4_C4) else 40
    for n in (0, 1, aligned):
        run_golden(shape, src, dst, num_tokens=n, seed=n)


FALCON_H1_LIKE = ModelShape(
    # every layer keeps attention K/V pages *and* a Mamba2 slot (Falcon-H1's "hybrid" layers)
    name="attn_mamba2", layers=(LayerKind.ATTN_MAMBA2,) * 4, kv_heads=2, head_dim=8,
    mamba_heads=8, mamba_head_dim=4, mamba_groups=8, mamba_state=4, aux_row_bytes=64,
)


@pytest.mark.parametrize(("tp_src", "tp_dst"), TP_PAIRS, ids=[f"tp{a}to{b}" for a, b in TP_PAIRS])
def test_golden_attention_and_mamba2_in_one_layer(tp_src: int, tp_dst: int) -> None:
    shape = FALCON_H1_LIKE
    src, dst = build(shape, tp_src, **sizes(shape)), build(shape, tp_dst, **sizes(shape))
    lay = src.layouts[(0, 0)]
    for comp, names in (("kv", {"k", "v"}), ("mamba", {"conv", "ssm"})):
        assert {t.key for t in lay.component(comp).tensors} == {
            (n, i) for n in names for i in range(4)}
    out = run_golden(shape, src, dst, num_tokens=37, seed=tp_src * 10 + tp_dst)
    assert all(out.moved.values())


def test_golden_pp4_uneven_stages() -> None:
    shape = shapes.tiny(shapes.QWEN3_NEXT, num_layers=6)
    src = build(shape, 2, pp=4, **sizes(shape))
    assert [src.layouts[(p, 0)].layers for p in range(4)] == [(0, 1), (1, 3), (3, 4), (4, 6)]
    run_golden(shape, src, build(shape, 1, **sizes(shape)), num_tokens=37, seed=8)


def test_golden_decode_prefix_and_aligned_prompt() -> None:
    shape = shapes.tiny(shapes.QWEN3_NEXT)
    src, dst = build(shape, 1, **sizes(shape)), build(shape, 2, **sizes(shape))
    run_golden(shape, src, dst, num_tokens=40, prefix_len=16, seed=5)


@pytest.mark.parametrize(("spec_src", "spec_dst"), [(False, True), (True, False)])
def test_golden_dsv4_rings_of_8_and_16(spec_src: bool, spec_dst: bool) -> None:
    """Speculative decoding doubles the C4 rings (item 2×): rows pair by logical position."""
    shape = shapes.tiny(shapes.DEEPSEEK_V4)
    src = build(shape, 1, spec_decode=spec_src, **sizes(shape))
    dst = build(shape, 2, spec_decode=spec_dst, **sizes(shape))
    out = run_golden(shape, src, dst, num_tokens=603, seed=11)
    ring_s = tensor(src.layouts[(0, 0)], "swa", "c4_state", 2)
    ring_d = tensor(dst.layouts[(0, 0)], "swa", "c4_state", 2)
    assert ring_s.item_bytes * 2 ** (spec_dst - spec_src) == ring_d.item_bytes
    e = next(e for e in out.plans[((0, 0), (0, 0))].entries if e.tensor == "c4_state")
    assert e.src_unit == e.dst_unit == ring_s.row_bytes  # moved by row, not by item
    swa = shapes.request_for(shape, src.layouts[(0, 0)], dst.layouts[(0, 0)], 603, seed=11)["swa"]
    assert swa is not None and swa.positions is not None
    assert len(swa.positions) == 603 % 4 + 4  # the compressor's live positions
    assert len(e.src_idx) == len(swa.src) * len(swa.positions)  # for each window page


@pytest.mark.parametrize("contiguous", [True, False])
def test_contiguous_pages_coalesce_to_one_run_per_tensor(contiguous: bool) -> None:
    shape = shapes.tiny(shapes.LLAMA)
    src, dst = build(shape, 1, **sizes(shape)), build(shape, 1, **sizes(shape))
    out = run_golden(shape, src, dst, num_tokens=37, contiguous=contiguous)
    p = out.plans[((0, 0), (0, 0))]
    runs = len(p.coalesce())
    if contiguous:  # one run per K/V layer tensor + the aux row
        assert runs == 2 * shape.num_layers + 1
    else:
        assert runs > 2 * shape.num_layers + 1


# ---------------------------------------------------------------------------------------
# Published dims, at real size (fake addresses: nothing is allocated)


def real_layout(shape: ModelShape, tp_rank: int, tp: int, **kw: Any) -> Layout:
    args: dict[str, Any] = dict(page_size=256 if shape.has(LayerKind.DSV4_C4) else 64,
                                num_pages=4, num_slots=4)
    args.update(kw)
    return shapes.layout_for(shape, tp_rank=tp_rank, tp_size=tp, **args)


def tensor(layout: Layout, comp: str, name: str, layer: int) -> TensorSpec:
    return next(t for t in layout.component(comp).tensors if t.key == (name, layer))


def test_real_shapes_have_published_item_sizes() -> None:
    q = real_layout(shapes.QWEN3_NEXT, 0, 2)
    assert tensor(q, "mamba", "conv", 0).item_bytes == 24576  # (2*2048+4096)/2 x 3 x bf16
    assert tensor(q, "mamba", "ssm", 0).item_bytes == 16 * 128 * 128 * 4
    assert tensor(q, "kv", "k", 3).item_bytes == 64 * 1 * 256 * 2  # 2 KV heads / TP 2
    assert {t.layer_id for t in q.component("kv").tensors} == set(range(3, 48, 4))
    q8 = real_layout(shapes.QWEN3_NEXT, 5, 8)  # GQA: 2 heads over 8 ranks, one each
    assert tensor(q8, "kv", "v", 47).item_bytes == 64 * 256 * 2
    ll = real_layout(shapes.LLAMA, 0, 1)
    assert tensor(ll, "kv", "k", 79).item_bytes == 64 * 8 * 128 * 2
    ds = real_layout(shapes.DEEPSEEK_V32, 3, 4)
    assert tensor(ds, "kv", "kv", 60).item_bytes == 64 * 1152
    assert tensor(ds, "nsa", "index_k", 0).item_bytes == 8448  # 64 x (128 + 4)
    nm = real_layout(shapes.NEMOTRON_H, 0, 1)
    assert tensor(nm, "mamba", "conv", 0).item_bytes == (8192 + 2 * 8 * 128) * 3 * 2
    assert len(nm.component("mamba").tensors) == 2 * 24 and len(nm.component("kv").tensors) == 8
    go = real_layout(shapes.GPT_OSS, 1, 2)
    assert {t.layer_id for t in go.component("swa").tensors} == set(range(0, 36, 2))
    assert tensor(go, "swa", "k", 0).item_bytes == 64 * 4 * 64 * 2
    v4 = real_layout(shapes.DEEPSEEK_V4, 0, 1)
    assert tensor(v4, "kv", "kv", 2).item_bytes == 64 * 576  # C4: 256-token page, 64 rows
    assert tensor(v4, "kv", "kv", 3).item_bytes == 2 * 576  # C128: 2 rows
    assert tensor(v4, "swa", "c4_state", 2).rows == 8
    assert tensor(real_layout(shapes.DEEPSEEK_V4, 0, 1, spec_decode=True),
                  "swa", "c4_state", 2).rows == 16
    assert tensor(v4, "swa_ring", "swa_ring", 43).item_bytes == 576  # NextN draft layer
    kimi = real_layout(shapes.KIMI_LINEAR, 0, 2)
    conv = tensor(kimi, "mamba", "conv", 0)
    assert conv.shard is not None and conv.shard.outer == 3
    assert conv.item_bytes == 3 * (3 * 4096) // 2 * 2


def test_kv_groups_have_their_own_page_shape_and_sharding() -> None:
    """A pool per page shape: Gemma 4's full layers hold 512-dim heads beside 256-dim
    sliding ones; MiMo-V2-Flash's K and V differ in head dim and its full layers have half
    the KV heads of its sliding ones, so at TP 8 the sliding group is sharded (one head
    per rank) while the full group is replicated (each head on two ranks)."""
    g = real_layout(shapes.GEMMA4, 1, 2)
    assert tensor(g, "swa", "k", 0).item_bytes == 64 * 2 * 256 * 2
    assert tensor(g, "kv", "v", 5).item_bytes == 64 * 2 * 512 * 2
    assert {t.layer_id for t in g.component("kv").tensors} == {5, 11, 17, 23, 29}
    m = real_layout(shapes.MIMO_V2_FLASH, 3, 8)
    swa_k, swa_v = tensor(m, "swa", "k", 1), tensor(m, "swa", "v", 1)
    full_k = tensor(m, "kv", "k", 0)
    assert (swa_k.item_bytes, swa_v.item_bytes) == (64 * 192 * 2, 64 * 128 * 2)
    assert full_k.item_bytes == 64 * 192 * 2
    assert swa_k.shard is not None and full_k.shard is not None
    assert swa_k.shard.ranges(3, 8)[0].replicas == 1
    assert (full_k.shard.ranges(3, 8)[0].start, full_k.shard.ranges(3, 8)[0].replicas) == (1, 2)
    ink = real_layout(shapes.INKLING, 1, 4)
    assert tensor(ink, "swa", "k", 0).item_bytes == 64 * 4 * 128 * 2
    assert tensor(ink, "kv", "v", 5).item_bytes == 64 * 2 * 128 * 2
    assert tensor(ink, "short_conv", "conv0", 0).item_bytes == 4 * 128 * 3 * 2  # K heads / 4
    assert tensor(ink, "short_conv", "conv1", 5).item_bytes == 2 * 128 * 3 * 2  # V heads / 4
    hidden = tensor(ink, "short_conv", "conv3", 5)
    assert hidden.shard is None and hidden.item_bytes == 6144 * 3 * 2  # replicated
    # a decode whose full layers have another head dim is refused before any request,
    # naming the layer; the same model across TP (one group replicated, one not) is fine
    other = dataclasses.replace(shapes.GEMMA4, kv_groups=(
        shapes.KVGroup(layers=shapes.GEMMA4.kv_groups[0].layers, kv_heads=4, head_dim=256),))
    with pytest.raises(LayoutMismatch, match=r"component 'kv' tensor 'k' layer 5"):
        check_compatible(real_layout(shapes.GEMMA4, 0, 2), real_layout(other, 0, 2))
    check_compatible(real_layout(shapes.MIMO_V2_FLASH, 0, 2),
                     real_layout(shapes.MIMO_V2_FLASH, 5, 8))
    with pytest.raises(LayoutError, match="no attention layers"):
        dataclasses.replace(shapes.GEMMA4, kv_groups=(
            shapes.KVGroup(layers=(30,), kv_heads=4, head_dim=512),))


def test_jamba_mamba1_slots_are_sharded_by_d_inner() -> None:
    j = real_layout(shapes.JAMBA, 1, 2)  # d_inner 8192, d_state 16, d_conv 4
    assert tensor(j, "mamba", "conv", 0).item_bytes == 8192 // 2 * 3 * 2  # (d_inner/2, K-1) bf16
    assert tensor(j, "mamba", "ssm", 0).item_bytes == 8192 // 2 * 16 * 4  # (d_inner/2, 16) fp32
    assert {t.layer_id for t in j.component("kv").tensors} == {4, 12, 20, 28}
    assert tensor(j, "kv", "k", 4).item_bytes == 64 * 4 * 128 * 2  # 8 KV heads / TP 2
    assert len(j.component("mamba").tensors) == 2 * 28
    with pytest.raises(LayoutError, match="would share the 'mamba' component"):
        dataclasses.replace(shapes.JAMBA, layers=(LayerKind.MAMBA1, LayerKind.MAMBA2))


def test_pp_stages_split_layers_evenly_and_register_only_theirs() -> None:
    shape = shapes.QWEN3_NEXT
    stages = [shapes.layout_for(shape, tp_rank=0, tp_size=1, pp_rank=r, pp_size=3,
                                page_size=64, num_pages=4, num_slots=4) for r in range(3)]
    assert [s.layers for s in stages] == [(0, 16), (16, 32), (32, 48)]
    for s in stages:
        for c in s.components:
            for t in c.tensors:
                assert t.layer_id == NO_LAYER or s.layers[0] <= t.layer_id < s.layers[1]
    assert sum(len(s.component("mamba").tensors) for s in stages) == 2 * 36


# ---------------------------------------------------------------------------------------
# sglang_facts.md §4.6: the worked GDN conv example, exactly


def gdn_plan(tp_src: int, src_rank: int, tp_dst: int, dst_rank: int) -> Plan:
    src = real_layout(shapes.QWEN3_NEXT, src_rank, tp_src)
    dst = real_layout(shapes.QWEN3_NEXT, dst_rank, tp_dst)
    return plan(src, dst, {"kv": Indices([], []), "mamba": Indices([1], [2]), "aux": None})


def entry(p: Plan, name: str, layer: int = 0) -> tuple[int, int, np.ndarray]:
    e = next(e for e in p.entries if (e.tensor, e.layer_id) == (name, layer))
    return e.src_unit, e.dst_unit, e.pieces


def test_gdn_conv_worked_example_p_tp2_to_d_tp4() -> None:
    p = gdn_plan(2, 0, 4, 1)  # decode rank 1 is fed by prefill rank 0
    su, du, pcs = entry(p, "conv")
    assert (su, du) == (24576, 12288)
    assert pcs[:, :4].tolist() == [[3072, 0, 3072, 1], [9216, 3072, 3072, 1],
                                   [18432, 6144, 6144, 1]]
    su, du, pcs = entry(p, "ssm")  # temporal fp32 (16 -> 8 heads, 128, 128)
    assert pcs[:, :4].tolist() == [[524288, 0, 524288, 1]]
    assert not gdn_plan(2, 1, 4, 1)  # prefill rank 1 holds none of decode rank 1's channels


def test_gdn_conv_worked_example_p_tp4_to_d_tp2() -> None:
    p = gdn_plan(4, 1, 2, 0)  # prefill rank 1 writes its second quarter of q, k and v
    logical = [(0, 512, 512), (512, 1536, 512), (1024, 3072, 1024)]  # (src, dst, dims)
    _, _, pcs = entry(p, "conv")
    assert pcs[:, :3].tolist() == [[a * 6, b * 6, n * 6] for a, b, n in logical]  # 6 B/dim
    assert not gdn_plan(4, 1, 2, 1)


# ---------------------------------------------------------------------------------------
# Regressions of sglang_facts.md §7


@pytest.mark.parametrize(("name", "comp"), [("gpt_oss", "swa"), ("deepseek_v32", "nsa")])
@pytest.mark.parametrize("longer", ["prefill", "decode"])
def test_23323_trim_clips_both_directions(name: str, comp: str, longer: str) -> None:
    shape = shapes.tiny(shapes.get(name))
    src, dst = build(shape, 1, **sizes(shape)), build(shape, 1, **sizes(shape))
    sl, dl = src.layouts[(0, 0)], dst.layouts[(0, 0)]
    req = shapes.request_for(shape, sl, dl, 37, seed=1)
    a, b = [3, 4, 5], [9, 10]
    req[comp] = Indices(a, b) if longer == "prefill" else Indices(b, a)
    with pytest.warns(TrimWarning, match=rf"component '{comp}'.*common prefix of 2"):
        p = plan(sl, dl, req)
    assert any("common prefix of 2" in n for n in p.notes)
    for e in p.entries:
        if e.component == comp:
            assert len(e.src_idx) == 2
    execute(p, src.mems[(0, 0)], dst.mems[(0, 0)])
    t_s = next(t for t in sl.component(comp).tensors if t.nbytes)
    t_d = tensor(dl, comp, t_s.name, t_s.layer_id)
    s_pages = src.bufs[(0, 0)][t_s.ptr].reshape(t_s.capacity, -1)
    d_pages = dst.bufs[(0, 0)][t_d.ptr].reshape(t_d.capacity, -1)
    src_ids, dst_ids = (a, b) if longer == "prefill" else (b, a)
    np.testing.assert_array_equal(d_pages[dst_ids[:2]], s_pages[src_ids[:2]])
    untouched = np.setdiff1d(np.arange(t_d.capacity), dst_ids[:2])
    assert not d_pages[untouched].any()


def test_27004_page_aligned_prompt() -> None:
    shape = shapes.tiny(shapes.GPT_OSS)
    src, dst = build(shape, 2, **sizes(shape)), build(shape, 1, **sizes(shape))
    sl, dl = src.layouts[(0, 0)], dst.layouts[(0, 0)]
    req = shapes.request_for(shape, sl, dl, 40, seed=2)  # 40 tokens = 10 full pages
    kv = req["kv"]
    assert kv is not None and len(kv.src) == len(kv.dst) == 10
    plan(sl, dl, req)  # equal lists: no crash
    run_golden(shape, src, dst, num_tokens=40, seed=2)
    # the bug: prefill counted the sampled token, so it sent one page more
    extra = dict(req, kv=Indices([*kv.src.tolist(), 15], kv.dst))
    with pytest.raises(IndexLengthMismatch, match=r"component 'kv'.*prefill has 11, decode has 10"):
        plan(sl, dl, extra)
    swa = req["swa"]
    assert swa is not None  # a trim component tolerates the drift and says so
    with pytest.warns(TrimWarning, match="component 'swa'"):
        plan(sl, dl, dict(req, swa=Indices([*swa.src.tolist(), 15], swa.dst)))


def test_22060_gdn_conv_is_cut_per_q_k_v_group_not_as_one_range() -> None:
    shape = shapes.tiny(shapes.QWEN3_NEXT)
    src, dst = build(shape, 2, **sizes(shape)), build(shape, 4, **sizes(shape))
    run_golden(shape, src, dst, num_tokens=37, seed=4)
    m = shapes.request_for(shape, src.layouts[(0, 0)], dst.layouts[(0, 0)], 37, seed=4)["mamba"]
    assert m is not None
    slots = int(m.src[0]), int(m.dst[0])
    kd = shape.linear_k_heads * shape.linear_k_dim
    vd = shape.linear_v_heads * shape.linear_v_dim
    w = (shape.conv_kernel - 1) * 2
    for r in range(4):
        conv = tensor(dst.layouts[(0, r)], "mamba", "conv", 0)
        got = dst.bufs[(0, r)][conv.ptr].reshape(conv.capacity, -1, w)
        s_conv = [tensor(src.layouts[(0, q)], "mamba", "conv", 0) for q in range(2)]
        full = np.concatenate([src.bufs[(0, q)][t.ptr].reshape(t.capacity, -1, w)
                               for q, t in enumerate(s_conv)], axis=1)  # [q0 k0 v0 q1 k1 v1]
        per_rank = [np.split(f, [kd // 2, kd], axis=1) for f in np.split(full, 2, axis=1)]
        q, k, v = (np.concatenate([pr[i] for pr in per_rank], axis=1) for i in range(3))
        right = np.concatenate([np.split(x, 4, axis=1)[r] for x in (q, k, v)], axis=1)
        wrong = np.split(full, 4, axis=1)[r]  # one contiguous range: mixes q, k and v
        assert right.shape == wrong.shape == (conv.capacity, (2 * kd + vd) // 4, w)
        s_slot, d_slot = slots
        np.testing.assert_array_equal(got[d_slot], right[s_slot])
        assert not np.array_equal(got[d_slot], wrong[s_slot])


def test_24878_no_state_type_is_silently_skipped() -> None:
    shape = shapes.tiny(shapes.DEEPSEEK_V4)
    src, dst = build(shape, 1, **sizes(shape)), build(shape, 1, **sizes(shape))
    sl, dl = src.layouts[(0, 0)], dst.layouts[(0, 0)]
    req = shapes.request_for(shape, sl, dl, 601)
    moved = plan(sl, dl, req).by_component()
    assert set(moved) == {c.name for c in sl.components}  # every component moves bytes
    assert all(moved.values())
    for comp in req:  # forgetting one is an error, never a skip
        with pytest.raises(PlanError, match=rf"missing \['{comp}'\]"):
            plan(sl, dl, {k: v for k, v in req.items() if k != comp})
    # a component registered on one side only fails at pairing, naming it
    no_ring = dataclasses.replace(dl, components=tuple(
        c for c in dl.components if c.name != "swa_ring"))
    with pytest.raises(LayoutMismatch, match=r"'swa_ring' \(dsv4_ring\) exists on prefill only"):
        check_compatible(sl, no_ring)
    with pytest.raises(LayoutMismatch, match=r"'swa_ring' \(dsv4_ring\) exists on decode only"):
        check_compatible(no_ring, dl)
    # and a component whose tensors are missing on decode
    empty = dataclasses.replace(dl, components=tuple(
        dataclasses.replace(c, tensors=()) if c.name == "c128_state" else c
        for c in dl.components))
    with pytest.raises(LayoutMismatch, match=r"'c128_state'.*no decode counterpart"):
        check_compatible(sl, empty)


def test_elided_and_zero_length_buffers() -> None:
    shape = dataclasses.replace(shapes.tiny(shapes.DEEPSEEK_V32), index_elided_layers=(1, 2))
    src, dst = build(shape, 2, **sizes(shape)), build(shape, 1, **sizes(shape))
    sl, dl = src.layouts[(0, 0)], dst.layouts[(0, 0)]
    elided = tensor(sl, "nsa", "index_k", 1)
    assert elided.elided and elided.nbytes == 0
    assert all(r.nbytes for r in sl.regions)  # nothing of length 0 is registered
    out = run_golden(shape, src, dst, num_tokens=37, seed=9)
    layers = {e.layer_id for p in out.plans.values() for e in p.entries if e.component == "nsa"}
    assert layers == {0, 3}
    # elided on one side only
    other = build(dataclasses.replace(shape, index_elided_layers=(1,)), 1, **sizes(shape))
    with pytest.raises(LayoutMismatch, match=r"'nsa' tensor 'index_k' layer 2: elided .*prefill"):
        check_compatible(sl, other.layouts[(0, 0)])
    # a full decode-prefix hit: no KV pages, the rest still moves
    req = shapes.request_for(shape, sl, dl, 36, prefix_len=36)
    kv = req["kv"]
    assert kv is not None and len(kv.src) == len(kv.dst) == 0
    assert set(plan(sl, dl, req).by_component()) == {"aux"}
    # a zero-length tensor that an index reaches is out of bounds, not a silent write
    zero = dataclasses.replace(dl, components=tuple(
        dataclasses.replace(c, tensors=(dataclasses.replace(c.tensors[0], nbytes=0),))
        if c.name == "aux" else c for c in dl.components), regions=())
    with pytest.raises(OutOfBounds, match=r"'aux'.*decode index"):
        plan(sl, zero, req)


def test_item_length_mismatch_names_component_tensor_and_sizes() -> None:
    # sharded: a decode model with half the GDN heads (24576 B vs 12288 B per slot at TP 2)
    half = dataclasses.replace(shapes.QWEN3_NEXT, linear_k_heads=8, linear_v_heads=16)
    with pytest.raises(LayoutMismatch) as exc:
        check_compatible(real_layout(shapes.QWEN3_NEXT, 0, 2), real_layout(half, 0, 2))
    msg = str(exc.value)
    assert "component 'mamba' tensor 'conv' layer 0" in msg
    assert "prefill item 24576 B vs decode item 12288 B" in msg
    # replicated: aux rows of different width
    narrow = dataclasses.replace(shapes.LLAMA, aux_row_bytes=128)
    with pytest.raises(LayoutMismatch, match=r"component 'aux' tensor 'aux' layer -1: .*"
                                             r"prefill item 256 B, decode item 128 B"):
        check_compatible(real_layout(shapes.LLAMA, 0, 1), real_layout(narrow, 0, 1))
    # the same model across TP is not a mismatch, though the items differ
    check_compatible(real_layout(shapes.QWEN3_NEXT, 0, 2), real_layout(shapes.QWEN3_NEXT, 1, 4))


def test_27093_each_mla_layer_is_planned_with_its_own_item_length() -> None:
    # DeepSeek-V4: C4 layers hold 64 compressed rows per page, C128 layers 2
    shape = shapes.tiny(shapes.DEEPSEEK_V4)
    src, dst = build(shape, 2, **sizes(shape)), build(shape, 1, **sizes(shape))
    out = run_golden(shape, src, dst, num_tokens=601, seed=13)
    p = out.plans[((0, 0), (0, 0))]
    units = {e.layer_id: e.src_unit for e in p.entries if (e.component, e.tensor) == ("kv", "kv")}
    sl = src.layouts[(0, 0)]
    assert units == {t.layer_id: t.item_bytes for t in sl.component("kv").tensors
                     if t.name == "kv"}
    assert len(set(units.values())) == 2
    # an MLA pool whose layers differ in row width (e.g. an fp8 layer next to bf16 ones)
    mem_s, mem_d = HostMemory(), HostMemory()
    widths = {0: 1152, 1: 656, 2: 1152}
    page, pages = 2, 6

    def mla(mem: HostMemory, fill: bool) -> tuple[Layout, dict[int, np.ndarray]]:
        bufs, ts = {}, []
        for layer, w in widths.items():
            b = np.zeros(pages * page * w, np.uint8)
            if fill:
                b[:] = np.random.default_rng(layer).integers(0, 256, b.size, dtype=np.uint8)
            bufs[layer] = b
            ts.append(TensorSpec(name="kv", layer_id=layer, ptr=mem.add(b), nbytes=b.size,
                                 item_bytes=page * w, rows=page, row_kind=RowKind.TOKEN))
        comp = Component(type=StateType.MLA, name="kv", tensors=tuple(ts))
        return Layout(page_size=page, components=(comp,)), bufs

    (ls, bs), (ld, bd) = mla(mem_s, True), mla(mem_d, False)
    p = plan(ls, ld, {"kv": Indices([1, 2, 5], [4, 0, 3])})
    assert [e.src_unit for e in p.entries] == [page * w for w in widths.values()]
    execute(p, mem_s, mem_d)
    for layer, w in widths.items():
        s_pages = bs[layer].reshape(pages, page * w)
        d_pages = bd[layer].reshape(pages, page * w)
        np.testing.assert_array_equal(d_pages[[4, 0, 3]], s_pages[[1, 2, 5]])
        assert not d_pages[[1, 2, 5]].any()


@pytest.mark.parametrize("where", ["replica", "pp_stage"])
def test_a_bad_request_is_rejected_by_every_rank(where: str) -> None:
    """Index lists are validated even where this source moves no bytes of the component
    (an elected-out replica, a PP stage without its layers), so no rank accepts what its
    peer rejects."""
    if where == "replica":
        shape = shapes.tiny(shapes.DEEPSEEK_V32)
        src = [real_layout(shape, r, 2) for r in range(2)]
        dst = real_layout(shape, 0, 1)
    else:
        shape = shapes.tiny(shapes.QWEN3_NEXT)  # stage 0 holds layers 0-1: GDN only, no KV
        src = [shapes.layout_for(shape, tp_rank=0, tp_size=1, pp_rank=r, pp_size=2, page_size=4,
                                 num_pages=16, num_slots=4) for r in range(2)]
        dst = shapes.layout_for(shape, tp_rank=0, tp_size=1, page_size=4, num_pages=16,
                                num_slots=4)
    good = shapes.request_for(shape, src[0], dst, 37, seed=1)
    bad = dict(good, kv=Indices([1, 2, 3], [4, 5]))  # exact policy, 3 vs 2 pages
    outcomes = []
    for s in src:
        try:
            plan(s, dst, bad)
            outcomes.append("accepted")
        except IndexLengthMismatch:
            outcomes.append("rejected")
    assert outcomes == ["rejected", "rejected"], outcomes


# ---------------------------------------------------------------------------------------
# Purity


def test_importing_the_planner_pulls_in_no_io() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import kvhandoff.plan, sys; print(sorted(sys.modules))"],
        capture_output=True, text=True, check=True,
    ).stdout
    mods = set(ast.literal_eval(out))
    banned = {"socket", "threading", "zmq", "asyncio", "selectors", "subprocess",
              "kvhandoff.transport", "kvhandoff.session"}
    assert not mods & banned, sorted(mods & banned)
    assert not any(m.startswith(("kvhandoff.transport.", "kvhandoff.session.")) for m in mods)


def test_shapes_module_is_pure_too() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import kvhandoff.lab.shapes, sys; print(sorted(sys.modules))"],
        capture_output=True, text=True, check=True,
    ).stdout
    banned = {"socket", "threading", "asyncio", "subprocess", "matplotlib"}
    assert not set(ast.literal_eval(out)) & banned
