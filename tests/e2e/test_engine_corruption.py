"""The end-to-end check can fail: one corrupted received byte is always caught.

Decode flips the exponent byte of one element it received (or the first token in the
aux row) before rebuilding its cache; every request must then fail the check (state
comparison, and for KV / aux also the tokens)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvhandoff.lab.engine import run_disaggregated, sample_prompts  # noqa: E402

torch.set_num_threads(1)

CASES = [
    ("llama", "kv"), ("llama", "aux"), ("qwen3_next", "mamba/conv"),
    ("qwen3_next", "mamba/ssm"), ("nemotron_h", "mamba/ssm"), ("gpt_oss", "swa"),
    ("deepseek_v3", "kv"), ("deepseek_v32", "nsa"), ("deepseek_v4", "kv/index_k"),
    ("deepseek_v4", "swa/c4_state"), ("deepseek_v4", "c128_state"),
    ("deepseek_v4", "swa_valid_from"),
]
TOKENS_FLIP = {"kv", "aux", "swa"}  # corruptions large enough to change greedy tokens


@pytest.mark.parametrize(("arch", "target"), CASES, ids=[f"{a}-{t}" for a, t in CASES])
def test_corrupted_byte_fails_the_check(arch: str, target: str) -> None:
    lengths, chunk = ([130, 300], 64) if arch == "deepseek_v4" else ([23, 37], 6)
    result = run_disaggregated(arch, sample_prompts(lengths, seed=2), prefill_tp=2,
                               decode_tp=2, chunk=chunk, corrupt=target)
    assert not result.ok
    assert all(not r.ok for r in result.requests)
    component = "aux row" if target == "aux" else target.split("/")[0]
    assert all(component in r.state_diff for r in result.requests), \
        [r.state_diff for r in result.requests]
    if target in TOKENS_FLIP:
        assert any(not r.tokens_equal for r in result.requests)
    assert not any(result.leaks.values())


def test_same_run_without_corruption_passes() -> None:
    result = run_disaggregated("llama", sample_prompts([23, 37], seed=2), prefill_tp=2,
                               decode_tp=2, chunk=6)
    assert result.ok
