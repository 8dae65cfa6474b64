"""Quoted program output stays true: a quote is checked against the code that prints it.

A page quotes output in a ``text`` fence marked on the line before::

    <!-- output-of: kvhandoff/lab/soak/report.py -->
    ```text
    fault            faults in flight  failed  median s   max s  bound s
    cut link              7        32      23      2.92    8.14        3
    ```

Every line of the quote must be one the named file(s) can print. What a file can print
is read from its source (:mod:`ast`, never imported). Each string literal, f-string and
``+`` of strings is a line template: its literal text must appear as written (runs of
whitespace compare as one space), each replacement field stands for any text, a field of
a constant is formatted and then literal (``{'fault':<16}``), and a field choosing
between constants (``{'met' if ok else 'NOT met'}``) makes one template per choice. Each
list or tuple of three or more strings is a table header (cells joined by ``|``), with
its rule line (``---+---``) and its rows (that many cells). A template with little
literal text (the rows of a fixed-width or ``|`` table) is *weak*: it vouches for a
line's shape only, so a quote must also hold a line that a *strong* template (three or
more literal characters) matches — a header, a labelled line. Change a label, a column
or a unit in the code and the quote no longer matches: the test fails until the page
quotes what the program prints now. A line ``…`` marks lines left out.
"""

from __future__ import annotations

import ast
import itertools
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvhandoff.lab.doccheck.pages import Fence, Problem, fences

MARKER = "output-of"
ELISION = ("…", "...")
_STRONG_CHARS = 3  # literal non-space characters that make a template strong
_MIN_CELLS = 3  # a tuple of fewer strings is not taken for a table header
_MAX_VARIANTS = 16  # variants one string expression may make (choices multiply)


_ANY = "\x00?"  # one character of a field's value (a glob's ``?``)
_STAR = "\x00*"  # the rest of it, possibly empty (a glob's ``*``)


@dataclass(frozen=True, slots=True)
class Template:
    """One line a program can print; ``strong``: enough literal text to identify the
    line, not just its shape. A line template is a glob over the line with its
    whitespace runs made single spaces (matched in linear time: a regex with a dozen
    lazy fields backtracks exponentially on a line it does not match); a table's header,
    rule and rows are regexes without nested repetition."""

    strong: bool
    glob: tuple[str, ...] = ()
    regex: re.Pattern[str] | None = None

    def matches(self, line: str) -> bool:
        if self.regex is not None:
            return self.regex.fullmatch(line) is not None
        return _glob(self.glob, " ".join(line.split()))


def _glob(items: Sequence[str], text: str) -> bool:
    """Whether ``text`` is ``items`` (characters, :data:`_ANY`, :data:`_STAR`): the
    iterative wildcard match, backtracking only to the last star."""
    i = j = 0
    star, mark = -1, 0
    while j < len(text):
        if i < len(items) and items[i] in (_ANY, text[j]):
            i, j = i + 1, j + 1
        elif i < len(items) and items[i] == _STAR:
            star, mark, i = i, j, i + 1
        elif star >= 0:
            i, mark = star + 1, mark + 1
            j = mark
        else:
            return False
    return all(item == _STAR for item in items[i:])


@dataclass(frozen=True, slots=True)
class _Field:
    padded: bool  # has a width: prints at least one character


_Part = str | _Field


def templates(source: str) -> list[Template]:
    """Every line template of a Python module's source."""
    tree = ast.parse(source)
    inner = {id(n) for j in ast.walk(tree) if isinstance(j, ast.JoinedStr)
             for v in j.values
             for n in (v, *(ast.walk(v.format_spec) if isinstance(v, ast.FormattedValue)
                            and v.format_spec else ()))}  # parts of an f-string, not lines
    inner |= {id(side) for b in ast.walk(tree) if isinstance(b, ast.BinOp)
              and isinstance(b.op, ast.Add) for side in (b.left, b.right)}  # nor of a "+"
    out: list[Template] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.List | ast.Tuple):
            out += _table(node)
        variants = _parts(node) if isinstance(node, ast.Constant | ast.JoinedStr | ast.BinOp) \
            and id(node) not in inner else None
        for parts in variants or ():
            out += [t for line in _lines(parts) if (t := _template(line)) is not None]
    return out


def _parts(node: ast.expr) -> list[list[_Part]] | None:
    """A string expression as its variants of literal text and fields (an f-string
    field ``{'met' if ok else 'NOT met'}`` makes one variant per branch); ``None`` when
    it is not a string expression."""
    if isinstance(node, ast.Constant):
        return [[node.value]] if isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr):
        return _product([_value_part(v) for v in node.values])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _parts(node.left), _parts(node.right)
        if left is None and right is None:
            return None
        pairs = [(a, b) for a in left or [[_Field(False)]] for b in right or [[_Field(False)]]]
        return [a + b for a, b in pairs] if len(pairs) <= _MAX_VARIANTS else [[_Field(False)]]
    if isinstance(node, ast.IfExp):  # ("met" if ok else "NOT met")
        a, b = _parts(node.body), _parts(node.orelse)
        return a + b if a is not None and b is not None else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):  # "-" * 64
        text, times = node.left, node.right
        if isinstance(text, ast.Constant) and isinstance(times, ast.Constant) \
                and isinstance(text.value, str) and isinstance(times.value, int):
            return [[text.value * times.value]]
    return None


def _product(choices: Sequence[Sequence[_Part]]) -> list[list[_Part]]:
    """Every sequence taking one part from each choice; past :data:`_MAX_VARIANTS`,
    each choice of several becomes a plain field."""
    if math.prod(len(c) for c in choices) > _MAX_VARIANTS:
        choices = [c if len(c) == 1 else [_Field(False)] for c in choices]
    return [list(p) for p in itertools.product(*choices)]


def _value_part(v: ast.expr) -> list[_Part]:
    """One f-string value: literal text, the branches of a constant choice, or a field."""
    if isinstance(v, ast.Constant):
        return [str(v.value)]
    assert isinstance(v, ast.FormattedValue)
    spec = v.format_spec
    spec_text = "".join(str(s.value) for s in spec.values if isinstance(s, ast.Constant)) \
        if isinstance(spec, ast.JoinedStr) else ""
    constant_spec = spec is None or (isinstance(spec, ast.JoinedStr) and all(
        isinstance(s, ast.Constant) for s in spec.values))
    branches = _branches(v.value)
    if branches is not None and constant_spec and v.conversion == -1:
        return [format(b, spec_text) for b in branches]
    return [_Field(padded=bool(re.search(r"\d", spec_text.split(".")[0])))]


def _branches(node: ast.expr) -> list[object] | None:
    """The values a constant, or a conditional between constants, can take."""
    if isinstance(node, ast.Constant):
        return [node.value]
    if isinstance(node, ast.IfExp):
        a, b = _branches(node.body), _branches(node.orelse)
        return a + b if a is not None and b is not None else None
    return None


def _lines(parts: Sequence[_Part]) -> Iterator[list[_Part]]:
    """Split at the newlines inside literal text: one template per printed line."""
    line: list[_Part] = []
    for p in parts:
        if isinstance(p, _Field):
            line.append(p)
            continue
        first, *rest = p.split("\n")
        line.append(first)
        for piece in rest:
            yield line
            line = [piece]
    yield line


def _template(parts: Sequence[_Part]) -> Template | None:
    literal = sum(len(p.replace(" ", "")) for p in parts if isinstance(p, str))
    fields = sum(isinstance(p, _Field) for p in parts)
    if literal < _STRONG_CHARS and fields < 3:
        return None  # too little to tell one line from another
    items: list[str] = []
    for p in parts:
        if isinstance(p, _Field):
            items += [_ANY, _STAR] if p.padded else [_STAR]
        else:
            for ch in re.sub(r"\s+", " ", p):
                if not (ch == " " and items and items[-1] == " "):  # one space per run
                    items.append(ch)
    while items and items[0] == " ":  # the line is compared stripped
        items.pop(0)
    while items and items[-1] == " ":
        items.pop()
    return Template(strong=literal >= _STRONG_CHARS, glob=tuple(items))


def _table(node: ast.List | ast.Tuple) -> list[Template]:
    cells = [e.value for e in node.elts if isinstance(e, ast.Constant)]
    if len(cells) < _MIN_CELLS or len(cells) != len(node.elts) \
            or not all(isinstance(c, str) for c in cells):
        return []
    n = len(cells)
    header = r"\s*\|\s*".join(re.escape(str(c)) for c in cells)
    return [Template(strong=True, regex=re.compile(rf"\s*{header}\s*")),
            Template(strong=False, regex=re.compile(rf"\s*-+(?:\+-+){{{n - 1}}}\s*")),
            Template(strong=False, regex=re.compile(rf"[^|]*(?:\|[^|]*){{{n - 1}}}"))]


def check_quote(fence: Fence, found: Sequence[Template], page: str) -> list[Problem]:
    """The lines of ``fence`` that no template of ``found`` prints, and a quote with no
    line a strong template vouches for."""
    problems = []
    strong = False
    for i, line in enumerate(fence.body):
        if not line.strip() or line.strip() in ELISION:
            continue
        hits = [t for t in found if t.matches(line)]
        if not hits:
            problems.append(Problem(page, fence.line + i,
                                    f"the program no longer prints this line: {line.strip()!r}"))
        strong = strong or any(t.strong for t in hits)
    if not strong and not problems:
        problems.append(Problem(page, fence.line, "no line of this quote is identified by a "
                                                  "label or header the program prints (its "
                                                  "lines have only the shape of table rows)"))
    return problems


def check_page(root: Path, page: Path) -> list[Problem]:
    """Every ``text`` fence of ``page`` is a marked quote, and every quote is true."""
    name = str(page.resolve().relative_to(root.resolve()))
    problems = []
    for f in fences(page.read_text()):
        if f.marker is None:
            if f.info == "text":
                problems.append(Problem(name, f.line - 1, "a text block is quoted program "
                                        f"output: mark it <!-- {MARKER}: path/to/source.py -->"))
            continue
        key, value = f.marker
        if key != MARKER:
            continue
        found: list[Template] = []
        for src in (s.strip() for s in value.split(",")):
            if not (root / src).is_file():
                problems.append(Problem(name, f.line - 1, f"{MARKER}: no such file {src}"))
                continue
            try:
                found += templates((root / src).read_text())
            except SyntaxError as e:
                problems.append(Problem(name, f.line - 1, f"{MARKER}: cannot parse {src}: {e}"))
        if found:
            problems += check_quote(f, found, name)
    return problems
