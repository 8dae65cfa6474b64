"""aiohttp, which only the bootstrap server (and a registry an adapter mounts) needs: the
``bootstrap`` extra installs it. Imported here, once, so that a missing install says
which extra to add instead of a bare ``ModuleNotFoundError``."""

from __future__ import annotations

from kvhandoff.errors import MissingExtra

try:
    from aiohttp import web
except ImportError as e:  # pragma: no cover - exercised in a subprocess by the unit test
    raise MissingExtra("aiohttp", extra="bootstrap",
                       needed_by="kvhandoff's bootstrap server") from e

__all__ = ["web"]
