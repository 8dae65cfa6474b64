"""The front door and the pages keep their promises (issue 29): the README stays short and
its Python runs; every link and anchor of README, DEVELOPERS and ``docs/`` resolves; the
site builds in MkDocs' strict mode; quoted program output is what the program prints
now; the README's model summary is the sweep's. The checks themselves are tested in
``test_doccheck.py``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvhandoff.lab.doccheck import links, quotes
from kvhandoff.lab.doccheck.pages import fences
from kvhandoff.lab.engine.sweep_report import current_block

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, ROOT / "DEVELOPERS.md", *sorted(DOCS.rglob("*.md"))]
MAX_README_LINES = 200


def _ids(pages: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in pages]


def test_the_readme_is_a_front_door() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move detail into docs/"


def test_the_readmes_python_runs() -> None:
    snippets = [f for f in fences(README.read_text()) if f.info == "python"]
    assert snippets, "the README shows no Python"
    for f in snippets:
        code = compile("\n".join(f.body), f"README.md:{f.line}", "exec")
        exec(code, {"__name__": "readme_snippet"})  # raises on any failure


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_links_and_anchors_resolve(page: Path) -> None:
    problems = links.check_page(ROOT, page, site_dir=DOCS)
    assert not problems, "\n".join(map(str, problems))


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_quoted_output_is_what_the_program_prints(page: Path) -> None:
    problems = quotes.check_page(ROOT, page)
    assert not problems, "\n".join(map(str, problems))


def test_the_pages_do_quote_program_output() -> None:
    """The quote check has something to check: the bench, demo and soak quotes exist."""
    quoted = {f.marker[1] for p in PAGES for f in fences(p.read_text())
              if f.marker and f.marker[0] == quotes.MARKER}
    assert {"kvhandoff/lab/vllm/demo.py", "kvhandoff/lab/bench/session.py",
            "kvhandoff/lab/soak/report.py", "benchmarks/planner.py"} <= quoted


def test_the_site_builds_strict(tmp_path: Path) -> None:
    """MkDocs in strict mode: a broken link or anchor between pages, or a page missing
    from the navigation, fails the build."""
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "models" / "index.html").is_file()


def test_the_readmes_model_summary_is_the_sweeps() -> None:
    """The README's one line on models quotes the counts ``make sweep`` wrote into
    docs/models.md, and the transformers version the engine extra pins."""
    counts = current_block((DOCS / "models.md").read_text()).splitlines()[0]
    m = re.fullmatch(r"(\d+) families: (\d+) token-exact, (\d+) refused, (\d+) not buildable\.",
                     counts)
    assert m, counts
    pin = re.search(r'engine = \["transformers==([\d.]+)"\]',
                    (ROOT / "pyproject.toml").read_text())
    assert pin
    total, exact, refused, broken = m.groups()
    line = (f"Of the {total} causal-LM families in `transformers` {pin[1]}, {exact} hand off "
            f"token-exact, {refused} are")
    text = " ".join(README.read_text().split())
    assert line in text and f"and {broken} cannot be built" in text, \
        f"README's model summary differs from docs/models.md ({counts})"
