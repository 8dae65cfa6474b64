"""One optional hook an adapter calls at a handoff's milestones, for test rigs and demos.

Product code carries no test logic: an adapter calls a :class:`HandoffHook` (none by
default) when prefill is about to send a request's items, when decode's have landed, and
with each successful handoff's figures. A rig that wants digests of the moved bytes or
per-phase timings (``kvhandoff.lab.testing``) supplies one, named in the engine's own
configuration as ``"module:factory"`` and loaded by :func:`load_hook`; the factory is
called with that configuration (so the hook reads its own keys from it).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Protocol, cast

from kvhandoff.layout import Layout
from kvhandoff.observe.figures import Figures

__all__ = ["HandoffHook", "load_hook"]

Lists = Mapping[str, Sequence[int]]
"""Per component name, the items (blocks, slots, rows) a request moves on this rank."""


class HandoffHook(Protocol):
    """Called on the engine's thread; must not raise (an error is the caller's to log)."""

    def sending(self, request_id: str, layout: Layout, lists: Lists) -> None:
        """Prefill: these items are about to be sent (their bytes are final)."""

    def landed(self, request_id: str, layout: Layout, lists: Lists) -> None:
        """Decode: these items landed (the handoff succeeded)."""

    def finished(self, request_id: str, figures: Figures) -> None:
        """Either role: a handoff ended (``figures.outcome`` says how)."""


def load_hook(spec: str, config: Mapping[str, object]) -> HandoffHook:
    """The hook ``spec`` names (``"package.module:factory"``), built by calling the
    factory with ``config``. Raises ``ValueError`` naming what is wrong with ``spec``."""
    module, sep, attr = spec.partition(":")
    if not (module and sep and attr):
        raise ValueError(f"hook {spec!r} is not 'package.module:factory'")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"hook {spec!r} cannot be loaded: {e}") from e
    return cast(HandoffHook, factory(config))
