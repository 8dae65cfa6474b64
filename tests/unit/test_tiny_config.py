"""Generic tiny configs: the common size attributes a family has are shrunk, nothing is
added, per-layer lists keep one layer of each kind, and overrides apply on top."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvhandoff.lab.engine.tiny import TINY_LAYERS, per_layer_lists, tiny_config


def test_a_family_is_shrunk_by_its_own_attribute_names() -> None:
    gpt2 = tiny_config("gpt2")  # n_embd / n_layer / n_head, no num_key_value_heads
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.vocab_size) == (64, TINY_LAYERS, 4, 128)
    assert "num_key_value_heads" not in gpt2.to_dict()
    qwen2 = tiny_config("qwen2")
    assert (qwen2.hidden_size, qwen2.num_attention_heads, qwen2.num_key_value_heads) == (64, 4, 2)
    assert qwen2.sliding_window is None  # off by default: an optional feature stays off
    assert tiny_config("cohere2").sliding_window == 8  # on by default: a small window


def test_named_tiny_architectures_are_used_as_written() -> None:
    assert tiny_config("nemotron_h").hybrid_override_pattern == "M-M*"


def test_mla_keeps_one_kv_head_per_query_head_and_the_rope_head_dim() -> None:
    cfg = tiny_config("deepseek_v2")
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.qk_rope_head_dim) == (4, 8, 8)


def test_per_layer_lists_keep_every_kind() -> None:
    kinds = ["linear"] * 5 + ["full"] + ["linear"] * 6
    values = {"num_hidden_layers": 12, "layer_types": kinds, "mlp": list(range(12)),
              "other": [1, 2]}
    out = per_layer_lists(values)
    assert out == {"layer_types": ["linear", "linear", "linear", "full"], "mlp": [0, 1, 2, 5]}
    assert per_layer_lists({"num_hidden_layers": 3, "layer_types": ["a", "b", "a"]}) == {}


def test_overrides_apply_where_generic_shrinking_cannot() -> None:
    assert tiny_config("lfm2_moe").layer_types == ["conv", "full_attention"] * 2
