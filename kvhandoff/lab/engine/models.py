"""Tiny random-weight configurations of real architectures, and model loading.

No weights are ever downloaded. :data:`ARCHITECTURES` maps a short name to a
``transformers`` model type and small dimensions (hidden 64, a few layers and heads)
with the same layer structure as the real model; :func:`load_model` builds one with a
fixed seed, or loads a local checkpoint directory (``local_files_only``).

Head counts are chosen so every TP size up to 4 splits the sharded axes evenly
(GQA KV heads replicate past TP 2, as real deployments do).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

_COMMON: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4,
    "max_position_embeddings": 2048, "tie_word_embeddings": False,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Architecture:
    """A named tiny configuration and the engine settings that suit it."""

    name: str
    model_type: str
    config: dict[str, Any] = field(default_factory=dict)
    page_size: int = 4  # engine page size (DeepSeek-V4 needs a multiple of 128)
    swa_page_size: int | None = None  # DeepSeek-V4 SWA pool page (tokens)
    about: str = ""

    def build_config(self) -> PretrainedConfig:
        cfg: PretrainedConfig = AutoConfig.for_model(self.model_type, **_COMMON, **self.config)
        return cfg


_MOE = {"num_experts_per_tok": 2}

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture(
        name="llama", model_type="llama", about="Llama: GQA full attention (2 KV heads)",
        config={"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16,
                "intermediate_size": 64},
    ),
    Architecture(
        name="qwen3_next", model_type="qwen3_next",
        about="Qwen3-Next: gated delta net (conv [q|k|v] + SSM) and full attention",
        config={"num_hidden_layers": 4, "full_attention_interval": 2, "num_key_value_heads": 2,
                "head_dim": 16, "intermediate_size": 64, "linear_num_key_heads": 4,
                "linear_num_value_heads": 8, "linear_key_head_dim": 8,
                "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 4,
                "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, **_MOE},
    ),
    Architecture(
        name="qwen3_5", model_type="qwen3_5_text",
        about="Qwen3.5 (text): gated delta net and full attention, no new engine code",
        config={"num_hidden_layers": 4, "full_attention_interval": 2, "num_key_value_heads": 2,
                "head_dim": 16, "intermediate_size": 64, "linear_num_key_heads": 4,
                "linear_num_value_heads": 8, "linear_key_head_dim": 8,
                "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4},
    ),
    Architecture(
        name="nemotron_h", model_type="nemotron_h",
        about="Nemotron-H: Mamba2 (conv [x|B|C] + SSM), MLP and attention layers",
        config={"num_hidden_layers": 4, "hybrid_override_pattern": "M-M*",
                "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64,
                "mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 4, "ssm_state_size": 8,
                "conv_kernel": 4, "chunk_size": 16},
    ),
    Architecture(
        name="bamba", model_type="bamba",
        about="Bamba: Mamba2 and attention, no new engine code",
        config={"num_hidden_layers": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                "attn_layer_indices": [1, 3], "mamba_n_heads": 8, "mamba_d_head": 8,
                "mamba_n_groups": 4, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 1,
                "mamba_chunk_size": 16},
    ),
    Architecture(
        name="jamba", model_type="jamba",
        about="Jamba: Mamba1 (conv + SSM [d_inner, d_state], sharded by d_inner), attention, MoE",
        config={"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1,
                "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 2,
                "num_key_value_heads": 2, "intermediate_size": 64, "mamba_expand": 1,
                "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_dt_rank": 8, **_MOE},
    ),
    Architecture(
        name="falcon_h1", model_type="falcon_h1",
        about="Falcon-H1: attention and Mamba2 side by side in every layer",
        config={"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16,
                "intermediate_size": 64, "mamba_n_heads": 8, "mamba_d_head": 8,
                "mamba_n_groups": 4, "mamba_d_state": 8, "mamba_d_conv": 4,
                "mamba_expand": 1, "mamba_chunk_size": 8, "mamba_d_ssm": 64},
    ),
    Architecture(
        name="mamba", model_type="mamba",
        about="Mamba: attention-free Mamba1 (conv + SSM [d_inner, d_state]), cache_params",
        config={"num_hidden_layers": 2, "state_size": 8, "expand": 1, "conv_kernel": 4,
                "time_step_rank": 8},
    ),
    Architecture(
        name="mamba2", model_type="mamba2",
        about="Mamba2: attention-free Mamba2 (conv [x|B|C] + SSM), cache_params",
        config={"num_hidden_layers": 2, "num_heads": 8, "head_dim": 8, "n_groups": 4,
                "state_size": 8, "expand": 1, "conv_kernel": 4, "chunk_size": 16},
    ),
    Architecture(
        name="falcon_mamba", model_type="falcon_mamba",
        about="Falcon-Mamba: attention-free Mamba1 with RMS-normed B/C/dt, cache_params",
        config={"num_hidden_layers": 2, "state_size": 8, "expand": 1, "conv_kernel": 4,
                "time_step_rank": 8},
    ),
    Architecture(
        name="lfm2", model_type="lfm2",
        about="LFM2: short convolutions (a conv window, no SSM, sharded by channel) and attention",
        config={"num_hidden_layers": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    ),
    Architecture(
        name="gpt_oss", model_type="gpt_oss",
        about="GPT-OSS: alternating sliding-window (8) and full attention, attention sinks",
        config={"num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 16,
                "intermediate_size": 32, "num_local_experts": 4, "sliding_window": 8, **_MOE},
    ),
    Architecture(
        name="gemma3", model_type="gemma3_text",
        about="Gemma 3 (text): sliding-window (8) and full attention, no new engine code",
        config={"num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 16,
                "intermediate_size": 64, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"] * 2},
    ),
    Architecture(
        name="mistral", model_type="mistral",
        about="Mistral (v0.1): every layer sliding-window (8) attention, so no full KV",
        config={"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16,
                "intermediate_size": 64, "sliding_window": 8},
    ),
    Architecture(
        name="deepseek_v3", model_type="deepseek_v3",
        about="DeepSeek-V3: MLA latent KV (kv_lora 16 + rope 8), replicated across TP",
        config={"num_hidden_layers": 2, "num_key_value_heads": 4, "intermediate_size": 64,
                "moe_intermediate_size": 32, "n_routed_experts": 4, "n_group": 1,
                "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16,
                "q_lora_rank": 32, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                "v_head_dim": 8, **_MOE},
    ),
    Architecture(
        name="deepseek_v32", model_type="deepseek_v32",
        about="DeepSeek-V3.2: MLA + DSA sparse indexer keys (top-8 of the context)",
        config={"num_hidden_layers": 2, "num_key_value_heads": 4, "intermediate_size": 64,
                "moe_intermediate_size": 32, "n_routed_experts": 4, "n_group": 1,
                "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16,
                "q_lora_rank": 32, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                "v_head_dim": 8, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 8,
                **_MOE},
    ),
    Architecture(
        name="deepseek_v4", model_type="deepseek_v4",
        about="DeepSeek-V4: sliding window + C4 (CSA, with indexer) + C128 (HCA) compression",
        page_size=128, swa_page_size=16,
        config={"num_hidden_layers": 4,
                "layer_types": ["sliding_attention", "compressed_sparse_attention",
                                "heavily_compressed_attention", "compressed_sparse_attention"],
                "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
                "moe_intermediate_size": 32, "head_dim": 16, "q_lora_rank": 32,
                "n_routed_experts": 4, "hc_mult": 2, "sliding_window": 16, "o_groups": 2,
                "o_lora_rank": 16, "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4,
                "partial_rotary_factor": 0.5, **_MOE},
    ),
)}
"""Every tiny architecture the engine is tested on (``kvhandoff demo --model`` names)."""

CORE = ("llama", "qwen3_next", "nemotron_h", "jamba", "falcon_h1", "gpt_oss", "deepseek_v3",
        "deepseek_v32", "deepseek_v4")
"""The architectures the TP matrix covers; the others prove new families need no code."""


def sample_prompts(lengths: list[int] | tuple[int, ...], *, vocab: int = 128, seed: int = 0
                   ) -> list[list[int]]:
    """Seeded random prompts of the given lengths (token ids below ``vocab``)."""
    rng = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=rng).tolist() for n in lengths]


def load_model(
    model: str | os.PathLike[str] | PretrainedConfig,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PreTrainedModel:
    """A causal LM in eval mode: a named tiny architecture (random weights, ``seed``),
    a ``PretrainedConfig`` (random weights), or a local checkpoint directory
    (``from_pretrained(path, local_files_only=True)``; nothing is downloaded).
    Raises ``KeyError`` for an unknown name that is not a directory."""
    if isinstance(model, PretrainedConfig):
        cfg = model
    elif str(model) in ARCHITECTURES:
        cfg = ARCHITECTURES[str(model)].build_config()
    elif os.path.isdir(model):
        m = AutoModelForCausalLM.from_pretrained(model, local_files_only=True, dtype=dtype)
        return _eval(m)
    else:
        raise KeyError(f"unknown model {str(model)!r}: not one of {sorted(ARCHITECTURES)} "
                       f"and not a local checkpoint directory")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
    return _eval(m.to(dtype))


def _eval(m: Any) -> PreTrainedModel:
    if not isinstance(m, PreTrainedModel):
        raise TypeError(f"expected a transformers model, got {type(m).__name__}")
    m.train(False)  # eval mode: no dropout
    return m
