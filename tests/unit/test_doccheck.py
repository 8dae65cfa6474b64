"""The page checks can fail: a broken link, a missing anchor, a page of the site linking
outside it, and a quote of output the program no longer prints are each caught, on
pages and programs made up here (``test_docs.py`` applies the checks to the real ones)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvhandoff.lab.doccheck import links, quotes
from kvhandoff.lab.doccheck.pages import anchors, fences, github_slug, mkdocs_slug

BENCH = '''
HEADER = ["prompt tokens", "kvh transfer ms", "NIXL transfer ms"]

def report(rows, ratio, ok):
    print(f"  {len(rows):4d} tokens: transfer {ratio:.2f}x [{'met' if ok else 'NOT met'}]")
    print(f"{'fault':<8}{'faults':>7}")
    print("-" * 8)
'''


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _quote(lines: str, source: str = "bench.py") -> str:
    return f"# Bench\n\n<!-- output-of: {source} -->\n```text\n{lines}\n```\n"


def test_fences_know_their_marker_info_and_line() -> None:
    text = "# t\n\n<!-- output-of: a.py -->\n```text\none\ntwo\n```\n\n~~~python\nx = 1\n~~~\n"
    a, b = fences(text)
    assert (a.line, a.info, a.body, a.marker) == (5, "text", ("one", "two"), ("output-of", "a.py"))
    assert (b.info, b.body, b.marker) == ("python", ("x = 1",), None)


def test_github_and_mkdocs_make_different_anchors_of_punctuation() -> None:
    assert github_slug("Links & anchors: v2") == "links--anchors-v2"
    assert mkdocs_slug("Links & anchors: v2") == "links-anchors-v2"
    page = "# A\n## `Code` and [a link](x.md)\n## A\n```sh\n# not a heading\n```\n"
    assert anchors(page) == {"a", "code-and-a-link", "a-1"}
    assert anchors(page, site=True) == {"a", "code-and-a-link", "a_1"}


def test_links_resolve_or_are_named(tmp_path: Path) -> None:
    _write(tmp_path, {
        "README.md": "[ok](docs/a.md#part-one) [gone](docs/missing.md) [web](https://x.org)\n"
                     "[bad anchor](docs/a.md#part-two) `[in code](nowhere.md)`\n"
                     "```sh\n[also code](nowhere.md)\n```\n",
        "docs/a.md": "# A\n## Part one\n[self](#part-one) [src](../src.py) [b](b.md#q--a)\n",
        "docs/b.md": "# B\n## Q & A\n",
        "src.py": "",
    })
    readme = links.check_page(tmp_path, tmp_path / "README.md", tmp_path / "docs")
    assert [(p.line, p.message.split(":")[0]) for p in readme] == [
        (1, "docs/missing.md"), (2, "docs/a.md#part-two")]
    assert "no heading of a.md makes the anchor #part-two" in str(readme[1])
    site = links.check_page(tmp_path, tmp_path / "docs" / "a.md", tmp_path / "docs")
    assert len(site) == 2
    assert "the site serves only docs/" in site[0].message  # src.py exists, but not in docs/
    assert "MkDocs makes another anchor" in site[1].message  # GitHub's #q--a, MkDocs' #q-a


def test_a_quote_of_what_the_program_prints_passes(tmp_path: Path) -> None:
    _write(tmp_path, {"bench.py": BENCH, "page.md": _quote(
        "   512 tokens: transfer 0.77x [met]\n…\n  900 tokens: transfer 1.09x [NOT met]\n"
        "fault    faults\n--------\n"
        "prompt tokens | kvh transfer ms | NIXL transfer ms\n"
        "          512 |            0.19 |             0.27")})
    assert quotes.check_page(tmp_path, tmp_path / "page.md") == []


@pytest.mark.parametrize(("line", "why"), [
    ("512 tokens: transfer 0.77x [goal met]", "a label the program does not print"),
    ("512 tokens: transfer 0.77 ms [met]", "another unit"),
    ("prompt tokens | kvh transfer ms | kvh load ms | NIXL transfer ms", "an extra column"),
    ("prompt tokens | kvh transfer ms", "a missing column"),
    ("fault   failed", "another header"),
])
def test_a_quote_the_program_no_longer_prints_fails(tmp_path: Path, line: str, why: str
                                                      ) -> None:
    _write(tmp_path, {"bench.py": BENCH, "page.md": _quote(line)})
    problems = quotes.check_page(tmp_path, tmp_path / "page.md")
    assert problems and "no longer prints" in problems[0].message, why
    assert problems[0].line == 5


def test_changing_the_program_breaks_its_quote(tmp_path: Path) -> None:
    page = _quote("512 tokens: transfer 0.77x [met]")
    _write(tmp_path, {"bench.py": BENCH, "page.md": page})
    assert quotes.check_page(tmp_path, tmp_path / "page.md") == []
    (tmp_path / "bench.py").write_text(BENCH.replace("transfer {ratio", "transfer ratio {ratio"))
    assert quotes.check_page(tmp_path, tmp_path / "page.md")


def test_a_quote_of_shapes_alone_is_refused(tmp_path: Path) -> None:
    """Rows of a table match by their cell count only: a quote needs a header or label."""
    _write(tmp_path, {"bench.py": BENCH, "page.md": _quote("  512 | 0.19 | 0.27")})
    (problem,) = quotes.check_page(tmp_path, tmp_path / "page.md")
    assert "no line of this quote is identified" in problem.message


def test_unmarked_output_and_missing_sources_are_named(tmp_path: Path) -> None:
    _write(tmp_path, {"page.md": "```text\nsome output\n```\n\n" + _quote("x", "gone.py")})
    a, b = quotes.check_page(tmp_path, tmp_path / "page.md")
    assert "a text block is quoted program output" in a.message and a.line == 1
    assert "no such file gone.py" in b.message


def test_matching_stays_linear_on_lines_that_do_not_match() -> None:
    """A dozen fields in one f-string: a backtracking regex would not finish this."""
    source = "print(f'" + " ".join(f"{{x{i}:>5}} k{i}" for i in range(12)) + "')\n"
    (t,) = quotes.templates(source)
    line = " ".join(["x"] * 400)
    assert not t.matches(line)
    assert t.matches(" ".join(f"{i} k{i}" for i in range(12)))


def test_concatenated_strings_are_one_line_each_variant() -> None:
    source = "x = '  [' + ('met' if ok else 'NOT met') + '] ' + f'{n} handoffs/s'\n"
    found = quotes.templates(source)
    assert any(t.matches("[met] 5 handoffs/s") for t in found)
    assert any(t.matches("[NOT met] 5 handoffs/s") for t in found)
    assert not any(t.matches("[done] 5 handoffs/s") for t in found)


def test_a_source_that_does_not_parse_is_named(tmp_path: Path) -> None:
    _write(tmp_path, {"bench.py": "print(f'{x'\n", "page.md": _quote("x = 1")})
    (problem,) = quotes.check_page(tmp_path, tmp_path / "page.md")
    assert "cannot parse bench.py" in problem.message
