"""No function of the library or the lab is over 60 lines (the house limit, issue #29).

An AST walk over every module of ``kvhandoff/``: a function's length is from its ``def``
(decorators excluded) to its last line, docstring included. A long function is split,
or a table replaces a chain of branches; nothing is exempt unless listed in ``ALLOWED``
with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvhandoff

ROOT = Path(kvhandoff.__file__).parent
LIMIT = 60

#: ``module path:function`` -> why it may be longer (keep this short)
ALLOWED: dict[str, str] = {
    "kvhandoff/lab/testing/transport.py:entries":
        "test data: the catalogue of plan kinds the conformance suite moves, one short "
        "branch per kind",
}


def long_functions(root: Path, limit: int) -> dict[str, int]:
    """``path:qualname`` -> lines, for every function under ``root`` over ``limit`` lines."""
    found: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > limit:
                    found[f"{path.relative_to(root.parent)}:{node.name}"] = n
    return found


def test_no_function_is_over_the_limit() -> None:
    over = {k: v for k, v in long_functions(ROOT, LIMIT).items() if k not in ALLOWED}
    assert over == {}, f"functions over {LIMIT} lines (split them): {over}"


def test_the_allow_list_names_only_long_functions() -> None:
    assert set(ALLOWED) <= set(long_functions(ROOT, LIMIT)), "stale ALLOWED entries"


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def long():\n{body}\n\ndef short():\n    pass\n")
    assert long_functions(tmp_path / "pkg", LIMIT) == {"pkg/m.py:long": LIMIT + 1}
