"""Decode-side prefix-cache hits: decode already holds a prompt's first pages.

A donor request sharing the prompt's first ``P`` tokens fills decode's prefix cache;
the prompt then moves only its suffix pages (plus all state), and must still decode
like colocated decoding, with decode's cache (cached prefix + received suffix) equal
to prefill's byte for byte.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvhandoff.lab.engine import CORE, run_disaggregated, sample_prompts  # noqa: E402

torch.set_num_threads(1)

# 24 and 36 are whole pages and whole chunks: a full hit for models without a window
SETUP = {name: ([24, 29, 36], 6) for name in CORE}
SETUP["deepseek_v4"] = ([256, 300], 64)
PAIR = {name: ((1, 2) if i % 2 else (2, 1)) for i, name in enumerate(CORE)}


@pytest.mark.parametrize("arch", CORE)
def test_prefix_hit_moves_only_the_suffix(arch: str) -> None:
    lengths, chunk = SETUP[arch]
    p, d = PAIR[arch]
    prompts = sample_prompts(lengths, seed=11)
    hit = run_disaggregated(arch, prompts, prefill_tp=p, decode_tp=d, chunk=chunk,
                            prefix_hit=True)
    cold = run_disaggregated(arch, prompts, prefill_tp=p, decode_tp=d, chunk=chunk)
    assert hit.ok and cold.ok, [r.state_diff for r in hit.requests + cold.requests]
    assert not any(hit.leaks.values()), hit.leaks
    served = [r for r in hit.requests if not r.donor]
    assert [r.prompt_len for r in served] == lengths
    assert all(r.prefix_len > 0 for r in served)
    for h, c in zip(served, cold.requests, strict=True):
        assert h.disaggregated == c.disaggregated
        assert h.bytes_by_component.get("kv", 0) < c.bytes_by_component["kv"]
        # every state component still moves in full
        for name, nbytes in c.bytes_by_component.items():
            if name not in ("kv", "nsa"):
                assert h.bytes_by_component[name] == nbytes, name


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "deepseek_v32"])
def test_full_prefix_hit_sends_state_and_aux_only(arch: str) -> None:
    """A page-aligned prompt decode holds entirely: the last chunk carries no pages."""
    result = run_disaggregated(arch, sample_prompts([24], seed=5), chunk=6, prefix_hit=True)
    assert result.ok
    served = result.requests[-1]
    assert served.prefix_len == served.prompt_len == 24
    assert "kv" not in served.bytes_by_component and "nsa" not in served.bytes_by_component
    assert served.bytes_by_component["aux"] == 64
    assert served.chunks == 1


def test_window_caps_the_hit() -> None:
    """Sliding-window pages always come from prefill: the hit stays below the window."""
    result = run_disaggregated("gpt_oss", sample_prompts([24], seed=5), chunk=6,
                               prefix_hit=True)
    assert result.ok
    served = result.requests[-1]
    assert 0 < served.prefix_len <= 24 - 8
    assert served.bytes_by_component["swa"] > 0
