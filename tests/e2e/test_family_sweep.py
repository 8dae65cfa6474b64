"""The family sweep (issue 12): every causal-LM model type of the installed transformers,
as a tiny random-weight model, hands off token-exact through the in-process engine (TP
2→1 and 1→2), or is refused at start-up with a message naming the cause, or cannot be
built / run by transformers itself here. None fails after start-up, and the model list
of ``docs/models.md`` is this table (``make sweep`` regenerates it)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.models.auto.modeling_auto import (  # noqa: E402
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)

from kvhandoff.lab import cli  # noqa: E402
from kvhandoff.lab.engine import sweep as sweep_module  # noqa: E402
from kvhandoff.lab.engine.sweep import Result, Row, families, sweep_family  # noqa: E402
from kvhandoff.lab.engine.sweep_report import (  # noqa: E402
    BEGIN,
    END,
    current_block,
    load,
    render_markdown,
    splice,
)

torch.set_num_threads(1)
MODELS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"
FAMILIES = families()


@functools.cache
def row(family: str) -> Row:
    return sweep_family(family)


def test_the_list_is_transformers_own() -> None:
    assert sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) == FAMILIES
    assert len(FAMILIES) > 100


@pytest.mark.parametrize("family", FAMILIES)
def test_family_hands_off_or_is_refused_at_start_up(family: str) -> None:
    r = row(family)
    assert r.result is not Result.FAILED, r.reason
    if r.result is Result.HANDOFF:
        assert r.kinds and not r.reason
    else:
        assert r.reason, f"{family}: {r.result.value} without a reason"


@pytest.mark.parametrize(("family", "result", "kinds", "reason"), [
    ("llama", Result.HANDOFF, "attn", ""),
    ("mistral", Result.HANDOFF, "swa", ""),
    ("qwen3_next", Result.HANDOFF, "gdn, attn", ""),
    ("mamba", Result.HANDOFF, "mamba1", ""),
    ("lfm2", Result.HANDOFF, "short_conv, attn", ""),
    ("gemma4_text", Result.HANDOFF, "swa, attn", ""),  # a pool per K/V page shape
    ("mimo_v2_flash", Result.HANDOFF, "attn, swa", ""),  # K and V head dims differ
    ("inkling_text", Result.HANDOFF, "swa_short_conv, attn_short_conv", ""),
    ("zamba", Result.HANDOFF, "mamba1, attn_mamba1", ""),
    ("zaya", Result.REFUSED, "", "linear-attention layer with a 2-D recurrent state"),
    ("mllama", Result.REFUSED, "", "left this layer's attention K/V empty"),
    ("rwkv", Result.REFUSED, "", "forward takes no cache"),
])
def test_named_results(family: str, result: Result, kinds: str, reason: str) -> None:
    """A few families whose outcome is known: the causes are the real ones."""
    r = row(family)
    assert (r.result, r.kinds) == (result, kinds), r
    assert reason in r.reason


def test_a_failure_after_start_up_is_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep can fail: an error once requests run is ``failed``, never a refusal."""
    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("lost a page")

    monkeypatch.setattr(sweep_module, "serve", broken)
    r = sweep_family("llama")
    assert r.result is Result.FAILED
    assert r.reason == "TP 2→1: after start-up: RuntimeError: lost a page"


def test_models_page_is_the_sweeps_table() -> None:
    block = render_markdown([row(f) for f in FAMILIES])
    text = MODELS_PAGE.read_text()
    assert current_block(text) == block, "docs/models.md's model list is stale: run `make sweep`"
    assert splice(text, block) == text


def test_sweep_command_writes_the_table_and_the_page(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """``kvhandoff sweep``: prints the table, saves it, regenerates the page's block from
    a run or from the saved table."""
    page = tmp_path / "models.md"
    page.write_text(f"# models\n{BEGIN}\nstale\n{END}\nrest\n")
    out = tmp_path / "sweep.json"
    args = ["sweep", "--family", "llama", "--family", "rwkv"]
    assert cli.main([*args, "--json", str(out), "--page", str(page)]) == 0
    assert "2 families: 1 token-exact, 1 refused" in capsys.readouterr().out
    rows = load(out)
    assert [(r.family, r.result) for r in rows] == [("llama", Result.HANDOFF),
                                                    ("rwkv", Result.REFUSED)]
    assert current_block(page.read_text()) == render_markdown(rows)
    page.write_text(f"# models\n{BEGIN}\nstale\n{END}\nrest\n")
    assert cli.main(["sweep", "--from-json", str(out), "--page", str(page)]) == 0
    assert page.read_text().endswith(f"{END}\nrest\n")
    assert current_block(page.read_text()) == render_markdown(rows)
