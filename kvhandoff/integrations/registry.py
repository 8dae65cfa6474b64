"""kvhandoff's registry as an application an engine's own HTTP server can host.

An engine that already runs a rendezvous server (SGLang's bootstrap server, one per
prefill deployment) mounts kvhandoff's registry in it (:func:`registry_app`), so prefill
agents register there and a deployment opens no second port. It is the registry of
``kvhandoff bootstrap`` (:mod:`kvhandoff.bootstrap.server`: every rule and bound it
enforces), signed with the deployment secret when there is one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvhandoff.session.config import SessionConfig

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["registry_app"]


def registry_app(config: SessionConfig) -> web.Application:
    """A fresh registry as an aiohttp application (to mount as a sub-application); with
    ``config.secret_file``, registering and deregistering must be signed with it."""
    from kvhandoff.bootstrap.server import make_app  # aiohttp: only where one is hosted
    from kvhandoff.secret import Secret

    return make_app(secret=Secret.load(config.secret_file) if config.secret_file else None)
