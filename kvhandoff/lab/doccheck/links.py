"""Every link of a page resolves: to a file of the repository, and to a heading of it
when it names an anchor.

Rules, beyond "the target exists":

* an anchor must be one a heading of the target makes on GitHub; between two pages of
  the site (``site_dir``, i.e. ``docs/``) it must also be the anchor MkDocs makes, so the
  link works in both places;
* a page of the site links only inside the site: MkDocs serves nothing else, so a
  source file is named in a code span there, not linked;
* web links (any ``scheme:``) are not fetched: the check runs offline.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote

from kvhandoff.lab.doccheck.pages import Problem, anchors, prose

_MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?(?P<target>[^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_LINK = re.compile(r"\b(?:href|src)=\"(?P<target>[^\"]*)\"")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def targets(text: str) -> list[tuple[int, str]]:
    """``(line, target)`` of every Markdown and HTML link outside code."""
    out = []
    for n, line in prose(text):
        for pattern in (_MD_LINK, _HTML_LINK):
            out += [(n, m["target"]) for m in pattern.finditer(line)]
    return out


def check_page(root: Path, page: Path, site_dir: Path | None = None) -> list[Problem]:
    """The problems of ``page``'s links (paths are resolved against the page's folder and
    must stay inside ``root``)."""
    root, page = root.resolve(), page.resolve()
    name = str(page.relative_to(root))
    text = page.read_text()
    in_site = site_dir is not None and page.is_relative_to(site_dir.resolve())
    problems = []
    for line, target in targets(text):
        if not target:
            problems.append(Problem(name, line, "a link with no target"))
        elif not _SCHEME.match(target):
            why = _check_target(root, page, text, target, site_dir if in_site else None)
            if why:
                problems.append(Problem(name, line, f"{target}: {why}"))
    return problems


def _check_target(root: Path, page: Path, text: str, target: str,
                  site_dir: Path | None) -> str:
    path, _, anchor = target.partition("#")
    dest = (page.parent / unquote(path)).resolve() if path else page
    if not dest.is_relative_to(root):
        return "points outside the repository"
    if not dest.exists():
        return f"no such file ({dest.relative_to(root)})"
    if site_dir is not None:
        if not dest.is_relative_to(site_dir.resolve()):
            return ("the site serves only docs/: name this file in a code span, or link a "
                    "page of docs/")
        if dest.is_dir():
            return "the site cannot serve a folder: link a file in it"
    if not anchor:
        return ""
    if dest.suffix != ".md":
        return "an anchor into a file that is not Markdown"
    dest_text = text if dest == page else dest.read_text()
    if anchor not in anchors(dest_text):
        return f"no heading of {dest.name} makes the anchor #{anchor}"
    if site_dir is not None and anchor not in anchors(dest_text, site=True):
        return (f"#{anchor} works on GitHub but MkDocs makes another anchor of that heading "
                f"of {dest.name}: simplify the heading")
    return ""


def check_pages(root: Path, pages: Iterable[Path], site_dir: Path | None = None
                ) -> list[Problem]:
    """:func:`check_page` over ``pages``."""
    return [p for page in pages for p in check_page(root, page, site_dir)]
