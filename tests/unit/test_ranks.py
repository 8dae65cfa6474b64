"""Rank mapping, checked against the planner on real model shapes.

For every TP/PP pair: the writers ``peers_for`` reports are exactly the prefill ranks
whose plan for a full request moves bytes; the size-only ``bootstrap_peers`` never
misses one; and the prefill side's ``decode_ranks_for`` (computed from its own layout
only) is the mirror image of the decode side's view.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from kvhandoff.errors import LayoutMismatch
from kvhandoff.lab import shapes
from kvhandoff.layout import Component, Layout, ShardSpec, TensorSpec
from kvhandoff.plan import plan
from kvhandoff.session.peers.mapping import (
    PrefillPeer,
    RankKey,
    bootstrap_peers,
    decode_ranks_for,
    expected_inits,
    expected_responses,
    peer_view,
    peers_for,
    pp_stages,
    tp_candidates,
    writes,
)
from kvhandoff.state_types import StateType

TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (8, 2), (4, 8)]
PP_PAIRS = [(1, 1), (2, 1), (2, 2)]


def _shape(name: str) -> shapes.ModelShape:
    if name == "gqa4":  # 4 KV heads: TP 8 replicates each head on 2 ranks
        return replace(shapes.tiny(shapes.get("llama")), kv_heads=4, name="gqa4")
    return shapes.tiny(shapes.get(name))


SHAPES = ["qwen3_next", "gqa4", "deepseek_v32", "nemotron_h", "gpt_oss", "kimi_linear",
          "deepseek_v4"]


@functools.cache
def layout(name: str, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1,
           side: int = 0) -> Layout:
    # decode pages differ from prefill's where the model allows it (NSA pages cannot re-page)
    page = {"deepseek_v4": 128, "deepseek_v32": 4}.get(name, 4 + 4 * side)
    return shapes.layout_for(_shape(name), tp_rank=tp_rank, tp_size=tp_size, page_size=page,
                             num_pages=24, num_slots=4, pp_rank=pp_rank, pp_size=pp_size)


def planned_writers(name: str, tp: int, pp: int, dst: Layout) -> set[tuple[int, int]]:
    """Prefill ranks (tp, pp), among *all* of them, whose plan for a full request into
    ``dst`` moves at least one byte."""
    out = set()
    stages = range(pp) if dst.pp_size == 1 else [dst.pp_rank]
    for p in stages:
        for t in range(tp):
            src = layout(name, t, tp, p, pp)
            n = 3 * max(src.page_size, dst.page_size) + 1
            req = shapes.request_for(_shape(name), src, dst, n, seed=t)
            if plan(src, dst, req):
                out.add((t, p))
    return out


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize(("tp", "td"), TP_PAIRS, ids=lambda v: str(v))
@pytest.mark.parametrize(("pp", "pd"), PP_PAIRS, ids=lambda v: f"pp{v}")
def test_peers_match_the_planner(name: str, tp: int, td: int, pp: int, pd: int) -> None:
    def sources(t: int, p: int) -> Layout:
        return layout(name, t, tp, p, pp)
    writers_of: dict[int, set[tuple[int, int]]] = {}
    for dpp in range(pd):
        for d in range(td):
            dst = layout(name, d, td, dpp, pd, side=1)
            peers = peers_for(dst, sources, src_tp_size=tp, src_pp_size=pp, dp_rank=1)
            found = {(p.tp_rank, p.pp_rank) for p in peers if p.writes}
            assert found == planned_writers(name, tp, pp, dst), f"decode tp{d} pp{dpp}"
            assert expected_responses(peers) == len(found) >= 1
            assert all(p.dp_rank == 1 for p in peers)
            boot = bootstrap_peers(dp_rank=1, src_tp_size=tp, src_pp_size=pp, dst_tp_rank=d,
                                   dst_tp_size=td, dst_pp_rank=dpp, dst_pp_size=pd)
            assert [p.key for p in peers] == list(boot)
            writers_of[d + td * dpp] = found
    # the prefill side, from its own layout alone, sees the same pairs
    for p in range(pp):
        for t in range(tp):
            src = layout(name, t, tp, p, pp)
            mine = decode_ranks_for(src, dst_tp_size=td, dst_pp_size=pd)
            want = [(d, dpp) for dpp in range(pd) for d in range(td)
                    if (t, p) in writers_of[d + td * dpp]]
            assert list(mine) == want
            assert expected_inits(src, dst_tp_size=td, dst_pp_size=pd) == len(want)


# ---------------------------------------------------------------------------------------
# What the mapping is, in the cases the reference documents (sglang_facts §4.4, §4.5, §5)


def writer_ranks(name: str, tp: int, td: int, d: int) -> list[int]:
    peers = peers_for(layout(name, d, td, side=1), lambda t, p: layout(name, t, tp, p),
                      src_tp_size=tp, src_pp_size=1)
    return [p.tp_rank for p in peers if p.writes]


def test_equal_tp_is_the_identity() -> None:
    for name in ("qwen3_next", "gqa4", "deepseek_v32"):
        assert [writer_ranks(name, 4, 4, d) for d in range(4)] == [[0], [1], [2], [3]]


def test_more_decode_ranks_read_the_prefill_rank_that_holds_their_heads() -> None:
    # qwen3_next tiny: 2 KV heads. Decode rank d of 4 holds head d // 2, which prefill rank
    # d // 2 of 2 holds; the replicated aux row comes from that same rank (the first of the
    # decode rank's TP window), so no decode rank needs an extra peer for it.
    assert [writer_ranks("qwen3_next", 2, 4, d) for d in range(4)] == [[0], [0], [1], [1]]
    assert expected_inits(layout("qwen3_next", 0, 2), dst_tp_size=4, dst_pp_size=1) == 2


def test_fewer_decode_ranks_gather_from_every_shard() -> None:
    assert [writer_ranks("qwen3_next", 4, 2, d) for d in range(2)] == [[0, 1], [2, 3]]
    assert [writer_ranks("gqa4", 2, 1, 0)] == [[0, 1]]


def test_gqa_replicas_elect_one_writer_per_head() -> None:
    # 4 KV heads over prefill TP 8: ranks 2h and 2h+1 both hold head h. Decode rank d of 2
    # (heads 2d, 2d+1) takes the replica of its window's first rank (4d): replica 0, i.e.
    # ranks 0 and 2 for decode 0, ranks 4 and 6 (and its aux row from 4) for decode 1.
    assert writer_ranks("gqa4", 8, 2, 0) == [0, 2]
    assert writer_ranks("gqa4", 8, 2, 1) == [4, 6]
    idle = [t for t in range(8)
            if not expected_inits(layout("gqa4", t, 8), dst_tp_size=2, dst_pp_size=1)]
    assert idle == [1, 3, 5, 7]  # dummy ranks: nothing to write, success at once


def test_replicated_mla_has_one_writer_per_decode_rank() -> None:
    for tp, td in TP_PAIRS:
        for d in range(td):
            assert writer_ranks("deepseek_v32", tp, td, d) == [d * tp // td]


def test_pp_prefill_to_pp1_decode_needs_every_stage() -> None:
    dst = layout("qwen3_next", 0, 1, side=1)
    peers = peers_for(dst, lambda t, p: layout("qwen3_next", t, 1, p, 2),
                      src_tp_size=1, src_pp_size=2)
    assert [(p.tp_rank, p.pp_rank, p.writes) for p in peers] == [(0, 0, True), (0, 1, True)]
    # the aux row (no layer) comes from the last stage only
    assert writes(layout("qwen3_next", 0, 1, 0, 2), dst)
    stage0 = plan(layout("qwen3_next", 0, 1, 0, 2), dst, shapes.request_for(
        _shape("qwen3_next"), layout("qwen3_next", 0, 1, 0, 2), dst, 9))
    assert "aux" not in {k for k, v in stage0.by_component().items() if v}


# ---------------------------------------------------------------------------------------
# The size-only fallback


@pytest.mark.parametrize(("tp", "td"), [*TP_PAIRS, (3, 6), (6, 4), (1, 8), (8, 1)],
                         ids=lambda v: str(v))
def test_tp_candidates_cover_the_tp_range_intersection(tp: int, td: int) -> None:
    for d in range(td):
        got = tp_candidates(src_tp_size=tp, dst_tp_rank=d, dst_tp_size=td)
        assert list(got) == sorted(set(got))
        overlap = [p for p in range(tp) if p * td < (d + 1) * tp and d * tp < (p + 1) * td]
        assert set(overlap) <= set(got)
        assert d * tp // td in got  # the elected writer of replicated tensors


def test_tp_candidates_exact_values() -> None:
    def c(tp: int, d: int, td: int) -> tuple[int, ...]:
        return tp_candidates(src_tp_size=tp, dst_tp_rank=d, dst_tp_size=td)
    assert c(1, 0, 1) == (0,)
    assert [c(1, d, 2) for d in range(2)] == [(0,), (0,)]
    assert c(2, 0, 1) == (0, 1)
    assert [c(2, d, 4) for d in range(4)] == [(0,), (0,), (1,), (1,)]
    assert c(8, 1, 2) == (4, 5, 6, 7)


def test_pp_stages() -> None:
    assert pp_stages(src_pp_size=2, dst_pp_rank=0, dst_pp_size=1) == (0, 1)
    assert pp_stages(src_pp_size=4, dst_pp_rank=3, dst_pp_size=4) == (3,)
    assert pp_stages(src_pp_size=1, dst_pp_rank=0, dst_pp_size=1) == (0,)
    with pytest.raises(LayoutMismatch, match="decode runs 2 pipeline stages and prefill 4"):
        pp_stages(src_pp_size=4, dst_pp_rank=0, dst_pp_size=2)
    with pytest.raises(ValueError, match="rank 2 is outside size 2"):
        pp_stages(src_pp_size=2, dst_pp_rank=2, dst_pp_size=2)
    with pytest.raises(LayoutMismatch):
        decode_ranks_for(layout("qwen3_next", 0, 1, 3, 4), dst_tp_size=1, dst_pp_size=2)


def test_bootstrap_peers_order_and_keys() -> None:
    got = bootstrap_peers(dp_rank=2, src_tp_size=2, src_pp_size=2, dst_tp_rank=0,
                          dst_tp_size=1, dst_pp_rank=0, dst_pp_size=1)
    assert got == (RankKey(2, 0, 0), RankKey(2, 1, 0), RankKey(2, 0, 1), RankKey(2, 1, 1))
    assert PrefillPeer(dp_rank=2, tp_rank=1, pp_rank=0, writes=False).key == RankKey(2, 1, 0)


def test_peers_for_checks_the_layouts_it_is_given() -> None:
    dst = layout("qwen3_next", 0, 2, side=1)
    wrong = {(0, 0): layout("qwen3_next", 1, 2), (1, 0): layout("qwen3_next", 1, 2)}
    with pytest.raises(ValueError, match="given for prefill tp 0/2 pp 0/1 is tp 1/2"):
        peers_for(dst, wrong, src_tp_size=2, src_pp_size=1)
    right = {(t, 0): layout("qwen3_next", t, 2) for t in range(2)}
    assert expected_responses(peers_for(dst, right, src_tp_size=2, src_pp_size=1)) == 1


def test_peer_view_is_a_valid_layout_of_the_other_rank() -> None:
    src = layout("qwen3_next", 1, 2)
    view = peer_view(src, tp_rank=3, tp_size=4, pp_rank=0, pp_size=1)
    real = layout("qwen3_next", 3, 4)
    assert (view.tp_rank, view.tp_size) == (3, 4)
    assert view.signature == real.signature
    got = {t.key: t.item_bytes for c in view.components for t in c.tensors}
    assert got == {t.key: t.item_bytes for c in real.components for t in c.tensors}


def test_peer_view_of_padded_items_at_another_tp_size() -> None:
    """A padded tensor's peer view is one packed item: the stride of this rank (here
    no more than its own conv + SSM state) may be smaller than the peer's item."""
    conv = ShardSpec.axis(axis=256, inner_bytes=6, groups=(64, 64, 128))
    ssm = ShardSpec.axis(axis=8, inner_bytes=128)
    page = 768 + 512  # TP 2: conv and SSM fill the page exactly
    tensors = (
        TensorSpec(name="conv", layer_id=0, ptr=1 << 20, nbytes=4 * page, item_bytes=768,
                   stride=page, shard=conv),
        TensorSpec(name="ssm", layer_id=0, ptr=(1 << 20) + 768, nbytes=3 * page + 512,
                   item_bytes=512, stride=page, shard=ssm),
    )
    src = Layout(page_size=16, tp_rank=1, tp_size=2, components=(
        Component(type=StateType.MAMBA, name="mamba", tensors=tensors),))
    view = peer_view(src, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    assert [(t.item_bytes, t.stride) for t in view.component("mamba").tensors] == [
        (1536, 0), (1024, 0)]
    assert decode_ranks_for(src, dst_tp_size=1, dst_pp_size=1) == ((0, 0),)
    assert decode_ranks_for(src, dst_tp_size=4, dst_pp_size=1) == ((2, 0), (3, 0))
