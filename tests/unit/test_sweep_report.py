"""The family sweep's table: the models page's block is replaced between its markers only, and
saved rows load back unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvhandoff.lab.engine.sweep import Result, Row
from kvhandoff.lab.engine.sweep_report import (
    BEGIN,
    END,
    counts,
    current_block,
    load,
    render_markdown,
    save,
    splice,
)

ROWS = [
    Row(family="llama", result=Result.HANDOFF, kinds="attn", reason="", seconds=0.2),
    Row(family="lfm2", result=Result.REFUSED, kinds="",
        reason="TP 2→1: LayoutError: a | b", seconds=0.1),
    Row(family="blt", result=Result.NOT_BUILDABLE, kinds="", reason="tiny model: X", seconds=0),
]


def test_counts_and_markdown() -> None:
    assert counts(ROWS) == "3 families: 1 token-exact, 1 refused, 1 not buildable"
    md = render_markdown(ROWS)
    assert "* refused: `lfm2`" in md and "* not buildable: `blt`" in md
    assert "| `lfm2` | — | refused | TP 2→1: LayoutError: a \\| b |" in md
    assert "0.2" not in md  # no timings: the page changes only when a result does
    assert "<details>" not in md  # raw HTML would keep MkDocs from rendering the table


def test_splice_replaces_only_the_block() -> None:
    page = f"# title\n\n{BEGIN}\nold\n{END}\n\n## next\n"
    out = splice(page, "new")
    assert out == f"# title\n\n{BEGIN}\nnew\n{END}\n\n## next\n"
    assert current_block(out) == "new"
    assert splice(out, "new") == out
    with pytest.raises(ValueError, match=r"no .* block to replace"):
        splice("# no markers\n", "new")


def test_save_and_load(tmp_path: Path) -> None:
    save(ROWS, tmp_path / "sweep.json")
    assert load(tmp_path / "sweep.json") == ROWS
