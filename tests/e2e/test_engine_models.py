"""Model adapters: new families made of known cache-layer kinds need no engine code;
Mamba1 (Jamba) and attention + Mamba2 in one layer (Falcon-H1) map by kind too; unknown
kinds fail with a message naming the layer; a local checkpoint directory (or a
bare config) works like a named model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import AutoConfig  # noqa: E402

from kvhandoff.errors import LayoutError  # noqa: E402
from kvhandoff.lab.engine import (  # noqa: E402
    ARCHITECTURES,
    load_model,
    run_disaggregated,
    sample_prompts,
)
from kvhandoff.lab.engine.arch import cache_keyword, describe  # noqa: E402
from kvhandoff.lab.engine.tiny import tiny_config  # noqa: E402
from kvhandoff.lab.shapes import ConvInput, LayerKind  # noqa: E402

torch.set_num_threads(1)


@pytest.mark.parametrize("arch", ["qwen3_5", "bamba", "gemma3", "mistral"])
def test_other_families_need_no_engine_code(arch: str) -> None:
    result = run_disaggregated(arch, sample_prompts([16, 23, 37], seed=4), prefill_tp=2,
                               decode_tp=4, chunk=6)
    assert result.ok, [r.state_diff for r in result.requests]
    assert not any(result.leaks.values())


def test_described_layer_kinds() -> None:
    kinds = {name: describe(load_model(name), name).shape.layers
             for name in ("qwen3_next", "nemotron_h", "jamba", "falcon_h1", "gpt_oss",
                          "mistral", "mamba", "mamba2", "falcon_mamba", "deepseek_v32",
                          "deepseek_v4")}
    L = LayerKind
    assert kinds["qwen3_next"] == (L.GDN, L.ATTN, L.GDN, L.ATTN)
    assert kinds["nemotron_h"] == (L.MAMBA2, L.MLP, L.MAMBA2, L.ATTN)
    assert kinds["jamba"] == (L.MAMBA1, L.ATTN, L.MAMBA1, L.ATTN)
    assert kinds["falcon_h1"] == (L.ATTN_MAMBA2, L.ATTN_MAMBA2)
    assert kinds["gpt_oss"] == (L.SWA, L.ATTN, L.SWA, L.ATTN)
    assert kinds["mistral"] == (L.SWA, L.SWA)
    assert kinds["mamba"] == kinds["falcon_mamba"] == (L.MAMBA1, L.MAMBA1)
    assert kinds["mamba2"] == (L.MAMBA2, L.MAMBA2)
    assert kinds["deepseek_v32"] == (L.MLA, L.MLA)
    assert kinds["deepseek_v4"] == (L.DSV4_W, L.DSV4_C4, L.DSV4_C128, L.DSV4_C4)


# per request, summed over decode ranks (TP 4 shards these 1:1, nothing replicated), fp32:
# Jamba (Mamba1, d_inner 64, d_state 8, K 4): 2 layers x (conv 64 x 3 + SSM 64 x 8)
# Falcon-H1 (Mamba2 in both layers, conv [x|B|C] = 64 + 2 x 4 x 8, SSM 8 heads x 8 x 8)
MAMBA_BYTES = {"jamba": 2 * (64 * 3 + 64 * 8) * 4,
               "falcon_h1": 2 * ((64 + 2 * 4 * 8) * 3 + 8 * 8 * 8) * 4}


@pytest.mark.parametrize("arch", ["jamba", "falcon_h1"])
def test_mamba1_and_attention_mamba2_layers(arch: str) -> None:
    """Jamba's Mamba1 slot (sharded by d_inner) and Falcon-H1's layers that hold attention
    K/V *and* a Mamba2 slot hand off like the rest (the TP matrix is in
    test_engine_handoff.py); here: the bytes each component moves, from the model dims."""
    shape = describe(load_model(arch), arch).shape
    if arch == "jamba":
        assert (shape.mamba_intermediate, shape.mamba_state, shape.conv_kernel) == (64, 8, 4)
    else:
        assert (shape.mamba_heads, shape.mamba_groups, shape.kv_heads) == (8, 4, 2)
    result = run_disaggregated(arch, sample_prompts([16, 23, 37], seed=6), prefill_tp=2,
                               decode_tp=4, chunk=6)
    assert result.ok, [(r.disaggregated, r.colocated, r.state_diff) for r in result.requests]
    assert not any(result.leaks.values()), result.leaks
    kv_layers = 2  # attention layers 1, 3 (Jamba); both hybrid layers (Falcon-H1)
    for r in result.requests:
        assert len(r.disaggregated) == 16
        assert r.bytes_by_component["mamba"] == MAMBA_BYTES[arch]
        pages = -(-r.prompt_len // 4)
        # K and V x 2 KV heads x 16 x fp32 per token; decode TP 4 holds each head twice
        assert r.bytes_by_component["kv"] == 2 * kv_layers * pages * 4 * 2 * 2 * 16 * 4


# attention-free: 2 layers, fp32, no KV component at all. Mamba / Falcon-Mamba (Mamba1,
# d_inner 64, d_state 8, K 4): conv 64 x 3 + SSM 64 x 8; Mamba2 (8 heads x 8, 4 groups,
# state 8): conv [x|B|C] = 64 + 2 x 4 x 8 channels x 3 + SSM 8 x 8 x 8
SSM_BYTES = {"mamba": 2 * (64 * 3 + 64 * 8) * 4, "falcon_mamba": 2 * (64 * 3 + 64 * 8) * 4,
             "mamba2": 2 * ((64 + 2 * 4 * 8) * 3 + 8 * 8 * 8) * 4}
SSM_PAIRS = [(a, p) for a in SSM_BYTES for p in ((2, 1), (1, 2))]


@pytest.mark.parametrize(("arch", "pair"), SSM_PAIRS,
                         ids=[f"{a}-tp{p[0]}to{p[1]}" for a, p in SSM_PAIRS])
def test_attention_free_ssm_models(arch: str, pair: tuple[int, int]) -> None:
    """Mamba, Mamba2 and Falcon-Mamba take their cache as ``cache_params``, not
    ``past_key_values`` (the probe used to see an empty cache and blame short
    convolutions): their layers are the Mamba1 / Mamba2 kinds, and only the slot moves."""
    model = load_model(arch)
    assert cache_keyword(model) == "cache_params"
    assert cache_keyword(load_model("llama")) == "past_key_values"
    result = run_disaggregated(model, sample_prompts([5, 16, 23, 37], seed=8),
                               prefill_tp=pair[0], decode_tp=pair[1], chunk=6)
    assert result.ok, [(r.disaggregated, r.colocated, r.state_diff) for r in result.requests]
    assert not any(result.leaks.values()), result.leaks
    for r in result.requests:
        assert len(r.disaggregated) == 16
        assert set(r.bytes_by_component) == {"mamba", "aux"}
        assert r.bytes_by_component["mamba"] == SSM_BYTES[arch]


def test_a_cache_the_model_never_fills_is_named() -> None:
    """A model handed its cache under a name its forward does not take leaves every
    layer empty: the probe says so instead of blaming the layer's kind."""

    class Forgetful(torch.nn.Module):
        config = load_model("mamba2").config

        def forward(self, input_ids: object, past_key_values: object = None,
                    use_cache: bool = True) -> object:
            class Out:
                logits = torch.zeros((1, 1, 4))
            return Out()

    with pytest.raises(LayoutError, match="layer 0: the probe forward left this "
                                          "linear-attention layer empty"):
        describe(Forgetful())  # type: ignore[arg-type]


def test_jamba_bf16_conv_with_fp32_ssm_state() -> None:
    """bf16 conv rows next to HF's fp32 Mamba1 SSM state: each moves with its own width."""
    result = run_disaggregated("jamba", sample_prompts([16, 37]), prefill_tp=2, decode_tp=4,
                               chunk=6, dtype=torch.bfloat16)
    assert result.ok, [r.state_diff for r in result.requests]
    assert result.requests[0].bytes_by_component["mamba"] == 2 * (64 * 3 * 2 + 64 * 8 * 4)


CORRUPT = [("jamba", "mamba/conv"), ("jamba", "mamba/ssm"), ("falcon_h1", "kv"),
           ("falcon_h1", "mamba/ssm")]


@pytest.mark.parametrize(("arch", "target"), CORRUPT, ids=[f"{a}-{t}" for a, t in CORRUPT])
def test_new_kinds_catch_a_corrupted_byte(arch: str, target: str) -> None:
    """The check can fail for the new kinds: one flipped received byte (of the Mamba1
    slot, or of either half of a hybrid layer) fails every request, and nothing leaks."""
    result = run_disaggregated(arch, sample_prompts([23, 37], seed=2), prefill_tp=2,
                               decode_tp=1, chunk=6, corrupt=target)
    assert not result.ok and not any(r.ok for r in result.requests)
    component = target.split("/")[0]
    assert all(component in r.state_diff for r in result.requests), \
        [r.state_diff for r in result.requests]
    assert not any(result.leaks.values())


# LFM2 (hidden 64, conv_L_cache 3): per short-conv layer a [64, 2] fp32 conv window
SHORT_CONV_BYTES = 2 * 64 * 2 * 4
SHORT_CONV_PAIRS = [(2, 1), (1, 2), (2, 4)]


@pytest.mark.parametrize("pair", SHORT_CONV_PAIRS,
                         ids=[f"tp{p}to{d}" for p, d in SHORT_CONV_PAIRS])
def test_short_convolution_state(pair: tuple[int, int]) -> None:
    """LFM2's short-conv layers keep a conv window and no recurrent state: their own state
    kind (``short_conv``, one slot, sharded by channel) next to the attention KV."""
    shape = describe(load_model("lfm2"), "lfm2").shape
    assert shape.layers == (LayerKind.SHORT_CONV, LayerKind.ATTN) * 2
    assert (shape.short_conv_channels, shape.short_conv_kernel) == (64, 3)
    result = run_disaggregated("lfm2", sample_prompts([5, 16, 23, 37], seed=9),
                               prefill_tp=pair[0], decode_tp=pair[1], chunk=6)
    assert result.ok, [(r.disaggregated, r.colocated, r.state_diff) for r in result.requests]
    assert not any(result.leaks.values()), result.leaks
    for r in result.requests:
        assert len(r.disaggregated) == 16
        assert set(r.bytes_by_component) == {"kv", "short_conv", "aux"}
        # channels shard 1:1 at every TP size here: each byte lands once
        assert r.bytes_by_component["short_conv"] == SHORT_CONV_BYTES


def test_short_convolution_catches_a_corrupted_byte() -> None:
    result = run_disaggregated("lfm2", sample_prompts([23, 37], seed=2), prefill_tp=2,
                               decode_tp=1, chunk=6, corrupt="short_conv")
    assert not result.ok and not any(r.ok for r in result.requests)
    assert all("short_conv" in r.state_diff for r in result.requests)
    assert not any(result.leaks.values())


KV_GROUP_PAIRS = [(2, 1), (1, 2), (2, 4)]


@pytest.mark.parametrize("pair", KV_GROUP_PAIRS, ids=[f"tp{p}to{d}" for p, d in KV_GROUP_PAIRS])
@pytest.mark.parametrize(("family", "groups"), [
    # Gemma 4: sliding layers 2 KV heads x 16, the full layer 2 x 512
    ("gemma4_text", ((2, 16, 16), ((3,), 2, 512, 0))),
    # MiMo-V2-Flash: K 16 / V 8 everywhere; the full layer 2 KV heads, sliding ones 4
    ("mimo_v2_flash", ((2, 16, 8), ((1, 2, 3), 4, 16, 8))),
])
def test_layers_of_other_kv_shapes_get_a_pool_each(family: str, groups: tuple,
                                                   pair: tuple[int, int]) -> None:
    """Layers that disagree on KV heads or head dims, and K and V of different head
    dims: each layer's pages take its KV group's shape and are head-sharded by that
    group's heads (at decode TP 4 a 2-head group is replicated while a 4-head one is
    sharded), and the handoff is token-exact."""
    cfg = tiny_config(family)
    shape = describe(load_model(cfg)).shape
    (heads, k_dim, v_dim), (layers, g_heads, g_k, g_v) = groups
    assert (shape.kv_heads, shape.head_dim, shape.v_head_dim or shape.head_dim) == \
        (heads, k_dim, v_dim)
    assert [(g.layers, g.kv_heads, g.head_dim, g.v_head_dim) for g in shape.kv_groups] == \
        [(layers, g_heads, g_k, g_v)]
    result = run_disaggregated(cfg, sample_prompts([5, 19, 30], seed=3), prefill_tp=pair[0],
                               decode_tp=pair[1], chunk=6, max_new_tokens=8)
    assert result.ok, [(r.disaggregated, r.colocated, r.state_diff) for r in result.requests]
    assert not any(result.leaks.values()), result.leaks


@pytest.mark.parametrize("pair", KV_GROUP_PAIRS, ids=[f"tp{p}to{d}" for p, d in KV_GROUP_PAIRS])
def test_attention_with_short_convolutions(pair: tuple[int, int]) -> None:
    """Inkling's layers keep sliding (or full) attention *and* four short-conv windows:
    a layer kind each (``swa_short_conv``, ``attn_short_conv``). The convs over K and V
    shard by the layer's KV heads like its pages; the two over the residual stream are
    replicated (their input is all-reduced: every TP rank holds all of it)."""
    cfg = tiny_config("inkling_text")
    shape = describe(load_model(cfg)).shape
    assert shape.layers == (LayerKind.SWA_SHORT_CONV,) * 3 + (LayerKind.ATTN_SHORT_CONV,)
    assert [(c.name, c.input, c.kernel) for c in shape.layer_convs] == [
        ("conv0", ConvInput.KEYS, 4), ("conv1", ConvInput.KEYS, 4),  # K, V of one width
        ("conv2", ConvInput.HIDDEN, 4), ("conv3", ConvInput.HIDDEN, 4)]
    result = run_disaggregated(cfg, sample_prompts([5, 19, 30], seed=5), prefill_tp=pair[0],
                               decode_tp=pair[1], chunk=6, max_new_tokens=8)
    assert result.ok, [(r.disaggregated, r.colocated, r.state_diff) for r in result.requests]
    assert not any(result.leaks.values()), result.leaks
    # bytes summed over decode ranks: 4 layers x (K [32, 3] + V [32, 3], 2 heads, whole
    # once per head replica; residual stream twice [64, 3], whole on every rank), fp32
    d = pair[1]
    want = 4 * (2 * 32 * max(1, d // 2) + 2 * 64 * d) * 3 * 4
    for r in result.requests:
        assert set(r.bytes_by_component) == {"kv", "swa", "short_conv", "aux"}
        assert r.bytes_by_component["short_conv"] == want


def test_attention_with_short_convolutions_catches_a_corrupted_byte() -> None:
    result = run_disaggregated(tiny_config("inkling_text"), sample_prompts([23], seed=2),
                               prefill_tp=2, decode_tp=1, chunk=6, corrupt="short_conv")
    assert not result.ok and all("short_conv" in r.state_diff for r in result.requests)
    assert not any(result.leaks.values())


def test_multi_head_mamba1_beside_attention() -> None:
    """Zamba's mixer is Mamba1 cut into heads (SSM [2, 32, 8] is [d_inner 64, 8]; its conv
    holds x alone, no B/C): a Mamba1 slot sharded by d_inner, alone or beside attention in
    one layer (``attn_mamba1``)."""
    cfg = tiny_config("zamba")
    shape = describe(load_model(cfg)).shape
    L = LayerKind
    assert shape.layers == (L.MAMBA1, L.MAMBA1, L.ATTN_MAMBA1, L.MAMBA1)
    assert (shape.mamba_intermediate, shape.mamba_state) == (64, 8)
    for p, d in ((2, 1), (1, 2)):
        result = run_disaggregated(cfg, sample_prompts([5, 19], seed=7), prefill_tp=p,
                                   decode_tp=d, chunk=6, max_new_tokens=8)
        assert result.ok, [(r.disaggregated, r.colocated, r.state_diff)
                           for r in result.requests]


@pytest.mark.parametrize(("model_type", "kwargs", "message"), [
    # ZAYA's hybrid layers: attention next to a CCA state of another shape (2-D), full ...
    ("zaya", {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16,
              "moe_intermediate_size": 32, "num_experts": 2, "router_hidden_size": 16},
     "layer 0: linear-attention layer with a 2-D recurrent state"),
    # ... or sliding-window attention: the state is what no layer kind holds
    ("zaya", {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16,
              "moe_intermediate_size": 32, "num_experts": 2, "router_hidden_size": 16,
              "sliding_window": 8, "layer_types": ["hybrid_sliding", "hybrid"]},
     "layer 0: linear-attention layer with a 2-D recurrent state"),
], ids=["zaya-hybrid-cca", "zaya-hybrid-sliding"])
def test_unsupported_layer_kinds_fail_clearly(model_type: str, kwargs: dict, message: str
                                              ) -> None:
    cfg = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=64,
                               num_attention_heads=4, **kwargs)
    with pytest.raises(LayoutError, match=message):
        describe(load_model(cfg))


def test_local_checkpoint_directory(tmp_path: Path) -> None:
    load_model("llama", seed=3).save_pretrained(tmp_path)
    result = run_disaggregated(str(tmp_path), sample_prompts([21, 40]), prefill_tp=2,
                               chunk=16)
    assert result.ok and result.page_size == 16
    from_config = run_disaggregated(ARCHITECTURES["llama"].build_config(),
                                    sample_prompts([21, 40]), chunk=16)
    assert from_config.ok


def test_unknown_model_name() -> None:
    with pytest.raises(KeyError, match="unknown model"):
        load_model("no-such-model")


# Linear-attention families with *unequal* conv blocks, and how each family's own
# transformers mixer sizes them: delta nets [q | k | v] (key_dim, key_dim, value_dim),
# Kimi delta attention (qkv_dim three times: one head dim, equal by construction), Mamba2
# [x | B | C] (intermediate_size, n_groups x state twice).
_GDN = {"linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_num_value_heads": 4,
        "linear_value_head_dim": 16}  # q = k = 16 channels, v = 64


def _mamba2(groups: str) -> dict[str, int]:
    return {groups: 2}  # x = 8 heads x 8 = 64 channels, B = C = 2 groups x state 8 = 16


UNEQUAL = {
    "qwen3_next": _GDN, "olmo_hybrid": _GDN, "kimi_linear": {},
    "bamba": _mamba2("mamba_n_groups"), "mamba2": _mamba2("n_groups"),
    "nemotron_h": _mamba2("n_groups"), "zamba2": _mamba2("mamba_ngroups"),
}


def _mixer_blocks(model: torch.nn.Module) -> tuple[int, ...]:
    """The conv's sub-blocks as the family's own mixer module sizes them."""
    mixer = next(m for m in model.modules() if hasattr(m, "conv1d"))
    if hasattr(mixer, "key_dim"):
        return (mixer.key_dim, mixer.key_dim, mixer.value_dim)
    if hasattr(mixer, "qkv_dim"):
        return (mixer.qkv_dim,) * 3
    bc = mixer.n_groups * mixer.ssm_state_size
    return (mixer.intermediate_size, bc, bc)


@pytest.mark.parametrize("family", sorted(UNEQUAL))
def test_conv_split_is_the_familys_own(family: str) -> None:
    """Issue 12: the conv's q/k/v (or x/B/C) split comes from each family's config, not
    from a rule that holds only when the blocks are equal. Checked per rank against the
    family's own sharding in vLLM's terms (each block of the mixer's sizes cut into TP
    contiguous slices on its own), then handed off token-exact."""
    from kvhandoff.lab.engine.sharding import axis_positions
    from kvhandoff.lab.shapes import layout_for

    cfg = tiny_config(family)
    for k, v in UNEQUAL[family].items():
        setattr(cfg, k, v)
    model = load_model(cfg)
    blocks = _mixer_blocks(model)
    shape = describe(model).shape
    assert shape.conv_groups == blocks
    if UNEQUAL[family]:
        assert len(set(blocks)) > 1
    for tp in (1, 2):
        for r in range(tp):
            lay = layout_for(shape, tp_rank=r, tp_size=tp, page_size=4, num_pages=4,
                             num_slots=2)
            conv = next(t for t in lay.component("mamba").tensors if t.name == "conv")
            assert conv.shard is not None
            want = np.concatenate([off + np.arange(r * n // tp, (r + 1) * n // tp)
                                   for off, n in zip(np.cumsum((0, *blocks[:-1])), blocks,
                                                     strict=True)])
            np.testing.assert_array_equal(axis_positions(conv.shard, r, tp), want)
    for p, d in ((2, 1), (1, 2)):
        result = run_disaggregated(cfg, sample_prompts([5, 19], seed=8), prefill_tp=p,
                                   decode_tp=d, chunk=6, max_new_tokens=6)
        assert result.ok, [(r.disaggregated, r.colocated, r.state_diff)
                           for r in result.requests]


@pytest.mark.parametrize(("arch", "prefill_tp", "decode_tp", "parts"), [
    ("qwen3_next", 1, 8, ("qwen3_next: component 'mamba': gated delta net layers 0, 2: ",
                          "4 key heads and 8 value heads do not split into whole heads over "
                          "TP 8")),
    ("llama", 3, 1, ("llama: component 'kv': tensor 'k' (layer 0) at TP rank 0 of 3: ",
                     "2 KV heads cannot be replicated evenly over TP 3")),
])
def test_a_tp_the_model_cannot_split_is_refused_at_start_up_naming_it(
        arch: str, prefill_tp: int, decode_tp: int, parts: tuple[str, ...]) -> None:
    """The reference engine refuses before its first request, naming the model, the
    component, the layers and the numbers (the engine's layouts are the named shapes')."""
    from kvhandoff.lab.engine.run import start

    with pytest.raises(LayoutError) as e:
        start(arch, [9], prefill_tp=prefill_tp, decode_tp=decode_tp)
    assert all(p in str(e.value) for p in parts), str(e.value)
