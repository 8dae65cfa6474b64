"""Bootstrap server: where prefill ranks register and decode ranks find them.

One small HTTP service per prefill deployment (``kvhandoff bootstrap --host --port``).
Routes and payloads are documented, and their schema defined, in
:mod:`kvhandoff.bootstrap.client`, which is what workers import.

Rules the :class:`Registry` enforces (the reference server enforced none of them: first
write won, a conflicting rank silently overwrote another, and a mismatched model was found
only mid-transfer):

* An instance's ranks agree on its sizes, model signature (``Layout.model_signature``),
  transport and protocol version (TP ranks and PP stages of one model share it by
  design, whatever layers a stage holds). The first rank
  sets them; a rank that disagrees is refused with 409, naming each field and both values.
* A (dp, tp, pp) slot holds one record. Repeating it exactly is a no-op (200); a different
  record there is refused with 409 until the old one deregisters.
* A control endpoint belongs to one rank: two ranks claiming it is a deployment mistake.
* An instance is served only when complete: until every (dp, tp, pp) rank registered a
  lookup answers 503 with the missing ranks. An instance whose last rank deregistered is
  forgotten, so a redeployment may change its sizes.
* Sizes are bounded (:class:`Limits`); a malformed, oversized, invalid-UTF-8 or
  unknown-field body is a 400/413 with a reason, never a crash. So are time and
  connections: a request head or body that does not arrive in time is dropped (408),
  and at the connection cap the oldest idle connection is shed.
* With the deployment secret (:mod:`kvhandoff.secret`), registering and
  deregistering must be signed, and only a rank's owner may remove it (see "HTTP shell"
  below for what owner means, and why lookups stay unsigned).

The aiohttp app runs on one event loop; the registry nevertheless takes its own lock so it
is safe to call from any thread (tests and in-process users do).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self, TypeVar

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvhandoff.bootstrap.aio import web
from kvhandoff.bootstrap.auth import AuthRefused, Verifier, new_server_id
from kvhandoff.bootstrap.client import (
    INSTANCE_FIELDS,
    PROTOCOL_VERSION,
    BootstrapError,
    Conflict,
    DeregisterReply,
    ErrorBody,
    Health,
    InstanceInfo,
    InstanceList,
    InstanceSummary,
    NotReady,
    RankId,
    RankRecord,
    RegisterReply,
    Slot,
    decode_as,
)
from kvhandoff.bootstrap.doors import Doors, accept_loop
from kvhandoff.bootstrap.metrics import BootstrapMetrics
from kvhandoff.descriptors import connection_cap, listening_socket
from kvhandoff.secret import (
    INSECURE_WARNING,
    PURPOSE_BOOTSTRAP,
    Secret,
    SecretError,
    deployment_secret,
)
from kvhandoff.session.config import SessionConfig
from kvhandoff.signals import stop_on_signals

__all__ = ["DEFAULT_PORT", "BootstrapServer", "Limits", "Registry", "check_bind", "main",
           "make_app", "serve"]

log = logging.getLogger("kvhandoff.bootstrap")
DESCRIPTOR_SHARE = 0.25
"""The bootstrap server's share of the descriptors free when it starts (its connection
cap, :func:`~kvhandoff.descriptors.connection_cap`)."""

DEFAULT_PORT = 8998  # the reference system's default bootstrap port
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Bounds on what one client can make the server hold, read or send.

    Memory at rest is bounded by ``max_total_bytes`` of records (each counted as its
    JSON encoding); one lookup answer by ``max_instance_bytes`` (an instance's records
    together), so slow readers hold at most that much each, and at most
    ``max_connections`` of them exist. A connection that has not sent a whole request
    head within ``header_timeout`` seconds, or a body within ``body_timeout``, is
    closed (slowloris); at ``max_connections`` the oldest connection not in a request
    is closed to make room, so a flood of idle or half-sent requests cannot lock
    ``/health`` or a rank out.
    """

    max_body_bytes: int = 64 * 1024
    max_instances: int = 256
    max_ranks_per_instance: int = 4096  # dp_size * tp_size * pp_size
    max_ranks: int = 16384  # over all instances
    max_missing_listed: int = 64  # a NotReady answer lists this many, then counts
    max_metadata_bytes: int = 4096  # one record's metadata keys and values together
    max_instance_bytes: int = 2 << 20  # one instance's records: the largest lookup answer
    max_total_bytes: int = 32 << 20  # every record held
    max_filter_ranks: int = 4096  # entries of one lookup's tp_rank / pp_rank list
    max_connections: int = 256  # and at most a quarter of the descriptors free at start
    header_timeout: float = 10.0
    body_timeout: float = 10.0


class Refused(Exception):
    """A request the registry will not carry out: an HTTP status and the body to send."""

    def __init__(self, status: int, error: str, reason: str,
                 conflicts: list[Conflict] | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.body = ErrorBody(error=error, reason=reason, conflicts=conflicts or [])


@dataclass(slots=True)
class _Instance:
    first: RankRecord  # holds the instance-wide fields every later rank must match
    ranks: dict[Slot, RankRecord] = field(default_factory=dict)
    nbytes: int = 0  # the encoded size of ``ranks``: what a full lookup answer carries

    @property
    def expected(self) -> int:
        return self.first.dp_size * self.first.tp_size * self.first.pp_size

    @property
    def ready(self) -> bool:
        return len(self.ranks) == self.expected


def _diff(old: RankRecord, new: RankRecord, names: tuple[str, ...]) -> list[Conflict]:
    return [Conflict(field=n, existing=getattr(old, n), offered=getattr(new, n))
            for n in names if getattr(old, n) != getattr(new, n)]


class Registry:
    """The rendezvous table. Pure (no I/O, no clock); every method is thread-safe.

    Methods raise :class:`Refused` for requests they will not carry out.
    """

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._lock = threading.Lock()
        self._instances: dict[str, _Instance] = {}
        self._endpoints: dict[str, RankRecord] = {}  # control endpoint → its holder
        self._nbytes = 0  # encoded size of every record held

    def register(self, rec: RankRecord) -> RegisterReply:
        if rec.protocol_version != PROTOCOL_VERSION:
            raise Refused(400, "unsupported_version",
                          f"{rec.where()}: protocol_version {rec.protocol_version} is not "
                          f"supported; this server speaks {PROTOCOL_VERSION}")
        meta = sum(len(k) + len(v) for k, v in rec.metadata.items())
        if meta > self.limits.max_metadata_bytes:
            raise Refused(413, "too_large", f"{rec.where()}: metadata of {meta} bytes exceeds "
                          f"this server's limit of {self.limits.max_metadata_bytes}")
        size = len(msgspec.json.encode(rec))
        with self._lock:
            inst = self._instances.get(rec.instance)
            if inst is None:
                self._check_new_instance(rec)
            else:
                conflicts = _diff(inst.first, rec, INSTANCE_FIELDS)
                if conflicts:
                    raise Refused(409, "conflict", f"{rec.where()} disagrees with the ranks "
                                  f"already registered for the instance: "
                                  f"{'; '.join(map(str, conflicts))}", conflicts)
                held = inst.ranks.get(rec.slot)
                if held == rec:
                    return self._reply(inst, created=False)
                if held is not None:
                    names = tuple(f for f in RankRecord.__struct_fields__ if f != "instance")
                    conflicts = _diff(held, rec, names)
                    raise Refused(409, "conflict", f"{rec.where()} is already registered with "
                                  f"{'; '.join(map(str, conflicts))}; deregister it first",
                                  conflicts)
            holder = self._endpoints.get(rec.control_endpoint)
            if holder is not None:
                raise Refused(409, "conflict", f"{rec.where()}: control_endpoint "
                              f"{rec.control_endpoint!r} is already registered by "
                              f"{holder.where()}",
                              [Conflict(field="control_endpoint", existing=holder.where(),
                                        offered=rec.where())])
            total = sum(len(i.ranks) for i in self._instances.values())
            if total >= self.limits.max_ranks:
                raise Refused(507, "capacity", f"{rec.where()}: the server holds its limit "
                              f"of {self.limits.max_ranks} ranks")
            self._check_bytes(rec, inst, size)
            if inst is None:
                inst = self._instances[rec.instance] = _Instance(first=rec)
            inst.ranks[rec.slot] = rec
            inst.nbytes += size
            self._nbytes += size
            self._endpoints[rec.control_endpoint] = rec
            log.info("registered %s at %s (%d/%d)", rec.where(), rec.control_endpoint,
                     len(inst.ranks), inst.expected)
            return self._reply(inst, created=True)

    def _check_new_instance(self, rec: RankRecord) -> None:
        expected = rec.dp_size * rec.tp_size * rec.pp_size
        if expected > self.limits.max_ranks_per_instance:
            raise Refused(507, "capacity", f"{rec.where()}: dp_size*tp_size*pp_size = "
                          f"{expected} ranks exceeds this server's limit of "
                          f"{self.limits.max_ranks_per_instance} per instance")
        if len(self._instances) >= self.limits.max_instances:
            raise Refused(507, "capacity", f"{rec.where()}: the server holds its limit of "
                          f"{self.limits.max_instances} instances")

    def _check_bytes(self, rec: RankRecord, inst: _Instance | None, size: int) -> None:
        held = inst.nbytes if inst is not None else 0
        if held + size > self.limits.max_instance_bytes:
            raise Refused(507, "capacity", f"{rec.where()}: the instance's records would take "
                          f"{held + size} bytes, over this server's limit of "
                          f"{self.limits.max_instance_bytes} per instance (less metadata?)")
        if self._nbytes + size > self.limits.max_total_bytes:
            raise Refused(507, "capacity", f"{rec.where()}: the server holds its limit of "
                          f"{self.limits.max_total_bytes} bytes of records")

    @staticmethod
    def _reply(inst: _Instance, *, created: bool) -> RegisterReply:
        return RegisterReply(created=created, ready=inst.ready, registered=len(inst.ranks),
                             expected=inst.expected)

    def deregister(self, rid: RankId) -> bool:
        """Remove a rank; False if it was not registered. With ``rid.control_endpoint``
        set, refuses (409) to remove a rank registered with another endpoint."""
        slot = Slot(dp_rank=rid.dp_rank, tp_rank=rid.tp_rank, pp_rank=rid.pp_rank)
        with self._lock:
            inst = self._instances.get(rid.instance)
            held = inst.ranks.get(slot) if inst else None
            if inst is None or held is None:
                return False
            if rid.control_endpoint is not None and rid.control_endpoint != held.control_endpoint:
                c = Conflict(field="control_endpoint", existing=held.control_endpoint,
                             offered=rid.control_endpoint)
                raise Refused(409, "conflict", f"{held.where()} is registered by another "
                              f"process now ({c}); not removed", [c])
            del inst.ranks[slot]
            del self._endpoints[held.control_endpoint]
            size = len(msgspec.json.encode(held))
            inst.nbytes -= size
            self._nbytes -= size
            if not inst.ranks:
                # Forget the instance, so that a redeployment may change its sizes.
                del self._instances[rid.instance]
            log.info("deregistered %s", held.where())
            return True

    def lookup(self, instance: str, *, dp_rank: int | None = None,
               tp_ranks: list[int] | None = None, pp_ranks: list[int] | None = None
               ) -> InstanceInfo | NotReady:
        """The instance's ranks selected by the filters if every rank registered, else a
        :class:`NotReady`. Refuses unknown instances (404) and out-of-range filters (400)."""
        with self._lock:
            inst = self._instances.get(instance)
            if inst is None:
                raise Refused(404, "not_found", f"instance {instance!r} is unknown: no rank "
                              "of it has registered")
            f = inst.first
            for axis, size, wanted in (("dp", f.dp_size, [] if dp_rank is None else [dp_rank]),
                                       ("tp", f.tp_size, tp_ranks or []),
                                       ("pp", f.pp_size, pp_ranks or [])):
                bad = [r for r in wanted if not 0 <= r < size]
                if bad:
                    raise Refused(400, "malformed", f"instance {instance!r}: {axis}_rank "
                                  f"{bad} out of range for {axis}_size {size}")
            if not inst.ready:
                return self._not_ready(inst)
            ranks = sorted(inst.ranks.values(), key=lambda r: r.slot)
            tps = None if tp_ranks is None else set(tp_ranks)  # O(1) tests (finding L2)
            pps = None if pp_ranks is None else set(pp_ranks)
            keep = [r for r in ranks
                    if (dp_rank is None or r.dp_rank == dp_rank)
                    and (tps is None or r.tp_rank in tps)
                    and (pps is None or r.pp_rank in pps)]
            return InstanceInfo(instance=instance, ready=True, dp_size=f.dp_size,
                                tp_size=f.tp_size, pp_size=f.pp_size,
                                model_signature=f.model_signature, transport=f.transport,
                                protocol_version=f.protocol_version, ranks=keep)

    def _not_ready(self, inst: _Instance) -> NotReady:
        f = inst.first
        every = (Slot(dp_rank=d, tp_rank=t, pp_rank=p) for d, t, p in itertools.product(
            range(f.dp_size), range(f.tp_size), range(f.pp_size)))
        missing = [s for s in every if s not in inst.ranks]
        return NotReady(ready=False, instance=f.instance, dp_size=f.dp_size, tp_size=f.tp_size,
                        pp_size=f.pp_size, registered=len(inst.ranks), expected=inst.expected,
                        missing=missing[: self.limits.max_missing_listed],
                        missing_count=len(missing))

    def instances(self) -> InstanceList:
        """Every instance with its readiness (bounded: at most ``max_instances``)."""
        with self._lock:
            return InstanceList(instances=[
                InstanceSummary(instance=name, ready=i.ready, registered=len(i.ranks),
                                expected=i.expected, transport=i.first.transport)
                for name, i in sorted(self._instances.items())])

    def health(self) -> Health:
        with self._lock:
            insts = list(self._instances.values())
            return Health(ok=True, protocol_version=PROTOCOL_VERSION, instances=len(insts),
                          ready_instances=sum(i.ready for i in insts),
                          ranks=sum(len(i.ranks) for i in insts))


# ---------------------------------------------------------------------------------------
# HTTP shell
#
# Authentication (when the server has a secret): POST and DELETE /v1/register must be
# signed (:mod:`~kvhandoff.bootstrap.auth`), checked on the raw bytes before the
# body is parsed; anything else is a 401 with a reason and changes nothing. Lookups,
# /health and /metrics stay unsigned: they change nothing, and with every registration
# signed a lookup can only name ranks a secret holder registered, so decode cannot be
# pointed at an attacker's endpoint through this server. (An attacker on the network
# path could still alter a lookup answer; authenticating the peer itself is the control
# plane's job.)
#
# Ownership: every rank holds the same secret, so a signature proves "one of us", not
# which one; with a single shared key no scheme can tell two holders apart
# cryptographically. A per-registration token returned at register time would make the
# registering *process* the owner, but a crashed rank takes its token with it and its
# restarted successor could never free the slot (the takeover in
# :mod:`~kvhandoff.bootstrap.registration`). So the owner is bound to the signed record
# instead: a signed DELETE must name the rank's registered ``control_endpoint`` (a
# compare-and-delete; 400 without it, 409 on a mismatch), and a slot is replaced only by
# deleting it first. Nobody without the secret can remove or replace anything, and a
# stale or misconfigured secret holder cannot remove a successor's registration.

REGISTRY = web.AppKey("registry", Registry)
METRICS = web.AppKey("metrics", BootstrapMetrics)
VERIFIER = web.AppKey("verifier", Verifier)  # absent: no secret, mutations unsigned
SERVER_ID = web.AppKey("server_id", str)  # this run's id: signed requests name it
_STATUS_CODES = {400: "malformed", 404: "not_found", 405: "method_not_allowed",
                 408: "timeout", 413: "too_large"}


def _json(status: int, obj: msgspec.Struct) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(obj),
                        content_type="application/json")


DOORS = web.AppKey("doors", Doors)


@web.middleware
async def _track(request: web.Request,
                 handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                 ) -> web.StreamResponse:
    """Mark the connection busy while a request is handled (outermost), for Doors."""
    busy = request.app[DOORS].busy
    key = id(request.protocol)
    busy.add(key)
    try:
        return await handler(request)
    finally:
        busy.discard(key)


@web.middleware
async def _count(request: web.Request,
                 handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                 ) -> web.StreamResponse:
    """Count every answer by route pattern and status (outside _errors)."""
    response = await handler(request)
    info = request.match_info.route.resource
    request.app[METRICS].answered(info.canonical if info is not None else None,
                                  response.status)
    return response


@web.middleware
async def _errors(request: web.Request,
                  handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    """Every failure becomes a JSON :class:`ErrorBody`; nothing a client sends can take
    the server down."""
    try:
        return await handler(request)
    except AuthRefused as a:
        log.info("refused: %s", a.reason)
        return _json(a.status, ErrorBody(error="unauthorized" if a.status == 401
                                         else "busy", reason=a.reason))
    except Refused as r:
        if r.status == 409:
            log.warning("refused: %s", r.body.reason)
        response = _json(r.status, r.body)
        if r.status == 408:
            response.force_close()  # the rest of a slow body is not worth waiting for
        return response
    except web.HTTPException as e:  # the router's 404/405, aiohttp's 413 on a large body
        if e.status < 400:
            raise
        code = _STATUS_CODES.get(e.status, "http_error")
        reason = f"{e.reason}: {request.method} {request.path}"
        if e.status == 413:
            reason = (f"request body larger than {request.app[REGISTRY].limits.max_body_bytes}"
                      " bytes")
        return _json(e.status, ErrorBody(error=code, reason=reason))
    except Exception:
        # A bug of ours: log the traceback, answer 500, keep serving the other ranks.
        log.exception("bootstrap handler failed on %s %s", request.method, request.path)
        return _json(500, ErrorBody(error="internal", reason="internal server error"))


async def _signed_body(request: web.Request) -> bytes:
    """The request body, read within ``body_timeout`` (408 beyond it) and bounded by
    client_max_size (413), and authenticated when the server has a secret (401)."""
    limits = request.app[REGISTRY].limits
    try:
        data = await asyncio.wait_for(request.read(), limits.body_timeout)
    except TimeoutError:
        raise Refused(408, "timeout", f"{request.method} {request.path}: body not received "
                      f"within {limits.body_timeout:g} s") from None
    verifier = request.app.get(VERIFIER)
    if verifier is not None:
        verifier.check(request.method, request.raw_path, data, request.headers,
                       now=time.time())
    return data


def _decode(request: web.Request, data: bytes, kind: type[_T]) -> _T:
    try:
        return decode_as(data, kind)
    except (msgspec.MsgspecError, ValueError) as e:  # ValueError: invalid UTF-8 (L1)
        raise Refused(400, "malformed", f"{request.method} {request.path}: invalid "
                      f"{kind.__name__} body: {e}") from e


def _ranks_param(request: web.Request, name: str) -> list[int] | None:
    raw = request.query.getall(name, [])
    if not raw:
        return None
    try:
        ranks = [int(x) for part in raw for x in part.split(",")]
    except ValueError:
        raise Refused(400, "malformed", f"query parameter {name} is not a comma list of "
                      "integers") from None
    most = request.app[REGISTRY].limits.max_filter_ranks
    if len(ranks) > most:
        raise Refused(400, "malformed", f"query parameter {name} lists {len(ranks)} ranks; "
                      f"at most {most}")
    return ranks


async def _register(request: web.Request) -> web.Response:
    rec = _decode(request, await _signed_body(request), RankRecord)
    return _json(200, request.app[REGISTRY].register(rec))


async def _deregister(request: web.Request) -> web.Response:
    rid = _decode(request, await _signed_body(request), RankId)
    if VERIFIER in request.app and rid.control_endpoint is None:
        raise Refused(400, "malformed", f"DELETE {request.path}: this server removes a rank "
                      "only for its owner: name the rank's registered control_endpoint")
    return _json(200, DeregisterReply(removed=request.app[REGISTRY].deregister(rid)))


async def _lookup(request: web.Request) -> web.Response:
    unknown = set(request.query) - {"dp_rank", "tp_rank", "pp_rank"}
    if unknown:
        raise Refused(400, "malformed", f"unknown query parameters {sorted(unknown)[:8]}; "
                      "known: dp_rank, tp_rank, pp_rank")
    dp = _ranks_param(request, "dp_rank")
    if dp is not None and len(dp) != 1:
        raise Refused(400, "malformed", f"dp_rank takes one integer, got {len(dp)}")
    answer = request.app[REGISTRY].lookup(
        request.match_info["instance"], dp_rank=dp[0] if dp else None,
        tp_ranks=_ranks_param(request, "tp_rank"), pp_ranks=_ranks_param(request, "pp_rank"))
    return _json(503 if isinstance(answer, NotReady) else 200, answer)


async def _instances(request: web.Request) -> web.Response:
    return _json(200, request.app[REGISTRY].instances())


async def _health(request: web.Request) -> web.Response:
    return _json(200, msgspec.structs.replace(request.app[REGISTRY].health(),
                                              server_id=request.app[SERVER_ID]))


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(registry: Registry | None = None, *, secret: Secret | None = None,
             server_id: str | None = None) -> web.Application:
    """The aiohttp application around ``registry`` (a fresh one by default). With
    ``secret``, registering and deregistering need requests signed with its
    :data:`~kvhandoff.secret.PURPOSE_BOOTSTRAP` key, for this run: ``server_id``
    (:func:`~kvhandoff.bootstrap.auth.new_server_id` by default), which ``/health``
    tells."""
    registry = registry or Registry()
    app = web.Application(client_max_size=registry.limits.max_body_bytes,
                          middlewares=[_track, _count, _errors])
    app[REGISTRY] = registry
    app[SERVER_ID] = server_id = server_id or new_server_id()
    app[METRICS] = BootstrapMetrics(registry.health)
    # read now, when the server starts: the cap stays below the descriptor limit
    app[DOORS] = Doors(connection_cap(registry.limits.max_connections, DESCRIPTOR_SHARE))
    if secret is not None:
        app[VERIFIER] = Verifier(secret.key(PURPOSE_BOOTSTRAP), server=server_id)
    app.router.add_post("/v1/register", _register)
    app.router.add_delete("/v1/register", _deregister)
    app.router.add_get("/v1/instances", _instances)
    app.router.add_get("/v1/instances/{instance}", _lookup)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def _run(app: web.Application, host: str, port: int, stop: asyncio.Event,
               on_started: Callable[[int], None]) -> None:
    """Serve ``app`` until ``stop`` is set, then close every socket and connection."""
    limits = app[REGISTRY].limits
    # access_log=None: one line per heartbeat would drown the registry's own log.
    # keepalive_timeout: aiohttp arms it when a connection opens and after each answer and
    # closes the connection if no whole request head came in that time: the header timeout.
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0,
                           keepalive_timeout=limits.header_timeout)
    await runner.setup()
    doors = app[DOORS]
    doors.server = runner.server
    sock: socket.socket | None = None
    accepting: asyncio.Task[None] | None = None
    try:
        sock = listening_socket(host, port)
        accepting = asyncio.create_task(accept_loop(sock, doors))
        on_started(int(sock.getsockname()[1]))
        await stop.wait()
    finally:
        if accepting is not None:
            accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await accepting
        if sock is not None:
            sock.close()
        await runner.cleanup()


def _url(host: str, port: int) -> str:
    # A wildcard bind is reached through loopback from this host.
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class BootstrapServer:
    """The bootstrap server on its own event-loop thread, for tests and in-process use.

    ``with BootstrapServer("127.0.0.1", 0) as srv: ... srv.url ...``. ``start()`` returns
    once the socket is bound (``port`` is then the real one) or raises
    :class:`BootstrapError` if it cannot bind. ``close()`` is idempotent and returns once
    the listening socket, every connection and the thread are gone. With ``secret``,
    registrations must be signed (see the HTTP shell's notes); it binds any address it
    is given (:func:`check_bind` is the command line's policy). Without ``secret`` it
    uses the user's default deployment secret (:func:`~kvhandoff.secret.deployment_secret`),
    as agents do without configuration; only ``insecure`` serves unsigned registrations.
    ``start``/``close`` are meant for one owning thread; ``url``, ``port`` and
    ``registry`` may be read from any thread.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 limits: Limits | None = None, secret: Secret | None = None,
                 insecure: bool = False, start_timeout: float = 10.0) -> None:
        self.host = host
        if secret is not None and insecure:
            raise ValueError("BootstrapServer: a secret and insecure exclude each other")
        self.secret = secret if secret is not None or insecure else deployment_secret()
        self.registry = Registry(limits)
        self.server_id = new_server_id()  # this run's: what signed requests must name
        self._requested_port = port
        self._start_timeout = start_timeout
        self._port: int | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self.doors: Doors | None = None  # its connections (cap, counters), once started

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("BootstrapServer is not started")
        return self._port

    @property
    def url(self) -> str:
        return _url(self.host, self.port)

    def start(self) -> Self:
        if self._thread is not None:
            raise RuntimeError("BootstrapServer.start() called twice")
        self._thread = threading.Thread(target=self._main, name="kvhandoff-bootstrap",
                                        daemon=True)
        self._thread.start()
        if not self._started.wait(self._start_timeout):
            self.close()
            raise BootstrapError(f"bootstrap server did not start on {self.host}:"
                                 f"{self._requested_port} within {self._start_timeout} s")
        if self._failure is not None:
            self._thread.join(self._start_timeout)
            raise BootstrapError(f"bootstrap server cannot listen on {self.host}:"
                                 f"{self._requested_port}: {self._failure}") from self._failure
        log.info("bootstrap server listening on %s", self.url)
        return self

    def _main(self) -> None:
        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            app = make_app(self.registry, secret=self.secret, server_id=self.server_id)
            self.doors = app[DOORS]
            await _run(app, self.host, self._requested_port, self._stop, self._on_started)

        try:
            asyncio.run(main())
        except BaseException as e:
            if self._started.is_set():
                log.exception("bootstrap server stopped on an error")
            self._failure = e
        finally:
            self._started.set()  # never leave start() waiting on a thread that is gone

    def _on_started(self, port: int) -> None:
        self._port = port
        self._started.set()

    def close(self) -> None:
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None or not thread.is_alive():
            return
        if loop is not None and stop is not None:
            # RuntimeError: the loop already closed, the thread is on its way out.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        thread.join(self._start_timeout)
        if thread.is_alive():
            raise BootstrapError("bootstrap server thread did not stop within "
                                 f"{self._start_timeout} s")

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def check_bind(host: str, *, secret: Secret | None, insecure: bool) -> None:
    """Refuse (:class:`BootstrapError`) to serve ``host`` without a secret unless it is a
    loopback address or ``insecure`` is set: an unauthenticated registry reachable from
    other machines lets anyone replace any rank (finding L8)."""
    if secret is not None or insecure:
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False  # a host name: it may well resolve to a public address
    if not loopback:
        raise BootstrapError(
            f"refusing to serve {host or 'every address'} without a deployment secret: "
            "anyone who reaches it could replace any rank. Give --secret-file (or "
            "KVHANDOFF_SECRET_FILE), bind 127.0.0.1, or pass --insecure to accept the risk")


def serve(host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, limits: Limits | None = None,
          secret: Secret | None = None, insecure: bool = False,
          announce: Callable[[str], None] | None = None) -> int:
    """Run the bootstrap server in the foreground until SIGINT or SIGTERM; return 0.

    For ``kvhandoff bootstrap --host --port``. Call from the main thread (signal handlers
    are installed only there). ``announce`` receives one line with the bound URL once
    the socket listens (with ``port=0``, the port the OS chose); by default it is printed
    and flushed, so a launcher can read the port from stdout. Raises
    :class:`BootstrapError` before binding when :func:`check_bind` refuses ``host``.
    """
    check_bind(host, secret=secret, insecure=insecure)
    say = announce or (lambda line: print(line, flush=True))
    auth = "registrations signed" if secret is not None else "UNAUTHENTICATED"

    async def main() -> None:
        stop = stop_on_signals()
        await _run(make_app(Registry(limits), secret=secret), host, port, stop,
                   lambda p: say(f"kvhandoff bootstrap server ({auth}) bound to "
                                 f"{host}:{p}, listening on {_url(host, p)}"))

    asyncio.run(main())
    return 0


def main(host: str, port: int, *, secret_file: str | None, insecure: bool) -> int:
    """``kvhandoff bootstrap``: load the secret (``secret_file``, else
    ``KVHANDOFF_SECRET_FILE``, else the user's default one; none with ``insecure``, said
    loudly on stderr), then :func:`serve`. Returns 2, saying why on stderr, when the
    secret or the bind address is refused."""
    try:
        env = SessionConfig.from_env()
        path = secret_file if secret_file is not None else env.secret_file
        insecure = insecure or env.insecure
        secret = deployment_secret(path, insecure=insecure)
        check_bind(host, secret=secret, insecure=insecure)
    except (SecretError, BootstrapError, ValueError) as e:
        print(f"kvhandoff bootstrap: {e}", file=sys.stderr)
        return 2
    if secret is None:
        print(f"kvhandoff bootstrap: {INSECURE_WARNING}", file=sys.stderr, flush=True)
    return serve(host, port, secret=secret, insecure=insecure)
