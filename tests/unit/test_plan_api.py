"""The planner's contract at its edges: what it refuses, and how it says so."""

from __future__ import annotations

import numpy as np
import pytest

from kvhandoff.errors import IndexLengthMismatch, LayoutMismatch, OutOfBounds, PlanError
from kvhandoff.layout import NO_LAYER, Component, Layout, RowKind, ShardSpec, TensorSpec
from kvhandoff.plan import Indices, check_compatible, plan
from kvhandoff.state_types import StateType

PAGE, HEADS, HEAD_BYTES, PAGES = 4, 4, 8, 16


def layout(tp_rank: int = 0, tp_size: int = 1, *, ptr: int = 1 << 20, mamba: bool = True,
           conv_inner: int = 6) -> Layout:
    local = HEADS // tp_size
    item = PAGE * local * HEAD_BYTES
    kv = Component(type=StateType.KV, name="kv", tensors=tuple(
        TensorSpec(name=n, layer_id=0, ptr=ptr + i * item * PAGES, nbytes=item * PAGES,
                   item_bytes=item, rows=PAGE, row_kind=RowKind.TOKEN,
                   shard=ShardSpec.axis(outer=PAGE, axis=HEADS, inner_bytes=HEAD_BYTES))
        for i, n in enumerate("kv")))
    comps = [kv, Component(type=StateType.AUX, name="aux", tensors=(
        TensorSpec(name="aux", layer_id=NO_LAYER, ptr=ptr + (1 << 16), nbytes=64 * 8,
                   item_bytes=64),))]
    if mamba:
        conv = conv_inner * 24 // tp_size
        comps.append(Component(type=StateType.MAMBA, name="mamba", tensors=(
            TensorSpec(name="conv", layer_id=1, ptr=ptr + (1 << 17), nbytes=conv * 4,
                       item_bytes=conv, shard=ShardSpec.axis(axis=24, inner_bytes=conv_inner,
                                                             groups=(6, 6, 12))),)))
    return Layout(page_size=PAGE, tp_rank=tp_rank, tp_size=tp_size, components=tuple(comps))


def full(**kw: Indices | None) -> dict[str, Indices | None]:
    req: dict[str, Indices | None] = {"kv": Indices([0, 1], [2, 3]), "aux": Indices([0], [5]),
                                      "mamba": Indices([1], [2])}
    req.update(kw)
    return req


def test_a_forgotten_component_is_an_error_not_a_skip() -> None:
    req = full()
    del req["mamba"]
    with pytest.raises(PlanError, match=r"missing \['mamba'\]"):
        plan(layout(), layout(), req)
    with pytest.raises(PlanError, match=r"unknown \['nsa'\]"):
        plan(layout(), layout(), full(nsa=None))


def test_none_means_not_in_this_call() -> None:
    p = plan(layout(), layout(), full(mamba=None, aux=None))
    assert p.by_component() == {"kv": 2 * 2 * PAGE * HEADS * HEAD_BYTES}


def test_component_on_one_side_fails_at_pairing() -> None:
    with pytest.raises(LayoutMismatch, match=r"component 'mamba' .*exists on prefill only"):
        check_compatible(layout(), layout(mamba=False))


def test_item_size_mismatch_names_component_tensor_and_sizes() -> None:
    with pytest.raises(LayoutMismatch) as e:
        check_compatible(layout(), layout(ptr=1 << 24, conv_inner=3))
    msg = str(e.value)
    assert "component 'mamba' tensor 'conv' layer 1" in msg
    assert "prefill item 144 B vs decode item 72 B with TP 1 → 1" in msg


def test_exact_policy_names_both_lengths() -> None:
    with pytest.raises(IndexLengthMismatch, match=r"'kv'.*prefill has 3, decode has 2"):
        plan(layout(), layout(), full(kv=Indices([0, 1, 2], [2, 3])))


def test_mamba_takes_exactly_one_slot() -> None:
    with pytest.raises(IndexLengthMismatch, match="at most 1 index"):
        plan(layout(), layout(), full(mamba=Indices([1, 2], [2, 3])))


@pytest.mark.parametrize(("src", "dst", "side", "bad"), [
    ([0, PAGES], [1, 2], "prefill", PAGES),
    ([0, 1], [1, -1], "decode", -1),
])
def test_out_of_bounds_names_tensor_and_index(src: list[int], dst: list[int], side: str,
                                              bad: int) -> None:
    with pytest.raises(OutOfBounds, match=rf"tensor 'k' layer 0: {side} index {bad}"):
        plan(layout(), layout(), full(kv=Indices(src, dst)))


def test_duplicate_destinations_are_refused() -> None:
    with pytest.raises(PlanError, match=r"decode index list repeats \[3\]"):
        plan(layout(), layout(), full(kv=Indices([0, 1], [3, 3])))


def test_caller_arrays_are_not_mutated_or_aliased() -> None:
    src = np.array([3, 1], dtype=np.int64)
    dst = np.array([0, 2], dtype=np.int32)
    p = plan(layout(), layout(), full(kv=Indices(src, dst)))
    src[0] = 9
    assert p.entries[0].src_idx.tolist() == [3, 1]
    assert not p.entries[0].src_idx.flags.writeable


def test_replicated_aux_has_one_writer_among_prefill_ranks() -> None:
    dst = layout(ptr=1 << 26)
    writers = [r for r in range(2)
               if plan(layout(r, 2), dst, full(kv=None, mamba=None)).nbytes]
    assert writers == [0]


def test_empty_lists_plan_nothing() -> None:
    p = plan(layout(), layout(), full(kv=Indices([], []), aux=None, mamba=None))
    assert not p and p.nbytes == 0 and len(p.flatten()) == 0 and len(p.coalesce()) == 0


def test_coalesce_merges_contiguous_pages() -> None:
    p = plan(layout(), layout(ptr=1 << 26), full(kv=Indices([4, 5, 6, 9], [0, 1, 2, 3]),
                                                 aux=None, mamba=None))
    flat, merged = p.flatten(), p.coalesce()
    assert len(flat) == 8 and len(merged) == 4  # k and v: pages 4-6 are one run, 9 another
    assert merged.nbytes == flat.nbytes
