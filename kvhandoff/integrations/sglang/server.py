"""kvhandoff's registry, hosted by SGLang's bootstrap server (one per prefill deployment).

SGLang starts one HTTP bootstrap server per prefill deployment, and routers and launchers
know its address (``--disaggregation-bootstrap-port``). kvhandoff's prefill agents
register there too: its registry (:mod:`kvhandoff.bootstrap.server`, with every rule and
bound it enforces) is mounted as a sub-application under :data:`PREFIX`, beside SGLang's
own routes, so a deployment runs no second server and opens no second port.

With a deployment secret (``KVHANDOFF_SECRET_FILE``) registering is signed, as with
``kvhandoff bootstrap``. Without one, an address other than loopback is logged as a risk
(SGLang's own registry is unauthenticated there too).
"""

from __future__ import annotations

import ipaddress
import logging

from aiohttp import web

from kvhandoff.integrations import SessionConfig, registry_app

__all__ = ["PREFIX", "mount_registry"]

PREFIX = "/kvhandoff"
"""Where kvhandoff's registry lives on SGLang's bootstrap server."""

log = logging.getLogger("kvhandoff.integrations.sglang")


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def mount_registry(app: web.Application, config: SessionConfig, *, host: str) -> None:
    """Add kvhandoff's registry to SGLang's bootstrap ``app`` (before it starts),
    signed with ``config``'s deployment secret when there is one."""
    if not config.secret_file and not _loopback(host):
        log.warning("kvhandoff: the bootstrap server on %s hosts kvhandoff's registry "
                    "without a deployment secret: anyone who reaches it can replace a "
                    "prefill rank (set KVHANDOFF_SECRET_FILE on every server)", host)
    app.add_subapp(PREFIX, registry_app(config))
