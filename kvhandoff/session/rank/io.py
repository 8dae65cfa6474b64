"""A rank's I/O machinery: its transport, control channel and threads, opened together
and closed in order.

Threads (all named ``kvh-*``): the control I/O thread (messages, timers, heartbeats;
:mod:`~kvhandoff.session.control.channel`), the completion thread (deadlines and polling of
transfer handles, whose completions mostly arrive as done-callbacks on the transport's
own threads; :mod:`~kvhandoff.session.control.completion`) and ``config.workers`` worker
threads for blocking jobs (:meth:`RankIO.spawn`: bootstrap lookups, handshakes, checksum
checks), plus the transport's own.

Authentication: the deployment secret (``config.secret_file``, else the user's default
one, :meth:`~kvhandoff.session.config.SessionConfig.secret`) is loaded first (a
:class:`~kvhandoff.secret.SecretError` names what is wrong with the file, before
anything starts); the control channel signs and checks every message with the secret's
control key (:mod:`~kvhandoff.session.control.auth`) and the transport gets its data key.
Peers must hold the same secret. Only with ``config.insecure`` does the rank run with
none, speaking plain messages to anyone (a loud warning at start-up).

Lifecycle: construction opens everything or, failing, closes what it opened and raises.
The agent then closes in two steps, because its requests and decode peers sit in
between: :meth:`RankIO.stop` (threads and sockets) and :meth:`RankIO.close_transport`
(if owned). Both are idempotent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvhandoff.layout import Layout
from kvhandoff.observe.report import serve_process_metrics
from kvhandoff.secret import PURPOSE_CONTROL
from kvhandoff.session.config import SessionConfig
from kvhandoff.session.control.channel import (
    ControlChannel,
    FailureHandler,
    MessageHandler,
    TickHandler,
)
from kvhandoff.session.control.completion import Callback, Completions
from kvhandoff.transport.base import Handle, Transport
from kvhandoff.transport.registry import create_transport

log = logging.getLogger("kvhandoff.session.rank.agent")  # the agent's voice: one logger per agent


def open_transport(config: SessionConfig, **options: object) -> Transport:
    """A new ``config.transport`` for one rank, keyed by the deployment secret's data key
    (with no secret, by the endpoint token alone); ``options`` override
    ``config.transport_options``. The one way a rank's transport is made: the agent's own,
    and one an engine makes first because it must allocate memory from it."""
    return create_transport(config.transport, **{
        "data_secret": config.data_key(), **config.transport_options, **options})


class RankIO:
    """See the module docstring. The ``on_*`` handlers run on the control I/O thread."""

    def __init__(self, layout: Layout, config: SessionConfig, *, name: str,
                 transport: Transport | None, own_transport: bool, on_message: MessageHandler,
                 on_tick: TickHandler, on_undeliverable: FailureHandler,
                 on_unauthenticated: FailureHandler,
                 on_drained: Callable[[], None] | None = None) -> None:
        self._name = name
        self._owns_transport = own_transport or transport is None
        self._transport: Transport | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._completions: Completions | None = None
        self._control: ControlChannel | None = None
        cfg = config
        try:
            # first: a secret file that cannot be used stops the rank before anything starts
            secret = cfg.secret()
            key = None if secret is None else secret.key(PURPOSE_CONTROL)
            if cfg.metrics_port >= 0:
                serve_process_metrics(cfg.metrics_port, cfg.host)
            t = transport if transport is not None else open_transport(cfg)
            self._transport = t
            t.register(layout)
            self.transport_endpoint = t.endpoint()  # after registering: it may carry it
            self._pool = ThreadPoolExecutor(cfg.workers, thread_name_prefix=f"kvh-work-{name}")
            self._completions = Completions(t, timeout=cfg.transfer_timeout, name=name)
            self._control = ControlChannel(
                host=cfg.host, port=cfg.port, dial_host=cfg.dial_host, on_message=on_message,
                on_tick=on_tick, on_undeliverable=on_undeliverable, tick=cfg.tick, name=name,
                key=key, on_unauthenticated=on_unauthenticated, on_drained=on_drained,
                heartbeat_interval=cfg.heartbeat_interval,
                heartbeat_timeout=cfg.heartbeat_timeout)
        except BaseException:
            self.stop()
            self.close_transport()
            raise

    @property
    def transport(self) -> Transport:
        assert self._transport is not None
        return self._transport

    @property
    def control(self) -> ControlChannel:
        assert self._control is not None
        return self._control

    def track(self, handle: Handle, callback: Callback) -> None:
        assert self._completions is not None
        self._completions.track(handle, callback)

    def spawn(self, job: Callable[[], None]) -> None:
        """Run ``job`` on a worker thread; an exception it raises is logged. Dropped once
        the pool is shut down (closing)."""
        def run() -> None:
            try:
                job()
            except Exception:
                log.exception("agent %s: background job failed", self._name)
        if self._pool is None:
            return
        try:
            self._pool.submit(run)
        except RuntimeError:  # the pool is shut down: the agent is closing
            log.debug("agent %s closing; job dropped", self._name)

    def stop(self) -> None:
        """Stop the completion thread, the workers (joined) and the control channel."""
        if self._completions is not None:
            self._completions.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._control is not None:
            self._control.close()

    def close_transport(self) -> None:
        """Close the transport, if this rank owns it."""
        if self._transport is not None and self._owns_transport:
            self._owns_transport = False
            self._transport.close()
