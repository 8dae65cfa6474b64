"""Where the SGLang lab's interpreter is, and the environment its processes run in.

SGLang runs from its own virtualenv (``make sglang-venv``; SGLang pins its own torch
and transformers, so it cannot share ``.venv``). Every process the lab starts there gets
:func:`lab_env`: this checkout first on ``PYTHONPATH`` (so ``kvhandoff`` is the code
under test, whatever the venv has installed), the lab's ``sitecustomize`` with the shims
named, the CPU engine switch, an explicit SGLang plugin whitelist, and no network.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from kvhandoff.lab.sglang.shims import ENV as SHIMS_ENV
from kvhandoff.lab.sglang.shims import parse as parse_shims

__all__ = ["BASE_SHIMS", "NO_PLUGINS", "PLUGINS_ENV", "REPO_ROOT", "SITE_DIR", "lab_env",
           "plugins_for", "sglang_python", "venv_hint"]

REPO_ROOT = Path(__file__).resolve().parents[3]
SITE_DIR = Path(__file__).resolve().parent / "site"
"""The directory holding the lab's ``sitecustomize.py``."""

BASE_SHIMS: tuple[str, ...] = ("standins", "mooncake_cpu")
"""Shims every SGLang process of the lab gets; models add theirs."""

PLUGINS_ENV = "SGLANG_PLUGINS"
NO_PLUGINS = ","
"""An ``SGLANG_PLUGINS`` value that loads no plugin (an empty one loads them all)."""

PLUGIN_BACKENDS: Mapping[str, str] = {"kvhandoff": "kvhandoff"}
"""Transfer backend → the ``sglang.srt.plugins`` entry point that provides it."""


def sglang_python() -> Path:
    """The interpreter that has SGLang: ``$KVHANDOFF_SGLANG_PYTHON``, else the
    repository's ``.venv-sglang/bin/python`` (``make sglang-venv``)."""
    env = os.environ.get("KVHANDOFF_SGLANG_PYTHON")
    return Path(env) if env else REPO_ROOT / ".venv-sglang" / "bin" / "python"


def venv_hint(python: Path) -> str:
    """What to run when ``python`` is missing."""
    return f"{python} is missing: run `make sglang-venv` (make test does)"


def plugins_for(backend: str) -> str:
    """The ``SGLANG_PLUGINS`` value for servers that use transfer ``backend``.

    SGLang 0.5.23 reads the variable as a whitelist of ``sglang.srt.plugins`` entry
    points, but only when it is non-empty (``sglang/srt/plugins/__init__.py``:
    ``if allowed_str:``): unset *or empty*, every installed plugin loads, so a plugin
    that is stale or half-installed in the venv (one that fails only logs) can break a
    process that never asked for it. A value naming no plugin (``","``) loads none. So
    the lab always sets it: ``","`` for SGLang's own backends, the plugin's name for a
    backend a plugin provides (``kvhandoff``).
    """
    return PLUGIN_BACKENDS.get(backend, NO_PLUGINS)


def lab_env(*, shims: Iterable[str] = (), backend: str = "",
            extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of an SGLang process the lab starts: the current one plus the
    site directory and this checkout on ``PYTHONPATH``, ``BASE_SHIMS`` and ``shims``,
    ``SGLANG_PLUGINS`` for ``backend`` (see :func:`plugins_for`), the CPU engine, offline
    Hugging Face, unbuffered output; then ``extra``."""
    names = parse_shims(",".join(dict.fromkeys((*BASE_SHIMS, *shims))))
    path = [str(SITE_DIR), str(REPO_ROOT)]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        SHIMS_ENV: ",".join(names),
        PLUGINS_ENV: plugins_for(backend),
        "SGLANG_USE_CPU_ENGINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra or {})
    return env
