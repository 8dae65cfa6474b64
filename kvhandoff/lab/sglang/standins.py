"""Strict stand-ins for packages SGLang imports but a CPU host cannot have (lab only).

SGLang 0.5.23 imports two packages that have no CPU build on the package index:

* ``torchvision``: the PyPI wheels link CUDA and fail to import beside the CPU torch.
  SGLang reaches it through multimodal helpers that every ``sglang.srt.configs`` import
  pulls in (``multimodal/internvl_utils.py``), and never calls it for a text model.
* ``sgl_kernel``: SGLang's CPU kernels. The PyPI ``sgl-kernel`` / ``sglang-kernel``
  wheels are CUDA builds; the CPU build is not published. ``mem_cache`` imports
  ``copy_all_layer_kv_cache_cpu`` from it on CPU, used by retraction and HiCache only.

A stand-in lets those imports succeed and makes every *use* fail loudly: any name read
from a stand-in package (``torchvision.transforms.functional.resize``,
``sgl_kernel.copy_all_layer_kv_cache_cpu``) is a :class:`StandIn` whose call raises
:class:`StandInCalled` naming the function. A kernel SGLang skips therefore cannot hide
behind a green test: it ends the request with that error instead.

Installed only in processes the lab launches (:mod:`kvhandoff.lab.sglang.shims`, through
the lab's ``sitecustomize``), never by installing kvhandoff. No SGLang import here.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

__all__ = ["PACKAGES", "StandIn", "StandInCalled", "StandInFinder", "install", "uninstall"]

PACKAGES: tuple[str, ...] = ("torchvision", "sgl_kernel")
"""The top-level packages the lab stands in for in SGLang processes."""


class StandInCalled(NotImplementedError):
    """Code called a function of a stand-in package: the real one is not installed here."""


def _refuse(qualname: str) -> NoReturn:
    top = qualname.partition(".")[0]
    raise StandInCalled(
        f"{qualname} was called, but {top!r} is a CPU stand-in from the kvhandoff lab "
        f"(no CPU build of {top!r} is installable here): this code path needs the real "
        f"package and cannot run on this host")


class StandIn:
    """A name read from a stand-in package. Reading an attribute gives the deeper name
    (``InterpolationMode.BICUBIC``); calling it, or using it as a base class, raises
    :class:`StandInCalled`."""

    __slots__ = ("_qualname",)
    _qualname: str

    def __init__(self, qualname: str) -> None:
        object.__setattr__(self, "_qualname", qualname)

    def __getattr__(self, name: str) -> StandIn:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return StandIn(f"{self._qualname}.{name}")

    def __setattr__(self, name: str, value: object) -> None:
        _refuse(f"{self._qualname}.{name} = ...")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(self._qualname)

    def __mro_entries__(self, bases: tuple[object, ...]) -> NoReturn:
        _refuse(f"class (...{self._qualname}...)")

    def __repr__(self) -> str:
        return f"<CPU stand-in {self._qualname}>"


class _StandInModule(types.ModuleType):
    """A stand-in (sub)package: any missing attribute is a :class:`StandIn`."""

    def __getattr__(self, name: str) -> StandIn:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return StandIn(f"{self.__name__}.{name}")


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A ``sys.meta_path`` finder that answers every import under ``packages`` with a
    stand-in package, ahead of the real finders."""

    def __init__(self, packages: Iterable[str]) -> None:
        self.packages = frozenset(packages)

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in self.packages:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name, f"CPU stand-in for {spec.name} (kvhandoff lab)")
        module.__path__ = []  # a package, so that submodule imports come back here
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: every attribute is made on demand."""


def install(packages: Iterable[str] = PACKAGES) -> StandInFinder:
    """Put a :class:`StandInFinder` for ``packages`` first on ``sys.meta_path`` and return
    it. Refuses a package that is already imported (its real or earlier stand-in module
    would keep answering)."""
    names = frozenset(packages)
    loaded = sorted(n for n in sys.modules if n.partition(".")[0] in names)
    if loaded:
        raise RuntimeError(f"cannot stand in for modules already imported: {loaded}")
    finder = StandInFinder(names)
    sys.meta_path.insert(0, finder)
    return finder


def uninstall(finder: StandInFinder) -> None:
    """Undo :func:`install`: drop the finder and every module it made."""
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)
    for name in [n for n in sys.modules if n.partition(".")[0] in finder.packages]:
        del sys.modules[name]
