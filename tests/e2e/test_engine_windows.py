"""Degenerate sliding windows: every sliding-window family the reference engine knows,
at windows 1, 2, page - 1, page and page + 1, is either handed off token-exact (and
byte-exact, nothing leaked) or refused by :func:`~kvhandoff.lab.engine.run.start`,
before any request, with a message naming the model, the layer and the window.

A window of 1 is refused: transformers' sliding-window cache keeps
``[-(window - 1):]`` tokens, which for 1 is ``[-0:]``, all of them, so the model's own
chunked prefill fails and its decode attends to the whole history; no handoff can match
that. Every other window must hand off.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvhandoff.errors import LayoutError  # noqa: E402
from kvhandoff.lab.engine import ARCHITECTURES, run_disaggregated, sample_prompts  # noqa: E402
from kvhandoff.lab.engine.run import start  # noqa: E402

torch.set_num_threads(1)

SWA_FAMILIES = sorted(name for name, a in ARCHITECTURES.items()
                      if "sliding_window" in a.config)


def _windows(name: str) -> list[int]:
    """1, 2 and page - 1, page, page + 1 for each page size a window meets: the engine
    page, and DeepSeek-V4's smaller SWA pool page."""
    a = ARCHITECTURES[name]
    pages = {a.page_size, a.swa_page_size or a.page_size}
    return sorted({1, 2} | {p + d for p in pages for d in (-1, 0, 1)})


CASES = [(name, w) for name in SWA_FAMILIES for w in _windows(name)]


def _config(name: str, window: int) -> object:
    cfg = ARCHITECTURES[name].build_config()
    cfg.sliding_window = window
    return cfg


def test_every_sliding_window_family_is_covered() -> None:
    assert {"gpt_oss", "gemma3", "mistral", "deepseek_v4"} <= set(SWA_FAMILIES)


@pytest.mark.parametrize(("name", "window"), CASES)
def test_window_hands_off_exactly_or_is_refused_at_start(name: str, window: int) -> None:
    a = ARCHITECTURES[name]
    page = a.swa_page_size or a.page_size
    # prompts shorter than, equal to and past the window, and one spanning pages
    lens = sorted({1, window, window + 1, 2 * page + 3})
    prompts = sample_prompts(lens, seed=window)
    if window == 1:
        model = ARCHITECTURES[name].model_type  # the name a bare config describes itself by
        with pytest.raises(LayoutError, match=rf"^{model} layer 0: sliding window 1, .*holds "
                                              rf"8 tokens.*window - 1 = 0"):
            start(_config(name, window), lens, prefill_tp=1, decode_tp=2,
                  page_size=a.page_size)
        return
    for prefill_tp, decode_tp, hit in ((1, 2, False), (2, 1, True)):
        result = run_disaggregated(_config(name, window), prompts, prefill_tp=prefill_tp,
                                   decode_tp=decode_tp, chunk=3, page_size=a.page_size,
                                   max_new_tokens=6, prefix_hit=hit)
        bad = [(r.prompt_len, r.disaggregated, r.colocated, r.state_diff)
               for r in result.requests if not r.ok]
        assert not bad, (name, window, prefill_tp, decode_tp, hit, bad)
        assert not any(result.leaks.values()), result.leaks
