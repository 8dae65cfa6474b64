"""Run a function right after a named module has been imported (lab only).

The CPU shims patch SGLang classes the moment their module has run, in whichever
process imports it (the HTTP server, the scheduler and detokenizer children), without
importing SGLang early. ``when_imported("a.b", fn)`` calls ``fn(module)`` once, at the
end of ``a.b``'s first execution, or at once if it is already imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence

__all__ = ["when_imported"]

Hook = Callable[[types.ModuleType], None]


class _Loader(importlib.abc.Loader):
    """Wraps a module's real loader; runs the module's hooks after its body, once."""

    def __init__(self, inner: importlib.abc.Loader, hooks: dict[str, list[Hook]]) -> None:
        self.inner = inner
        self.hooks = hooks

    def __getattr__(self, name: str) -> object:
        # get_resource_reader, get_filename, is_package...: answered by the real loader
        return getattr(self.inner, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.inner.exec_module(module)
        for hook in self.hooks.pop(module.__name__, ()):
            hook(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds hooked modules through the other finders and wraps their loader."""

    def __init__(self) -> None:
        self.hooks: dict[str, list[Hook]] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                # the hooks stay registered until the module body has run: a spec that
                # is only looked at (importlib.util.find_spec) and never loaded keeps them
                spec.loader = _Loader(spec.loader, self.hooks)
                return spec
        return None  # not found: the import fails as it would without us


_FINDER = _Finder()


def when_imported(module: str, hook: Hook) -> None:
    """Call ``hook(module_object)`` after ``module`` is first imported in this process,
    or now if it already is. Exceptions from ``hook`` propagate into the import."""
    done = sys.modules.get(module)
    if done is not None:
        hook(done)
        return
    _FINDER.hooks.setdefault(module, []).append(hook)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
