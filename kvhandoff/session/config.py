"""The session layer's one frozen configuration, read once (defaults, then env, then code).

Every knob has a default that works on one host; each can be overridden by an
environment variable ``KVHANDOFF_<FIELD NAME IN CAPITALS>`` (e.g.
``KVHANDOFF_TRANSFER_TIMEOUT=120``) through :meth:`SessionConfig.from_env`, and by
keyword arguments, which win over the environment. Nothing else in the session layer
reads the environment; an :class:`~kvhandoff.session.rank.agent.Agent` built without a config
uses ``SessionConfig.from_env()``. A command line adds the timeouts as flags
(``--bootstrap-timeout`` …) with :func:`add_timeout_arguments` and turns what was given
into keyword overrides with :func:`timeout_overrides` (flag > environment > default).

Timeouts, in seconds (default in brackets), and what each bounds:

* ``bootstrap_timeout`` [30] — decode: from ``Receiver(...)`` until its TransferInits are sent
  (bootstrap lookup + handshakes). Prefill: registering with the bootstrap server.
* ``indices_timeout`` [300] — prefill: from ``Sender(...)`` until every decode rank's
  TransferInit (its destination indices) has arrived.
* ``lease`` [30] — prefill: from the last chunk handed over (prefill is done, its memory
  held only for decode) until every decode rank's TransferInit has arrived; then the
  request fails with ``LeaseExpired`` and its memory may be freed. A client that hangs up
  between the prefill and the decode hop costs prefill this long, not ``indices_timeout``.
* ``waiting_timeout`` [300] — decode: from sending TransferInit until the first chunk status
  (prefill may be queueing or computing a long prompt).
* ``transfer_timeout`` [60] — prefill: one chunk's writes; decode: the longest gap between two
  chunk statuses, and the wait for the aux row after the last one.
* ``release_timeout`` [30] — decode: after a failure, how long to wait for every prefill
  rank's AbortAck before declaring the destination pages reusable anyway (reported).
* ``heartbeat_interval`` [1] / ``heartbeat_timeout`` [5] — peers with live requests are pinged
  every interval; one silent for the timeout whose control link is down too (its process
  died or froze: libzmq's own heartbeats, which a busy peer still answers, went
  unanswered) is declared lost and its requests fail. One silent with its link up is
  busy: lost only after 12 timeouts (``liveness.book.BUSY_FACTOR``).

Observability (:mod:`kvhandoff.observe`): ``metrics`` [on] counts every finished request in
the process's Prometheus metrics; ``metrics_port`` (``KVHANDOFF_METRICS_PORT``)
serves the process's Prometheus metrics over HTTP (0: any free port; -1, the default: not
served, though they are still collected for a host to merge); ``trace``
(``KVHANDOFF_TRACE``) appends one JSON line per finished request to that file.

Transport: ``transport`` [auto] names it (``KVHANDOFF_TRANSPORT``): ``auto`` picks, per
peer, the fastest both sides can use (cma on one host, tcp or RDMA across hosts; see
:mod:`kvhandoff.transport.auto`); ``transport_options`` go to its constructor.

Threads inside an engine: ``switch_interval_us`` (``KVHANDOFF_SWITCH_INTERVAL_US``, 100 by
default) — an engine rank (:func:`~kvhandoff.integrations.rank.open_rank`) lowers the interpreter's
GIL switch interval to at most this; 0 leaves it alone (:mod:`kvhandoff.integrations.gil`).

Security: ``secret_file`` (``KVHANDOFF_SECRET_FILE``) names the deployment secret
(:mod:`kvhandoff.secret`); without one, the user's default secret is used (made on first
use, readable by this user only), so a deployment is closed to other users without any
configuration; ``insecure`` (``KVHANDOFF_INSECURE=1``) runs with no secret at all, and
says so loudly. :meth:`SessionConfig.secret` applies the rule; the file is read when it
is used, not here. Ranks sign their bootstrap requests and control messages with keys
derived from it, and key their transports' data-plane handshakes with another.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvhandoff.secret import PURPOSE_DATA, Secret, deployment_secret
from kvhandoff.transport.registry import DEFAULT as DEFAULT_TRANSPORT

ENV_PREFIX = "KVHANDOFF_"

_INSTANCE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")

TIMEOUT_FIELDS = ("bootstrap_timeout", "indices_timeout", "lease", "waiting_timeout",
                  "transfer_timeout", "release_timeout", "heartbeat_interval", "heartbeat_timeout")
"""The knobs in seconds, each a ``--flag`` of :func:`add_timeout_arguments`."""

_TIMEOUT_HELP = {
    "bootstrap_timeout": "decode: bootstrap lookup and handshakes; prefill: registering",
    "indices_timeout": "prefill: wait for every decode rank's destination indices",
    "lease": "prefill: once a request is computed, wait this long for decode to claim it",
    "waiting_timeout": "decode: wait from sending its indices to the first chunk",
    "transfer_timeout": "one chunk's writes; decode: longest gap between chunk statuses",
    "release_timeout": "decode, after a failure: wait for prefill's AbortAcks",
    "heartbeat_interval": "ping peers with live requests this often",
    "heartbeat_timeout": "a peer silent this long, its control link down, is declared lost",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionConfig:
    """Settings of one agent. Immutable; build with :meth:`from_env` or directly."""

    host: str = "127.0.0.1"  # control socket bind address
    advertise_host: str = ""  # address peers dial (default: host, or 127.0.0.1 for 0.0.0.0)
    port: int = 0  # control socket port; 0 = any free port
    transport: str = DEFAULT_TRANSPORT  # for create_transport; "auto": the best per peer
    transport_options: Mapping[str, Any] = field(default_factory=dict)
    instance: str = "default"  # prefill deployment name (bootstrap key); decode label
    bootstrap_timeout: float = 30.0
    indices_timeout: float = 300.0
    lease: float = 30.0
    waiting_timeout: float = 300.0
    transfer_timeout: float = 60.0
    release_timeout: float = 30.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    register_retries: int = 5  # prefill: bootstrap registration attempts after the first
    checksum: bool = False  # decode: ask prefill for per-component checksums and verify them
    in_band_status: bool = True  # decode: take chunk statuses in band when the transport can
    max_pending_inits: int = 4096  # prefill: TransferInits buffered before their Sender exists
    workers: int = 4  # threads for blocking jobs (lookups, handshakes, checksum checks)
    metrics: bool = True  # count this agent's requests in the process's metrics
    metrics_port: int = -1  # serve this process's Prometheus metrics here (0: any; -1: off)
    trace: str = ""  # append a JSON line per finished request to this file ("": off)
    secret_file: str = ""  # the deployment secret (kvhandoff.secret; "": the user's default)
    insecure: bool = False  # no deployment secret at all: anyone who reaches us is trusted
    switch_interval_us: float = 100.0  # engine ranks: the GIL switch interval, at most (0: keep)

    def __post_init__(self) -> None:
        problems = []
        for f in TIMEOUT_FIELDS:
            v = getattr(self, f)
            if not isinstance(v, int | float) or not v > 0:
                problems.append(f"{f} must be a positive number of seconds, got {v!r}")
        if self.heartbeat_timeout < self.heartbeat_interval:
            problems.append(f"heartbeat_timeout ({self.heartbeat_timeout}) must be at least "
                            f"heartbeat_interval ({self.heartbeat_interval})")
        if not 0 <= self.port < 65536:
            problems.append(f"port must be in 0..65535, got {self.port}")
        if not -1 <= self.metrics_port < 65536:
            problems.append(f"metrics_port must be in 0..65535 (or -1: off), got "
                            f"{self.metrics_port}")
        if self.register_retries < 0 or self.max_pending_inits < 1 or self.workers < 1:
            problems.append("register_retries must be >= 0, max_pending_inits and workers >= 1")
        if not _INSTANCE.match(self.instance):
            problems.append(f"instance {self.instance!r} must match {_INSTANCE.pattern}")
        if not (isinstance(self.switch_interval_us, int | float)
                and 0 <= self.switch_interval_us <= 1e6):
            problems.append(f"switch_interval_us must be 0 (keep the interpreter's) or up to "
                            f"1e6 microseconds, got {self.switch_interval_us!r}")
        if self.insecure and self.secret_file:
            problems.append(f"insecure and secret_file ({self.secret_file}) exclude each "
                            "other: choose one")
        if problems:
            raise ValueError("invalid session config: " + "; ".join(problems))

    @property
    def dial_host(self) -> str:
        """The address peers use to reach this agent's control socket."""
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "*", "") else self.host

    @property
    def tick(self) -> float:
        """How often timers run: fine enough for the shortest timeout, at most 50 ms."""
        return min(0.05, self.heartbeat_interval / 4, self.transfer_timeout / 8)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, /,
                 **overrides: Any) -> SessionConfig:
        """Defaults, then ``KVHANDOFF_*`` variables from ``env`` (default ``os.environ``),
        then ``overrides``. Raises ``ValueError`` naming a variable that does not parse,
        or the variables used when the result is invalid (e.g. a timeout of 0)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            try:
                values[f.name] = _parse(f.name, f.type, raw)
            except ValueError as e:
                raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: {e}") from None
        from_env = {k: env[ENV_PREFIX + k.upper()] for k in values if k not in overrides}
        values.update(overrides)
        try:
            return cls(**values)
        except ValueError as e:
            if not from_env:
                raise
            names = ", ".join(f"{ENV_PREFIX}{k.upper()}={v!r}" for k, v in from_env.items())
            raise ValueError(f"{e} (from the environment: {names})") from None

    def replace(self, **changes: Any) -> SessionConfig:
        return dataclasses.replace(self, **changes)

    def secret(self) -> Secret | None:
        """The deployment secret these settings name: ``secret_file``, else none when
        ``insecure``, else the user's default one (:func:`~kvhandoff.secret.deployment_secret`).
        Raises :class:`~kvhandoff.secret.SecretError` for a file it cannot use."""
        return deployment_secret(self.secret_file, insecure=self.insecure)

    def data_key(self) -> bytes | None:
        """The transports' ``data_secret``: the data-plane key of :meth:`secret`."""
        secret = self.secret()
        return None if secret is None else secret.key(PURPOSE_DATA)


def _parse(name: str, kind: object, raw: str) -> Any:
    text = str(kind)
    if name == "transport_options":
        value = json.loads(raw)
        if not isinstance(value, dict):
            raise ValueError("expected a JSON object")
        return value
    if text == "bool":
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", ""):
            return False
        raise ValueError("expected a boolean (1/0, true/false)")
    if text == "int":
        return int(raw)
    if text == "float":
        return float(raw)
    return raw


def env_name(field_name: str) -> str:
    """The environment variable of a :class:`SessionConfig` field."""
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    """A timeout field's flag: ``bootstrap_timeout`` → ``--bootstrap-timeout``."""
    return "--" + field_name.replace("_", "-")


def positive_seconds(text: str) -> float:
    """An ``argparse`` type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def add_timeout_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--bootstrap-timeout`` … ``--heartbeat-timeout`` (seconds, see
    :data:`TIMEOUT_FIELDS`) to ``parser``, in their own help group. Unset flags stay
    ``None``: the environment (``KVHANDOFF_*``), else the default, applies."""
    defaults = SessionConfig()
    group = parser.add_argument_group(
        "session timeouts (seconds)",
        f"Each flag beats its {ENV_PREFIX}* environment variable, which beats the default.")
    for name in TIMEOUT_FIELDS:
        group.add_argument(
            flag_name(name), dest=name, type=positive_seconds, default=None, metavar="S",
            help=f"{_TIMEOUT_HELP[name]} (env {env_name(name)}; "
                 f"default {getattr(defaults, name):g})")


def timeout_overrides(args: argparse.Namespace) -> dict[str, float]:
    """The timeouts given on the command line, as :meth:`SessionConfig.from_env` keyword
    overrides (flags left unset are absent, so the environment or default applies)."""
    out: dict[str, float] = {}
    for name in TIMEOUT_FIELDS:
        value = getattr(args, name, None)
        if value is not None:
            out[name] = float(value)
    return out


def env_of(overrides: Mapping[str, Any]) -> dict[str, str]:
    """``overrides`` as ``KVHANDOFF_*`` variables, for a process whose agents are built
    without an explicit config (they read :meth:`SessionConfig.from_env`). Only plain
    values (numbers, strings, booleans) are supported."""
    out = {}
    for name, value in overrides.items():
        if name not in _FIELD_NAMES:
            raise ValueError(f"{name!r} is not a SessionConfig field")
        if isinstance(value, bool):
            out[env_name(name)] = "1" if value else "0"
        elif isinstance(value, int | float | str):
            out[env_name(name)] = repr(value) if isinstance(value, float) else str(value)
        else:
            raise ValueError(f"{name}: cannot put {type(value).__name__} into the environment")
    return out


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SessionConfig))
