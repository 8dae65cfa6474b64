"""Markdown pages as the checks see them: fenced blocks, headings and their anchors.

Only what the checks need is parsed: fences (```` ``` ```` or ``~~~``, with their info
string and the HTML comment on the line before), ATX headings outside fences, and the
prose with code blanked out (so a link inside code is not a link).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<mark>`{3,}|~{3,})(?P<info>[^`]*)$")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<key>[\w-]+):\s*(?P<value>.*?)\s*-->\s*$")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_INLINE_MARKUP = re.compile(r"`|\*\*?|(?<!\w)_|_(?!\w)|<[^>]+>")
_LINK_TEXT = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")


@dataclass(frozen=True, slots=True, kw_only=True)
class Fence:
    """One fenced block: the line its body starts on (1-based), its info string, its
    body lines, and the ``<!-- key: value -->`` comment on the line before it, if any."""

    line: int
    info: str
    body: tuple[str, ...]
    marker: tuple[str, str] | None


def fences(text: str) -> list[Fence]:
    """Every fenced block of ``text``, in order. An unclosed fence runs to the end, as
    CommonMark reads it."""
    lines = text.splitlines()
    out: list[Fence] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        close = re.compile(rf"^ {{0,3}}{re.escape(m['mark'][0])}{{{len(m['mark'])},}}\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        before = _MARKER.match(lines[i - 1]) if i else None
        out.append(Fence(line=i + 2, info=m["info"].strip(), body=tuple(lines[i + 1:j]),
                         marker=(before["key"], before["value"]) if before else None))
        i = j + 1
    return out


def prose(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` outside fences, with inline code blanked out."""
    out: list[tuple[int, str]] = []
    fence: re.Pattern[str] | None = None
    for n, line in enumerate(text.splitlines(), start=1):
        if fence is not None:
            if fence.match(line):
                fence = None
            continue
        m = _FENCE.match(line)
        if m:
            fence = re.compile(rf"^ {{0,3}}{re.escape(m['mark'][0])}{{{len(m['mark'])},}}\s*$")
            continue
        out.append((n, _INLINE_CODE.sub(lambda c: " " * len(c.group(0)), line)))
    return out


def headings(text: str) -> list[str]:
    """The text of every ATX heading outside fences, markup stripped."""
    lines = text.splitlines()
    inside = {n for f in fences(text) for n in range(f.line - 1, f.line + len(f.body) + 1)}
    out = []
    for n, line in enumerate(lines, start=1):
        m = _HEADING.match(line)
        if m and n not in inside:
            plain = _LINK_TEXT.sub(r"\1", m.group(2))
            out.append(_INLINE_MARKUP.sub("", plain))
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (word characters,
    spaces and hyphens kept), each space a hyphen."""
    kept = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return kept.replace(" ", "-")


def mkdocs_slug(heading: str) -> str:
    """MkDocs' default anchor (Python-Markdown's ``toc`` slugify): accents folded to
    ASCII, other characters dropped, runs of spaces and hyphens one hyphen."""
    ascii_ = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    kept = re.sub(r"[^\w\s-]", "", ascii_).strip().lower()
    return re.sub(r"[-\s]+", "-", kept)


def anchors(text: str, *, site: bool = False) -> set[str]:
    """The anchors a page's headings make: GitHub's, or MkDocs' with ``site``; a repeated
    heading gets ``-1``, ``-2`` … (GitHub) or ``_1``, ``_2`` … (MkDocs) after the first."""
    make, sep = (mkdocs_slug, "_") if site else (github_slug, "-")
    seen: dict[str, int] = {}
    out = set()
    for h in headings(text):
        base = make(h)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}{sep}{n}")
    return out


@dataclass(frozen=True, slots=True)
class Problem:
    """Something wrong on a page: where (path as given, 1-based line) and what."""

    page: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.message}"
