"""A tiny random-weight config for any ``transformers`` model type, by generic shrinking.

:func:`tiny_config` starts from the model type's default config and, for every common
size attribute that config *has* (hidden size, layers, heads, KV heads, head dim, FFN
and expert sizes, vocabulary, MLA ranks, linear-attention and Mamba dims, sliding
window …), passes a small value to the config's constructor, so derived fields
(``layer_types``, per-layer patterns) follow. Sub-configs (a text model inside a
multimodal one, a vision tower) are shrunk the same way. An attribute a family does
not have is never added, and an attribute whose default is ``None`` (an optional
feature that is off, e.g. ``q_lora_rank`` or ``sliding_window``) stays off.

Families whose structure generic shrinking cannot reproduce take their config from
:data:`OVERRIDES` (each with the reason) or from the engine's named tiny architectures
(:data:`kvhandoff.lab.engine.models.ARCHITECTURES`, matched by model type), which were
written by hand for the same reason.

Dimensions match the named tiny models: hidden 64, 4 attention heads of 16, 2 KV heads,
so TP 1 and 2 split every sharded axis evenly.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig

from kvhandoff.lab.engine.models import _COMMON, ARCHITECTURES

TINY_LAYERS = 4
"""Layers in a shrunk config: enough for a hybrid pattern to show two kinds."""

_SIZES: tuple[tuple[tuple[str, ...], int], ...] = (
    (("vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input",
      "encoder_hash_byte_group_vocab"), 128),
    (("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "word_embed_proj_dim",
      "lru_width", "backbone_hidden_size", "mamba_d_ssm", "emb_dim", "adapter_in_dim",
      "adapter_input_size"), 64),
    (("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers",
      "encoder_layers"), TINY_LAYERS),
    (("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
      "decoder_attention_heads", "swa_num_attention_heads", "linear_num_heads"), 4),
    (("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
      "swa_num_key_value_heads", "index_n_heads"), 2),
    (("head_dim", "attention_head_dim", "kv_channels", "dim_head", "swa_head_dim",
      "linear_head_dim", "qk_head_dim", "index_head_dim"), 16),
    (("rotary_dim",), 8),
    (("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "decoder_ffn_dim",
      "encoder_ffn_dim", "dim_ff", "dff", "intermediate_size_mlp", "dense_intermediate_size"),
     64),
    (("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
      "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size",
      "expert_ffn_hidden_size", "hidden_size_per_layer_input"), 32),
    (("num_kv_shared_layers",), 0),
    (("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    (("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token"), 2),
    (("n_group", "topk_group", "num_expert_group"), 1),
    (("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"), 512),
    (("sliding_window", "sliding_window_size", "attention_window_size"), 8),
    (("kv_lora_rank", "q_lora_rank"), 16),
    (("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "linear_key_head_dim",
      "linear_value_head_dim", "mamba_d_head", "mamba_head_dim", "mamba_d_state",
      "state_size", "ssm_state_size", "time_step_rank", "mamba_dt_rank", "index_topk"), 8),
    (("linear_num_key_heads",), 4),
    (("linear_num_value_heads", "mamba_n_heads", "mamba_num_heads"), 8),
    (("mamba_n_groups", "n_groups", "mamba_ngroups"), 4),
    (("mamba_d_conv", "conv_kernel", "linear_conv_kernel_dim"), 4),
    (("mamba_expand", "expand"), 1),
    (("chunk_size", "mamba_chunk_size"), 16),
)
SIZES: dict[str, int] = {name: v for names, v in _SIZES for name in names}
"""Every size attribute :func:`tiny_config` shrinks, and the value it gets."""

_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_MHA_WHEN_NONE = ("num_key_value_heads", "head_dim")  # None means "derive it": say so
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

_QSA = {"indexer_budget": 16, "indexer_compress_ratio": 4, "indexer_n_heads": 2,
        "indexer_kv_heads": 1, "indexer_head_dim": 16}
OVERRIDES: dict[str, dict[str, Any]] = {
    # Dots3 attention is MHA only (the config validates kv heads == heads).
    "dots3_note": {"num_key_value_heads": 4, "text_config": {"num_key_value_heads": 4}},
    "dots3_note_text": {"num_key_value_heads": 4},
    # ZAYA routes to exactly one expert (the config refuses anything else).
    "zaya": {"num_experts_per_tok": 1},
    # the assistant's default config fails its own validation (it wants no per-layer
    # inputs, which the default text config has).
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0,
                                         "vocab_size_per_layer_input": 0}},
    # GPT-Neo lists its attention per layer as (pattern, repeats) pairs, not layer_types.
    "gpt_neo": {"attention_types": [[["global", "local"], TINY_LAYERS // 2]]},
    # Defaults with no attention layer at all (transformers' own chunked decoding then
    # fails), or no layer pattern: the released checkpoints interleave both kinds.
    "granitemoehybrid": {"layer_types": ["mamba", "attention"] * (TINY_LAYERS // 2)},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"] * (TINY_LAYERS // 2)},
    # the default indexer (QSA) has no budget, compression ratio or head sizes (None).
    "qwen4_exp": {"text_config": _QSA},
    "qwen4_exp_text": _QSA,
    # Reformer's LM head works only as a decoder, which its default config is not; its
    # axial position factors must sum to the hidden size.
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32]},
}
"""Per-family config values where generic shrinking cannot work (each with why)."""


def tiny_config(model_type: str) -> PretrainedConfig:
    """A small config of ``model_type`` (``AutoConfig.for_model``): a named tiny
    architecture's hand-written config when one has this model type, else the default
    config shrunk by :data:`SIZES`, then :data:`OVERRIDES`. Raises whatever
    ``transformers`` raises for a config it cannot build."""
    named = next((a for a in ARCHITECTURES.values() if a.model_type == model_type), None)
    if named is not None:
        return named.build_config()
    override = OVERRIDES.get(model_type, {})
    try:
        default = AutoConfig.for_model(model_type)
    except Exception:  # a default config that fails its own validation: overrides fix it
        default = AutoConfig.for_model(model_type, **override)
    kwargs = _merge(shrink(default), override)
    cfg: PretrainedConfig = AutoConfig.for_model(model_type, **kwargs)
    return cfg


def shrink(cfg: PretrainedConfig) -> dict[str, Any]:
    """Constructor keywords that shrink ``cfg``: every attribute of :data:`SIZES` it sets
    (not ``None``), sub-configs recursively (as dicts, with their ``model_type``),
    special token ids moved inside the vocabulary, and untied-embedding settings of
    the named tiny models."""
    values = cfg.to_dict()
    out: dict[str, Any] = {k: v for k, v in SIZES.items()
                           if isinstance(values.get(k), int) and not isinstance(values[k], bool)}
    for k in _MHA_WHEN_NONE:
        if k in values and values[k] is None:
            out[k] = SIZES["num_attention_heads"] if k == "num_key_value_heads" else SIZES[k]
    if any(isinstance(values.get(k), int) for k in _EXPERTS):  # routed: top-k must fit
        out["num_experts_per_tok"] = SIZES["num_experts_per_tok"]
    if "kv_lora_rank" in values:  # MLA: K/V heads are the query heads; head_dim is the rope
        out["num_key_value_heads"] = SIZES["num_attention_heads"]
        out["head_dim"] = SIZES["qk_rope_head_dim"]
    out |= per_layer_lists(values)
    for key in getattr(cfg, "sub_configs", {}) or {}:
        sub = getattr(cfg, key, None)
        if isinstance(sub, PretrainedConfig) and (small := shrink(sub)):
            out[key] = {"model_type": sub.model_type, **small}
    vocab = out.get("vocab_size")
    if vocab is not None:
        for k in _TOKEN_IDS:
            if isinstance(values.get(k), int) and values[k] >= vocab:
                out[k] = vocab - 1 - _TOKEN_IDS.index(k)
    if "tie_word_embeddings" in values:
        out["tie_word_embeddings"] = _COMMON["tie_word_embeddings"]
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def per_layer_lists(values: dict[str, Any]) -> dict[str, list[Any]]:
    """Every list with one entry per layer (``layer_types``, ``mlp_layer_types`` …),
    cut to :data:`TINY_LAYERS` entries at the same layers: the first layer of each
    distinct ``layer_types`` value, then the earliest others, in layer order. So a
    hybrid whose first attention layer comes late (every sixth layer) keeps one."""
    n = next((values[k] for k in _LAYER_COUNTS if isinstance(values.get(k), int)), None)
    lists = {k: v for k, v in values.items() if isinstance(v, list) and len(v) == n}
    if not n or n <= TINY_LAYERS or not lists:
        return {}
    key = lists.get("layer_types") or next(iter(lists.values()))
    firsts = list(dict.fromkeys(key.index(v) for v in key))
    keep = sorted((firsts + [i for i in range(n) if i not in firsts])[:TINY_LAYERS])
    return {k: [v[i] for i in keep] for k, v in lists.items()}
