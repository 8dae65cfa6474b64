"""A prefill rank's registration with the bootstrap server, taking over a dead rank's slot.

:func:`register_rank` registers with bounded retries and backoff. When the server
refuses because the slot is held by a record that differs only in its control endpoint
(the same rank, restarted), that endpoint is probed by heartbeat: a silent one is a
crashed process, whose record is removed before a second try; one that answers is a
live rank configured as this one, and registration fails, saying so. Blocking; the
agent calls it once, while starting, and :func:`deregister_rank` once, while closing;
a :class:`Registration` pairs the two, for the record :func:`prefill_record` builds.

Unless the rank runs insecure, every request is signed with the deployment secret's
bootstrap key (:func:`bootstrap_key`); the takeover of a dead rank's slot then
works as before, since the server lets any holder of the secret remove a rank that names
its registered endpoint (the ownership rule in :mod:`kvhandoff.bootstrap.server`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvhandoff.bootstrap.client import (
    BootstrapError,
    BootstrapRejected,
    RankRecord,
    RegistrationConflict,
    deregister,
    register,
)
from kvhandoff.bootstrap.client import RankId as BootstrapRankId
from kvhandoff.layout import Layout
from kvhandoff.observe.report import metrics_url
from kvhandoff.secret import PURPOSE_BOOTSTRAP, SecretError
from kvhandoff.session.config import SessionConfig
from kvhandoff.session.errors import BootstrapFailed

log = logging.getLogger("kvhandoff.session.rank.agent")  # the agent's voice: one logger per agent

Probe = Callable[[str, float], bool]  # does this control endpoint answer within the timeout?


def prefill_record(config: SessionConfig, layout: Layout, *, dp_rank: int, dp_size: int,
                   control_endpoint: str, transport: str) -> RankRecord:
    """The record a prefill rank registers. Beyond the rank it publishes where its
    process serves its metrics, when it does (for ``kvhandoff status``)."""
    url = metrics_url(config.dial_host)
    return RankRecord(instance=config.instance, dp_size=dp_size, dp_rank=dp_rank,
                      tp_size=layout.tp_size, tp_rank=layout.tp_rank, pp_size=layout.pp_size,
                      pp_rank=layout.pp_rank, control_endpoint=control_endpoint,
                      transport=transport, model_signature=layout.model_signature,
                      metadata={"metrics": url} if url else {})


def register_rank(url: str, rec: RankRecord, *, config: SessionConfig, probe: Probe,
                  what: str) -> None:
    """Register ``rec`` (``what``: the rank, for messages) at the bootstrap server
    ``url``; raises :class:`BootstrapFailed` naming why it cannot."""
    try:
        key = bootstrap_key(config)
    except SecretError as e:
        raise BootstrapFailed(f"{what} could not register: {e}") from e
    for attempt in range(2):  # a second try only after removing a dead rank's record
        try:
            register(url, rec, retries=config.register_retries, backoff=0.2,
                     max_backoff=4.0, timeout=min(5.0, config.bootstrap_timeout), key=key)
            return
        except RegistrationConflict as e:
            stale = _stale_endpoint(e)
            if attempt or stale is None:
                raise BootstrapFailed(f"{what} could not register: {e}") from e
            if probe(stale, min(2.0, config.heartbeat_timeout)):
                raise BootstrapFailed(
                    f"{what} could not register: the slot is held by a live rank at "
                    f"{stale} (two processes configured as the same rank?)") from e
            log.warning("%s: replacing the registration of a dead rank at %s", what, stale)
            try:
                deregister(url, BootstrapRankId(instance=rec.instance, dp_rank=rec.dp_rank,
                                                tp_rank=rec.tp_rank, pp_rank=rec.pp_rank,
                                                control_endpoint=stale), retries=1,
                           key=key)
            except BootstrapError as e2:
                raise BootstrapFailed(f"{what} could not remove the dead rank's "
                                      f"registration at {stale}: {e2}") from e2
        except BootstrapRejected as e:
            hint = (" (the server requires signed registrations: run with the deployment "
                    "secret, not insecure)" if e.status == 401 and key is None else
                    " (is KVHANDOFF_SECRET_FILE the same as the server's?)"
                    if e.status == 401 else "")
            raise BootstrapFailed(f"{what} could not register: {e}{hint}") from e
        except BootstrapError as e:
            raise BootstrapFailed(f"{what} could not register: {e}") from e


def deregister_rank(url: str, rec: RankRecord, *, config: SessionConfig) -> None:
    """Remove ``rec``'s registration (signed when ``config`` has a secret), conditional
    on its endpoint still being the registered one. Raises :class:`BootstrapError` (the
    caller, closing, only logs it); a secret file that cannot be read is one too."""
    try:
        key = bootstrap_key(config)
    except SecretError as e:
        raise BootstrapRejected(f"deregister {rec.where()}: {e}", status=None) from e
    deregister(url, rec, retries=1, timeout=2.0, key=key)


class Registration:
    """A rank's registration at the bootstrap server ``url``: made by :meth:`make`,
    removed by :meth:`leave` at most once (a failure then is only logged)."""

    def __init__(self, url: str, rec: RankRecord, *, config: SessionConfig) -> None:
        self._url, self._config = url, config
        self._rec: RankRecord | None = rec

    @classmethod
    def make(cls, url: str, rec: RankRecord, *, config: SessionConfig, probe: Probe,
             what: str) -> Registration:
        register_rank(url, rec, config=config, probe=probe, what=what)
        return cls(url, rec, config=config)

    def leave(self) -> None:
        rec, self._rec = self._rec, None
        if rec is not None:
            try:
                deregister_rank(self._url, rec, config=self._config)
            except BootstrapError as e:
                log.warning("deregistering %s failed: %s", rec.where(), e)


def bootstrap_key(config: SessionConfig) -> bytes | None:
    """The key that signs bootstrap requests: derived from ``config``'s deployment secret
    (:meth:`~kvhandoff.session.config.SessionConfig.secret`), or None when it runs
    insecure. Raises :class:`SecretError` for a file it cannot use."""
    secret = config.secret()
    return None if secret is None else secret.key(PURPOSE_BOOTSTRAP)


def _stale_endpoint(e: RegistrationConflict) -> str | None:
    """The registered control endpoint, when it is the only thing the refused record
    disagrees on: the slot's previous holder (maybe a crashed process)."""
    fields = {c.field for c in e.conflicts}
    if fields != {"control_endpoint"}:
        return None
    old = e.conflicts[0].existing
    return old if isinstance(old, str) else None
