"""SGLang's modules on a CPU host, for the SGLang backend's tests (lab only; no SGLang
import here).

SGLang 0.5.23 imports two packages a CPU host cannot install: ``torchvision`` (its wheels
link CUDA; SGLang reaches it through multimodal helpers every ``sglang.srt.configs``
import pulls in) and ``sgl_kernel`` (its CPU build is not published; memory pools import
one function of it). :func:`install` answers both imports with stand-ins whose every
*use* raises :class:`StandInCalled` naming the function: a code path that needs the real
package fails loudly instead of passing silently.

transformers would take a stand-in for an installed torchvision and read its version, so
its probe is made first, while torchvision is truly absent (the answer is cached).
Call :func:`install` before anything imports SGLang.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["PACKAGES", "StandInCalled", "install"]

PACKAGES = ("torchvision", "sgl_kernel")


class StandInCalled(NotImplementedError):
    """A function of a stand-in package was called: the real one is not installed here."""


class _Name:
    """A name read from a stand-in: deeper names read on; calling it raises."""

    __slots__ = ("_qualname",)

    def __init__(self, qualname: str) -> None:
        object.__setattr__(self, "_qualname", qualname)

    def __getattr__(self, name: str) -> _Name:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Name(f"{self._qualname}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise StandInCalled(f"{self._qualname} was called, but {self._qualname.split('.')[0]!r}"
                            f" is a CPU stand-in (no CPU build is installable here)")

    def __mro_entries__(self, bases: tuple[object, ...]) -> NoReturn:
        self()
        raise AssertionError  # unreachable: the call raised


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> _Name:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Name(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in PACKAGES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: names are made when read."""


def install() -> None:
    """Stand in for :data:`PACKAGES` in this process (idempotent)."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    from transformers.utils import import_utils  # probe torchvision while it is absent

    import_utils.is_torchvision_available()
    sys.meta_path.insert(0, _Finder())
