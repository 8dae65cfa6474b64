"""No import circle inside ``kvhandoff/session/``.

The graph is read from the source with :mod:`ast`, never by importing it, and counts
every import statement anywhere in a module: at the top, inside a function, and under
``if TYPE_CHECKING:``. A type-only import is still a dependency (mypy follows it, and a
reader of either file must read the other), and it is how the old
``agent ⇄ sender ⇄ receiver`` circle hid from the interpreter.

``from kvhandoff.session import x`` is an edge to the submodule ``x`` when one exists,
else to the package's ``__init__``; the implicit import of a parent package is not an
edge (every submodule would otherwise sit in a circle with ``__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvhandoff.session

PACKAGE = "kvhandoff.session"
ROOT = Path(kvhandoff.session.__file__).parent


def _module_name(path: Path) -> str:
    return PACKAGE if path.name == "__init__.py" else f"{PACKAGE}.{path.stem}"


def _imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """The package's modules that ``tree`` imports, anywhere in it."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == PACKAGE:
                for a in node.names:
                    sub = f"{PACKAGE}.{a.name}"
                    out.add(sub if sub in modules else PACKAGE)
            elif node.module in modules:
                out.add(node.module)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module name → the package's modules it imports (no self-edges)."""
    files = {_module_name(p): p for p in sorted(root.glob("*.py"))}
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = _imports(tree, set(files)) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None when the graph is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found is not None:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found is not None:
                return found
    return None


def test_session_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle in kvhandoff/session: " + " -> ".join(
        c.removeprefix(f"{PACKAGE}.") for c in cycle or ())


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert graph[f"{PACKAGE}.status"] == set()  # a pure leaf
    assert f"{PACKAGE}.status" in graph[f"{PACKAGE}.sender"]
    assert f"{PACKAGE}.agent" in graph[PACKAGE]


@pytest.mark.parametrize(("source", "edges"), [
    ("import kvhandoff.session.b", {"b"}),
    ("from kvhandoff.session.b import x", {"b"}),
    ("from kvhandoff.session import b, x", {"b", "__init__"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvhandoff.session.b import x",
     {"b"}),
    ("def f():\n    from kvhandoff.session.b import x", {"b"}),
    ("from kvhandoff.protocol import x\nimport os", set()),
])
def test_every_kind_of_import_is_an_edge(tmp_path: Path, source: str, edges: set[str]) -> None:
    for name in ("__init__", "a", "b"):
        (tmp_path / f"{name}.py").write_text("")
    (tmp_path / "a.py").write_text(source)
    got = import_graph(tmp_path)[f"{PACKAGE}.a"]
    assert got == {PACKAGE if e == "__init__" else f"{PACKAGE}.{e}" for e in edges}


def test_a_cycle_is_named() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
