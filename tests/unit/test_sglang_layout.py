"""SGLang's KVArgs → a kvhandoff Layout, for each family measured in a booted SGLang 0.5.23
(``sglang_backend.md`` §7: Llama MHA, Mellum SWA, DeepSeek-V2 MLA, NemotronH Mamba,
DeepSeek-V3.2 DSA), without SGLang: the numbers are the ones those engines registered.
Heterogeneous TP is checked byte for byte against the naive oracle and against SGLang's
own per-rank sharding written out by hand; what cannot be described is refused by name."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest

from kvhandoff.errors import LayoutError
from kvhandoff.integrations import AuxSpec
from kvhandoff.integrations.sglang.layout import (
    Mamba2Dims,
    Registered,
    StateEntry,
    describe,
)
from kvhandoff.integrations.sglang.requests import (
    decode_indices,
    from_token_zero,
    prefill_state,
    prefix_pages,
)
from kvhandoff.lab.testing.oracle import expected_writes
from kvhandoff.layout import Layout
from kvhandoff.plan import Indices, plan
from kvhandoff.protocol import PROTOCOL_VERSION
from kvhandoff.session.peers.compat import handshake_report
from kvhandoff.state_types import StateType

ROWS = 8  # metadata rows
META = (64, 64, 64, 64, 512, 512, 64, 128, 64, 64)  # the aux item lengths SGLang registered
KEEP: list[np.ndarray] = []  # buffers the pointers point into, alive for the session


def _buf(nbytes: int, fill: bool = False, seed: int = 0) -> tuple[int, int]:
    b = np.zeros(nbytes, np.uint8)
    if fill:
        b[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    KEEP.append(b)
    return int(b.ctypes.data), nbytes


def _bufs(items: Sequence[int], count: int, fill: bool = False) -> tuple[tuple[int, ...], ...]:
    made = [_buf(i * count, fill, seed=n) for n, i in enumerate(items)]
    return tuple(p for p, _ in made), tuple(n for _, n in made), tuple(items)


def _state(kind: str, items: Sequence[int], count: int, **kw: object) -> StateEntry:
    ptrs, lens, item_lens = _bufs(items, count)
    return StateEntry(type=kind, ptrs=ptrs, lens=lens, item_lens=item_lens, **kw)  # type: ignore[arg-type]


def _reg(family: str, *, tp: int = 1, head_dim: int = 16, pages: int = 32) -> Registered:
    """One rank's registration as SGLang made it for ``family`` (tiny configs of §7)."""
    heads = max(1, 2 // tp)
    kv = 1 * heads * head_dim * 2  # page 1, bf16
    mptrs, mlens, mitems = _bufs(META, ROWS)
    base = dict(page_size=1, kv_head_num=heads, total_kv_head_num=2, aux_ptrs=mptrs,
                aux_lens=mlens, aux_item_lens=mitems)
    if family == "llama":
        p, n, i = _bufs([kv] * 4, pages)
        return Registered(kv_ptrs=p, kv_lens=n, kv_item_lens=i, **base)  # type: ignore[arg-type]
    if family == "mellum":
        p, n, i = _bufs([kv] * 2, pages)
        return Registered(kv_ptrs=p, kv_lens=n, kv_item_lens=i,  # type: ignore[arg-type]
                          states=(_state("swa", [kv] * 6, pages),), **base)
    if family == "deepseek_v2":
        p, n, i = _bufs([96] * 2, pages)
        return Registered(kv_ptrs=p, kv_lens=n, kv_item_lens=i, is_mla=True,
                          **{**base, "kv_head_num": 0, "total_kv_head_num": 0})  # type: ignore[arg-type]
    if family == "nemotron_h":  # M-*-: Mamba2 layer 0, attention layer 2
        p, n, i = _bufs([kv] * 2, pages)
        # conv [x 64 | B | C] of 1 group of 16, extended to TP groups (SGLang's
        # Mamba2StateShape), K-1 = 3 taps bf16; SSM 4 heads of 1024 B, fp32
        chans = (64 + 2 * (1 if tp == 1 else tp) * 16) // tp
        mamba = _state("mamba", [chans * 6, 4096 // tp], 4, layer_ids=(0, 0),
                       dims=(chans, 4 // tp), outer=(1, 1), conv_groups=(None, None))
        return Registered(kv_ptrs=p, kv_lens=n, kv_item_lens=i, kv_layer_ids=(2, 2),  # type: ignore[arg-type]
                          states=(mamba,), **base)
    assert family == "deepseek_v32"  # page 64, latent 96 B per token, indexer 8448 B/page
    p, n, i = _bufs([6144] * 2, 4)
    return Registered(kv_ptrs=p, kv_lens=n, kv_item_lens=i, is_mla=True,  # type: ignore[arg-type]
                      states=(_state("dsa", [8448] * 2, 4),),
                      **{**base, "page_size": 64, "kv_head_num": 0, "total_kv_head_num": 0})


def _layout(reg: Registered, tp_rank: int = 0, tp: int = 1, **kw: object) -> Layout:
    _, guard = AuxSpec().allocate(ROWS)
    return describe(reg, tp_rank=tp_rank, tp_size=tp, extra=(guard,), **kw)  # type: ignore[arg-type]


FAMILIES = {
    "llama": ({"kv": StateType.KV}, {"kv": {"k": [0, 1], "v": [0, 1]}}),
    "mellum": ({"kv": StateType.KV, "swa": StateType.SWA},
               {"kv": {"k": [0], "v": [0]}, "swa": {"k": [0, 1, 2], "v": [0, 1, 2]}}),
    "deepseek_v2": ({"kv": StateType.MLA}, {"kv": {"latent": [0, 1]}}),
    "nemotron_h": ({"kv": StateType.KV, "mamba": StateType.MAMBA},
                   {"kv": {"k": [2], "v": [2]}, "mamba": {"state0": [0], "state1": [0]}}),
    "deepseek_v32": ({"kv": StateType.MLA, "dsa": StateType.NSA},
                     {"kv": {"latent": [0, 1]}, "dsa": {"index": [0, 1]}}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_measured_family_becomes_a_layout(family: str) -> None:
    types, tensors = FAMILIES[family]
    lay = _layout(_reg(family), mamba2=Mamba2Dims(n_groups=1, state=16))
    assert {c.name: c.type for c in lay.components} == {
        **types, "metadata": StateType.REQUEST_ROW, "aux": StateType.AUX}
    for name, by_tensor in tensors.items():
        got: dict[str, list[int]] = {}
        for t in lay.component(name).tensors:
            got.setdefault(t.name, []).append(t.layer_id)
        assert got == by_tensor, name
    meta = lay.component("metadata").tensors
    assert [t.item_bytes for t in meta] == list(META) and all(t.shard is None for t in meta)
    kv = lay.component("kv").tensors
    if types["kv"] is StateType.KV:  # MHA pages shard by head: 2 heads of 32 B per token
        assert all(t.shard is not None and t.shard.groups == (2,) and t.shard.inner_bytes == 32
                   for t in kv)
    else:
        assert all(t.shard is None for t in kv)  # the latent is replicated


def _request(lay: Layout, **moving: Indices) -> dict[str, Indices | None]:
    """A request naming every component: ``moving`` ones, None for the rest."""
    return {c.name: moving.get(c.name) for c in lay.components}


def _copy(src: Layout, dst: Layout, request: dict[str, Indices | None]) -> None:
    segs = plan(src, dst, request).flatten()
    for s, d, n in zip(segs.src.tolist(), segs.dst.tolist(), segs.length.tolist(), strict=True):
        ctypes.memmove(d, s, n)


@pytest.mark.parametrize("family", ["llama", "mellum"])
def test_attention_heads_move_from_tp1_to_tp2_as_the_oracle_says(family: str) -> None:
    src = _layout(_reg(family))
    comp = "kv" if family == "llama" else "swa"
    request = _request(src, **{comp: Indices([3, 5, 7], [1, 2, 30])})
    for rank in range(2):
        dst = _layout(_reg(family, tp=2), rank, 2)
        segs = plan(src, dst, request).flatten()
        got = {d + i: (0, s + i) for s, d, n in zip(segs.src.tolist(), segs.dst.tolist(),
                                                    segs.length.tolist(), strict=True)
               for i in range(n)}
        want = expected_writes([src], dst, request).as_dict()
        per_tensor = 3 * 32  # 3 pages of one head (of 2) of 16 bf16
        assert got == want and len(want) == per_tensor * len(dst.component(comp).tensors)


def _conv_channels(tp: int, r: int, x: int = 64, state: int = 16, groups: int = 1) -> list[int]:
    """SGLang's Mamba2 conv on rank r (``Mamba2StateShape.create``): x split in TP
    slices, then B and C, whose groups are extended to TP when fewer (the rank's own)."""
    ext = groups if groups % tp == 0 else tp
    out = list(range(r * x // tp, (r + 1) * x // tp))
    for block in (1, 2):
        per = ext // tp
        g0 = r * per if ext == groups else r // (tp // groups)
        out += range(x + (block - 1) * groups * state + g0 * state,
                     x + (block - 1) * groups * state + (g0 + per) * state)
    return out


def _mamba_rank(tp: int, r: int, fill: bool) -> tuple[Layout, list[np.ndarray]]:
    """A NemotronH rank whose conv slot 1 holds each channel's global number (bf16 x 3
    taps as 6 bytes) and SSM slot 1 each head's (4 heads of 1024 B)."""
    reg = _reg("nemotron_h", tp=tp)
    conv_e = reg.states[0]
    conv = np.frombuffer((ctypes.c_char * conv_e.lens[0]).from_address(conv_e.ptrs[0]),
                         np.uint8)
    ssm = np.frombuffer((ctypes.c_char * conv_e.lens[1]).from_address(conv_e.ptrs[1]),
                        np.uint8)
    if fill:
        chans = np.array(_conv_channels(tp, r), np.uint16)
        conv.reshape(4, -1)[1] = np.repeat(chans, 3).view(np.uint8)
        heads = np.arange(r * 4 // tp, (r + 1) * 4 // tp, dtype=np.uint8)
        ssm.reshape(4, -1)[1] = np.repeat(heads + 100, 1024)
    lay = _layout(reg, r, tp, mamba2=Mamba2Dims(n_groups=1, state=16))
    return lay, [conv.reshape(4, -1), ssm.reshape(4, -1)]  # views: what lands shows here


@pytest.mark.parametrize(("ptp", "dtp"), [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_mamba2_state_lands_where_sglang_keeps_it(ptp: int, dtp: int) -> None:
    """Prefill TP ``ptp`` → decode TP ``dtp``, slot 1 → slot 2: each decode rank's conv
    holds exactly its own x, B and C channels (B and C replicated past one group), in
    SGLang's order, and its own SSM heads."""
    srcs = [_mamba_rank(ptp, r, True)[0] for r in range(ptp)]
    for r in range(dtp):
        dst, (conv, ssm) = _mamba_rank(dtp, r, False)
        for src in srcs:
            _copy(src, dst, _request(src, mamba=Indices([1], [2])))
        assert not conv[[0, 1, 3]].any() and not ssm[[0, 1, 3]].any()  # other slots untouched
        got = np.concatenate([conv[2], ssm[2]])
        chans = np.repeat(np.array(_conv_channels(dtp, r), np.uint16), 3).view(np.uint8)
        heads = np.repeat(np.arange(r * 4 // dtp, (r + 1) * 4 // dtp, dtype=np.uint8) + 100,
                          1024)
        assert np.array_equal(got, np.concatenate([chans, heads]))


def test_a_conv_of_unknown_sub_blocks_pins_the_tp_size() -> None:
    """Without the model's Mamba2 groups the conv is one block, which is right only at
    equal TP: a pair of different TP sizes is refused at the handshake, naming it."""
    p = _layout(_reg("nemotron_h"))
    d = _layout(_reg("nemotron_h", tp=2), 0, 2)
    problems = handshake_report(p, d, prefill_transport="tcp", decode_transport="tcp",
                                protocol_version=PROTOCOL_VERSION)
    assert any("mamba conv sharding: prefill has 'one block at attention TP 1', decode has "
               "'one block at attention TP 2'" in x for x in problems), problems
    same = handshake_report(p, _layout(_reg("nemotron_h")), prefill_transport="tcp",
                            decode_transport="tcp", protocol_version=PROTOCOL_VERSION)
    assert same == []


def test_a_pair_whose_layouts_differ_is_refused_naming_component_and_numbers() -> None:
    """SGLang's own handshake compares the dtype only (sglang#37838): two pools of other
    head sizes would pass it. kvhandoff's names the component, tensor and both sizes."""
    p = _layout(_reg("llama", head_dim=16))
    d = _layout(_reg("llama", head_dim=32))
    problems = handshake_report(p, d, prefill_transport="tcp", decode_transport="tcp",
                                protocol_version=PROTOCOL_VERSION)
    text = "\n".join(problems)
    assert "'kv'" in text and "32" in text and "64" in text, text


def test_state_types_kvhandoff_cannot_move_are_refused_by_name() -> None:
    reg = replace(_reg("llama"), states=(_state("dsa_tail", [64], 2),
                                         _state("minimax_index_k", [64], 2)))
    with pytest.raises(LayoutError, match=r"'dsa_tail' \(the DSA kpool-compress tail ring.*"
                                          r"'minimax_index_k' \(MiniMax sparse index-K"):
        _layout(reg)
    with pytest.raises(LayoutError, match=r"DeepSeek-V4's compressed KV pools .* \[0, 4, 128\]"):
        _layout(replace(_reg("deepseek_v2"), compression_ratios=(0, 4, 128, 4)))
    odd = replace(_reg("llama"), kv_item_lens=(63, 64, 64, 64))
    with pytest.raises(LayoutError, match=r"kv tensor 'k' layer 0: a page of 63 B is not 1 "
                                          r"tokens x 2 heads"):
        _layout(odd)


def test_sglang_indices_become_a_kvhandoff_request() -> None:
    types = ["mamba", "swa"]
    assert prefix_pages(128, 64) == 2
    with pytest.raises(ValueError, match="100 tokens is not a whole number of 64-token"):
        prefix_pages(100, 64)
    assert from_token_zero([7, 9], 2).tolist() == [0, 0, 7, 9]  # placeholders: never moved
    state = prefill_state(types, [[3], None], aux_index=5)
    assert set(state) == {"mamba", "swa", "metadata"} and state["swa"] is None
    assert state["metadata"] == [5] and list(state["mamba"]) == [3]  # type: ignore[arg-type]
    dst = decode_indices(types, [4, 6], [[1], [8, 9]], aux_index=2)
    assert list(dst["kv"]) == [4, 6] and list(dst["swa"]) == [8, 9]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"1 state index lists for the 2 state types"):
        prefill_state(types, [[3]], aux_index=5)


def test_kvargs_are_read_once_with_what_a_role_leaves_out() -> None:
    """A decode rank's KVArgs carry no KV heads (SGLang sets them on prefill only): they
    come from the served model. Optional fields may be absent altogether."""
    from types import SimpleNamespace

    from kvhandoff.integrations.sglang.kvargs import Heads, registered

    mamba = SimpleNamespace(value="mamba")
    args = SimpleNamespace(
        kv_data_ptrs=[1, 2], kv_data_lens=[64, 64], kv_item_lens=[32, 32], kv_layer_ids=None,
        page_size=1, aux_data_ptrs=[3], aux_data_lens=[8], aux_item_lens=[8],
        state_types=[mamba], state_data_ptrs=[[4, 5]], state_data_lens=[[8, 8]],
        state_item_lens=[[4, 4]], state_layer_ids=[[0, 0]], state_dim_per_tensor=[[2, 1]],
        state_conv_shard_groups=[[None, None]], kv_cache_dtype_str="auto")
    reg = registered(args, heads=Heads(local=1, total=2))
    assert (reg.kv_head_num, reg.total_kv_head_num, reg.kv_layer_ids) == (1, 2, ())
    entry = reg.states[0]
    assert (entry.type, entry.dims, entry.outer, entry.conv_groups) == (
        "mamba", (2, 1), (), (None, None))  # no outer counts registered: none read
    prefill = SimpleNamespace(**vars(args), kv_head_num=2, total_kv_head_num=4)
    assert registered(prefill, heads=Heads(local=1, total=2)).kv_head_num == 2  # its own
