"""Model adapters: new families made of known cache-layer kinds need no engine code;
unknown kinds fail with a message naming the layer; a local checkpoint directory (or a
bare config) works like a named model."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import AutoConfig  # noqa: E402

from kvhandoff.engine import (  # noqa: E402
    ARCHITECTURES,
    load_model,
    run_disaggregated,
    sample_prompts,
)
from kvhandoff.engine.arch import describe  # noqa: E402
from kvhandoff.errors import LayoutError  # noqa: E402
from kvhandoff.shapes import LayerKind  # noqa: E402

torch.set_num_threads(1)


@pytest.mark.parametrize("arch", ["qwen3_5", "bamba", "gemma3"])
def test_other_families_need_no_engine_code(arch: str) -> None:
    result = run_disaggregated(arch, sample_prompts([16, 23, 37], seed=4), prefill_tp=2,
                               decode_tp=4, chunk=6)
    assert result.ok, [r.state_diff for r in result.requests]
    assert not any(result.leaks.values())


def test_described_layer_kinds() -> None:
    kinds = {name: describe(load_model(name), name).shape.layers
             for name in ("qwen3_next", "nemotron_h", "gpt_oss", "deepseek_v32", "deepseek_v4")}
    L = LayerKind
    assert kinds["qwen3_next"] == (L.GDN, L.ATTN, L.GDN, L.ATTN)
    assert kinds["nemotron_h"] == (L.MAMBA2, L.MLP, L.MAMBA2, L.ATTN)
    assert kinds["gpt_oss"] == (L.SWA, L.ATTN, L.SWA, L.ATTN)
    assert kinds["deepseek_v32"] == (L.MLA, L.MLA)
    assert kinds["deepseek_v4"] == (L.DSV4_W, L.DSV4_C4, L.DSV4_C128, L.DSV4_C4)


@pytest.mark.parametrize(("model_type", "kwargs", "message"), [
    ("jamba", {"num_hidden_layers": 2, "num_key_value_heads": 2, "intermediate_size": 64,
               "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
               "expert_layer_offset": 1, "num_experts": 2, "mamba_d_state": 8,
               "mamba_d_conv": 4, "mamba_expand": 1, "mamba_dt_rank": 8},
     "layer 0: linear-attention layer without a 4-D recurrent state"),
    ("falcon_h1", {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16,
                   "intermediate_size": 64, "mamba_n_heads": 8, "mamba_d_head": 8,
                   "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4,
                   "mamba_expand": 1, "mamba_chunk_size": 8, "mamba_d_ssm": 64},
     "layer 0: no engine codec for cache layer kind 'hybrid'"),
])
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
