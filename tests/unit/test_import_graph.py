"""The floor plan, read from the source: the library below the lab, no circle anywhere.

The graph is read with :mod:`ast`, never by importing, and counts every import statement
anywhere in a module: at the top, inside a function, and under ``if TYPE_CHECKING:``. A
type-only import is still a dependency (mypy follows it, and a reader of either file must
read the other). ``from kvhandoff.x import y`` is an edge to the submodule ``x.y`` when one
exists, else to ``x``; the implicit import of a parent package is not an edge (every
submodule would otherwise sit in a circle with its ``__init__``).

Three rules hold:

* no circle between modules, anywhere in the package;
* no circle between rooms: a room is a top-level module or sub-package (``plan``,
  ``layout``), and inside ``session`` and ``transport`` each wing is a room of its own
  (``session.request``, ``transport.tcp``). Package faces (``__init__``) only re-export and
  are left out of this graph, so the order of the rooms is the order of the floors;
* the library never imports the lab (``kvhandoff.lab``).

And ``import kvhandoff, kvhandoff.session, kvhandoff.transport`` (and the other faces)
loads no optional dependency — no torch, transformers, matplotlib or aiohttp, each only
in an extra — and a part that needs a missing extra says which one to install (both
checked in a fresh interpreter).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kvhandoff

PACKAGE = "kvhandoff"
ROOT = Path(kvhandoff.__file__).parent
LAB = f"{PACKAGE}.lab"
WINGED = ("session", "transport")  # rooms whose sub-packages are rooms of their own


def _module_names(root: Path, package: str) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([package, *parts])] = path
    return out


def _imports(tree: ast.Module, modules: set[str], package: str) -> set[str]:
    """The package's modules that ``tree`` imports, anywhere in it."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                name = a.name
                while name and name not in modules:  # import a.b.c of a module a.b
                    name = name.rpartition(".")[0]
                if name.startswith(package):
                    out.add(name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module not in modules:
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return out


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module name → the package's modules it imports (no self-edges)."""
    files = _module_names(root, package)
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = _imports(tree, set(files), package) - {name}
    return graph


def _faces(root: Path = ROOT, package: str = PACKAGE) -> set[str]:
    return {name for name, path in _module_names(root, package).items()
            if path.name == "__init__.py"}


def room_of(module: str, package: str = PACKAGE) -> str:
    parts = module.split(".")
    depth = 3 if len(parts) > 2 and parts[1] in WINGED else 2
    return ".".join(parts[:depth])


def room_graph(graph: dict[str, set[str]], faces: set[str]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for module, deps in graph.items():
        if module in faces:
            continue
        here = room_of(module)
        rooms.setdefault(here, set())
        rooms[here] |= {room_of(d) for d in deps if d not in faces} - {here}
    return rooms


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle as ``[a, b, ..., a]``, or None when the graph is acyclic."""
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


def _named(cycle: list[str] | None) -> str:
    return " -> ".join(c.removeprefix(f"{PACKAGE}.") for c in cycle or ())


def test_no_module_imports_in_a_circle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + _named(cycle)


def test_no_room_imports_in_a_circle() -> None:
    cycle = find_cycle(room_graph(import_graph(), _faces()))
    assert cycle is None, "rooms in a circle (an arrow back up): " + _named(cycle)


def test_the_library_never_imports_the_lab() -> None:
    bad = sorted(f"{m} -> {d}" for m, deps in import_graph().items()
                 if not (m == LAB or m.startswith(LAB + "."))
                 for d in deps if d == LAB or d.startswith(LAB + "."))
    assert bad == [], "the library imports the lab: " + "; ".join(bad)


OPTIONAL = ("torch", "transformers", "matplotlib", "aiohttp")
"""Packages only an extra (or the engine hosting an adapter) installs."""


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, timeout=120)


def test_the_faces_load_no_optional_dependency() -> None:
    out = _fresh("import sys; import kvhandoff, kvhandoff.session, kvhandoff.transport, "
                 "kvhandoff.plan, kvhandoff.bootstrap, kvhandoff.observe, "
                 "kvhandoff.integrations; "
                 f"print(sorted(m for m in {OPTIONAL!r} if m in sys.modules))")
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize(("blocked", "module", "extra"), [
    ("aiohttp", "kvhandoff.bootstrap.server", "bootstrap"),
    ("transformers", "kvhandoff.lab.engine", "engine"),
])
def test_a_missing_extra_is_named(blocked: str, module: str, extra: str) -> None:
    """With ``blocked`` made unimportable, importing ``module`` fails with MissingExtra
    naming the extra to install (not a bare ModuleNotFoundError)."""
    out = _fresh(f"import sys, importlib; sys.modules[{blocked!r}] = None\n"
                 "from kvhandoff.errors import MissingExtra\n"
                 f"try:\n    importlib.import_module({module!r})\n"
                 "except MissingExtra as e:\n    print(e)\n")
    assert out.returncode == 0, out.stderr
    assert f"pip install 'kvhandoff[{extra}]'" in out.stdout and blocked in out.stdout, out.stdout


def test_drawing_a_trace_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    out = _fresh("import sys; sys.modules['matplotlib'] = None\n"
                 "from kvhandoff.errors import MissingExtra\n"
                 "from kvhandoff.observe.trace import render\n"
                 f"try:\n    render([], {str(tmp_path / 'x.png')!r})\n"
                 "except MissingExtra as e:\n    print(e)\n")
    assert out.returncode == 0, out.stderr
    assert "pip install 'kvhandoff[plot]'" in out.stdout, out.stdout


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert graph[f"{PACKAGE}.state_types"] == set()  # a pure leaf
    assert f"{PACKAGE}.session.request.status" in graph[f"{PACKAGE}.session.request.sender"]
    assert f"{PACKAGE}.lab.cli" in graph
    rooms = room_graph(graph, _faces())
    assert f"{PACKAGE}.plan" in rooms[f"{PACKAGE}.session.request"]
    assert f"{PACKAGE}.session.request" in rooms[f"{PACKAGE}.lab"]


@pytest.mark.parametrize(("source", "edges"), [
    ("import kvhandoff.pkg.b", {"pkg.b"}),
    ("import kvhandoff.pkg.b.attr", {"pkg.b"}),
    ("from kvhandoff.pkg.b import x", {"pkg.b"}),
    ("from kvhandoff.pkg import b, x", {"pkg.b", "pkg"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvhandoff.pkg.b import x",
     {"pkg.b"}),
    ("def f():\n    from kvhandoff.pkg.b import x", {"pkg.b"}),
    ("from kvhandoff.other import x\nimport os", set()),
])
def test_every_kind_of_import_is_an_edge(tmp_path: Path, source: str, edges: set[str]) -> None:
    (tmp_path / "pkg").mkdir()
    for name in ("__init__", "a", "b"):
        (tmp_path / "pkg" / f"{name}.py").write_text("")
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text(source)
    got = import_graph(tmp_path)[f"{PACKAGE}.pkg.a"]
    assert got == {f"{PACKAGE}.{e}" for e in edges}


def test_a_cycle_is_named() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_rooms_follow_the_wings() -> None:
    assert room_of("kvhandoff.session.request.sender") == "kvhandoff.session.request"
    assert room_of("kvhandoff.session.config") == "kvhandoff.session.config"
    assert room_of("kvhandoff.transport.tcp.client") == "kvhandoff.transport.tcp"
    assert room_of("kvhandoff.plan.build") == "kvhandoff.plan"
    assert room_of("kvhandoff.lab.engine.run") == "kvhandoff.lab"
