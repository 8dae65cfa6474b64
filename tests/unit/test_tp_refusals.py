"""Every TP refusal names the model, the component, the layer and the numbers: the
shard arithmetic (layout), a rank's layout, the peer view the planner asks who writes,
the named shapes the reference engine lays its pools out by, and vLLM's layout.

A gated delta net whose key (or value) heads TP does not divide is refused: vLLM 0.32
and SGLang 0.5.23 run ``num_heads / TP`` whole heads per rank (neither cuts a key head's
channels across ranks), so no engine keeps a state split that way.
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from kvhandoff.errors import LayoutError
from kvhandoff.integrations.vllm.layout import (
    GroupInfo,
    MambaInfo,
    TensorInfo,
    VllmLayoutError,
    build_layout,
)
from kvhandoff.lab import shapes
from kvhandoff.layout import Component, Layout, RowKind, ShardSpec, TensorSpec
from kvhandoff.session.peers.mapping import peer_view
from kvhandoff.state_types import StateType


def _refused(exc: type[Exception], call: object, *parts: str) -> str:
    """``call()`` raises ``exc`` whose message contains every one of ``parts``."""
    assert callable(call)
    with pytest.raises(exc) as e:
        call()
    msg = str(e.value)
    missing = [p for p in parts if p not in msg]
    assert not missing, f"{missing} not in {msg!r}"
    return msg


# --- the shard arithmetic ----------------------------------------------------------------

def test_a_group_tp_cannot_split_names_it_with_the_arithmetic() -> None:
    conv = ShardSpec.axis(axis=64, groups=(16, 16, 32), inner_bytes=12,
                          labels=("q channels", "k channels", "v channels"))
    _refused(LayoutError, lambda: conv.ranges(0, 3),
             "16 q channels (group 0 of [16, 16, 32]) cannot be split evenly over TP 3",
             "(16 = 5 x 3 + 1)")
    plain = ShardSpec.axis(axis=6, inner_bytes=2)
    _refused(LayoutError, lambda: plain.ranges(0, 4),
             "a sharded group of length 6 cannot be split evenly over TP 4 (6 = 1 x 4 + 2)")


def test_heads_tp_cannot_replicate_name_the_multiple_tp_needs() -> None:
    kv = ShardSpec.axis(outer=16, axis=4, inner_bytes=256, labels=("KV heads",))
    _refused(LayoutError, lambda: kv.ranges(0, 6),
             "4 KV heads cannot be replicated evenly over TP 6",
             "TP must be a multiple of 4 (6 = 1 x 4 + 2)")


def test_labels_are_no_part_of_the_geometry() -> None:
    a = ShardSpec.axis(axis=8, inner_bytes=2, labels=("KV heads",))
    assert a == ShardSpec.axis(axis=8, inner_bytes=2) and hash(a) == hash(replace(a, labels=()))
    with pytest.raises(LayoutError, match=r"labels .* do not name its 2 groups"):
        ShardSpec.axis(axis=8, groups=(4, 4), inner_bytes=2, labels=("x",))


# --- a rank's layout, and the peer view the planner asks ----------------------------------

def _kv_rank(tp_size: int, heads: int = 2, model: str = "my-model") -> Layout:
    shard = ShardSpec.axis(outer=16, axis=heads, inner_bytes=256, labels=("KV heads",))
    t = TensorSpec(name="k", layer_id=5, ptr=4096, nbytes=16 * 256 * 64, item_bytes=16 * 256,
                   rows=16, row_kind=RowKind.TOKEN, shard=shard)
    return Layout(page_size=16, tp_size=tp_size, model=model,
                  components=(Component(type=StateType.KV, name="kv", tensors=(t,)),))


def test_a_layout_refuses_its_tp_naming_model_component_tensor_layer() -> None:
    _refused(LayoutError, lambda: _kv_rank(3),
             "my-model: component 'kv' tensor 'k' (layer 5) at TP rank 0 of 3: ",
             "2 KV heads cannot be replicated evenly over TP 3")


def test_the_peer_view_refuses_a_peer_tp_naming_the_tensor() -> None:
    rank = _kv_rank(2)  # one head per rank: fine
    _refused(LayoutError, lambda: peer_view(rank, tp_rank=0, tp_size=3, pp_rank=0, pp_size=1),
             "my-model: component 'kv' tensor 'k' (layer 5) at the peer's TP rank 0 of 3: ",
             "2 KV heads cannot be replicated evenly over TP 3")


# --- the named shapes (what the reference engine lays its pools out by) -------------------

def _layout(shape: shapes.ModelShape, tp: int) -> object:
    return lambda: shapes.layout_for(shape, tp_rank=0, tp_size=tp, page_size=4, num_pages=4,
                                     num_slots=2)


TINY = {name: shapes.tiny(shapes.get(name)) for name in ("qwen3_next", "nemotron_h", "jamba",
                                                         "lfm2", "llama")}


def test_kv_heads_tp_cannot_split() -> None:
    _refused(LayoutError, _layout(TINY["llama"], 3),
             "tiny_llama: component 'kv': tensor 'k' (layer 0) at TP rank 0 of 3: ",
             "8 KV heads cannot be split evenly over TP 3 (8 = 2 x 3 + 2)")


def test_a_gdn_whose_key_heads_tp_does_not_divide_is_refused_citing_the_engines() -> None:
    # 2 KV heads replicate at TP 16; the GDN's 8 key heads would need half a head a rank
    msg = _refused(LayoutError, _layout(TINY["qwen3_next"], 16),
                   "tiny_qwen3_next: component 'mamba': gated delta net layers 0, 1, 2: ",
                   "8 key heads and 16 value heads do not split into whole heads over TP 16",
                   "key heads % TP = 8, value heads % TP = 0", "vLLM and SGLang")
    assert "cannot be split evenly" not in msg  # said in heads, not in channels
    shapes.layout_for(TINY["qwen3_next"], tp_rank=0, tp_size=8, page_size=4, num_pages=4,
                      num_slots=2)  # 8 key heads over TP 8: one whole head a rank


def test_mamba2_groups_fewer_than_tp_are_refused() -> None:
    _refused(LayoutError, _layout(TINY["nemotron_h"], 16),
             "tiny_nemotron_h: component 'mamba': Mamba2 layers 0, 2, 4, 6: TP 16 exceeds the "
             "8 B/C groups")


@pytest.mark.parametrize(("name", "component", "what"), [
    ("jamba", "mamba", "16 d_inner channels cannot be split evenly over TP 3 (16 = 5 x 3 + 1)"),
    ("lfm2", "short_conv",
     "16 conv channels cannot be split evenly over TP 3 (16 = 5 x 3 + 1)"),
])
def test_channels_tp_cannot_split(name: str, component: str, what: str) -> None:
    shape = replace(TINY[name], kv_heads=6)  # attention splits over TP 3: the state does not
    msg = _refused(LayoutError, _layout(shape, 3), f"tiny_{name}: component {component!r}: ",
                   "at TP rank 0 of 3: ", what)
    assert re.search(r"tensor '\w+' \(layer \d+\)", msg), msg


# --- vLLM's layout ---------------------------------------------------------------------------

BS = 16


def _page(nbytes: int, shape: tuple[int, ...] | None = None,
          strides: tuple[int, ...] | None = None) -> tuple[TensorInfo, np.ndarray]:
    buf = np.zeros(4 * nbytes, np.uint8)
    return TensorInfo(ptr=buf.ctypes.data, shape=shape or (4, 1, 1, nbytes),
                      strides=strides or (nbytes, nbytes, nbytes, 1), itemsize=1, dtype="int8",
                      base_ptr=buf.ctypes.data, base_nbytes=buf.nbytes), buf


def _vllm(group: GroupInfo, t: TensorInfo, tp: int) -> object:
    return lambda: build_layout([group], {group.layer_names[0]: t}, tp_rank=0, tp_size=tp,
                                model="Qwen3NextForCausalLM")


def test_vllm_mamba_pages_without_their_shapes_are_refused_under_tp() -> None:
    t, _buf = _page(4096)
    g = GroupInfo(0, "mamba", "MambaSpec", BS, ("model.layers.0.linear_attn",))
    _refused(VllmLayoutError, _vllm(g, t, 2),
             "Qwen3NextForCausalLM: group 0 (MambaSpec) layer 'model.layers.0.linear_attn'",
             "does not slice per TP rank yet (TP 2)")


def test_vllm_gdn_state_that_does_not_split_is_refused_with_its_numbers() -> None:
    # a conv of 101 channels is no [q | k | v] of equal q and k beside 64 value channels
    info = MambaInfo(kind="gdn", shapes=((101, 3), (8, 8, 4)), itemsizes=(4, 4),
                     conv_dim_first=True)
    t, _buf = _page(101 * 3 * 4 + 8 * 8 * 4 * 4)
    g = GroupInfo(0, "mamba", "MambaSpec", BS, ("model.layers.0.linear_attn",), mamba=info)
    _refused(VllmLayoutError, _vllm(g, t, 2),
             "Qwen3NextForCausalLM: group 0 (MambaSpec) layer 'model.layers.0.linear_attn'",
             "GDN conv dim 101 is not 2 x key + value (64)", "at TP 2")


def test_vllm_mamba2_groups_that_do_not_cut_are_refused() -> None:
    info = MambaInfo(kind="mamba2", shapes=((96, 3), (4, 6, 7)), itemsizes=(4, 4),
                     conv_dim_first=True, n_groups=2)  # x = 4 x 6 x TP 2 = 48: not in 7s
    t, _buf = _page(96 * 3 * 4 + 4 * 6 * 7 * 4)
    g = GroupInfo(0, "mamba", "MambaSpec", BS, ("model.layers.0.mixer",), mamba=info)
    _refused(VllmLayoutError, _vllm(g, t, 2), "Qwen3NextForCausalLM: group 0 (MambaSpec)",
             "x of 48 channels is not a whole number of 7-channel groups", "TP 2")


def test_vllm_kv_heads_that_do_not_divide_the_model_are_refused() -> None:
    c = 2 * 8
    t, _buf = _page(3 * BS * c * 2, shape=(4, 3, BS, c), strides=(3 * BS * c, BS * c, c, 1))
    t = replace(t, itemsize=2, dtype="bfloat16")
    g = GroupInfo(0, "full", "FullAttentionSpec", BS, ("model.layers.3.self_attn.attn",),
                  total_heads=8)
    _refused(VllmLayoutError, _vllm(g, t, 2),
             "Qwen3NextForCausalLM: group 0 (FullAttentionSpec) layer "
             "'model.layers.3.self_attn.attn'",
             "3 local KV heads at TP 2 do not divide the model's 8 (8 = 2 x 3 + 2)")


def test_vllm_pages_that_are_not_head_major_are_refused_under_tp() -> None:
    # [B, H, N, C] in shape, but token-major in memory (NHD): no head is one block
    t, _buf = _page(BS * 4 * 16 * 2, shape=(4, 4, BS, 16), strides=(BS * 64, 16, 64, 1))
    t = replace(t, itemsize=2, dtype="bfloat16")
    g = GroupInfo(0, "full", "FullAttentionSpec", BS, ("model.layers.3.self_attn.attn",),
                  total_heads=8)
    _refused(VllmLayoutError, _vllm(g, t, 2), "Qwen3NextForCausalLM: group 0",
             "layer 'model.layers.3.self_attn.attn'", "so TP 2 cannot be sliced by head")


def test_vllm_layout_refusals_from_the_shard_arithmetic_name_the_model() -> None:
    """A rank layout vLLM hands us whose head count TP cannot split (vLLM itself would
    have refused it; a hand-built one is refused the same way, named)."""
    c = 2 * 8
    t, _buf = _page(BS * c * 2, shape=(4, 1, BS, c), strides=(BS * c, BS * c, c, 1))
    t = replace(t, itemsize=2, dtype="bfloat16")
    g = GroupInfo(0, "full", "FullAttentionSpec", BS, ("model.layers.3.self_attn.attn",),
                  total_heads=2)
    _refused(LayoutError, _vllm(g, t, 3),
             "Qwen3NextForCausalLM: component 'g0.full' tensor 'model.layers.3.self_attn.attn' "
             "(layer 3) at TP rank 0 of 3: 2 KV heads cannot be replicated evenly over TP 3")
