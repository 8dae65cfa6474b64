"""Bootstrap client: the blocking calls a prefill or decode rank makes to the bootstrap server.

Also the wire schema of the bootstrap HTTP API. It lives here, not in the server module,
so that worker processes need only the standard library and msgspec (no aiohttp, no
asyncio) to register and look up ranks. The server is :mod:`kvhandoff.bootstrap.server`.

Routes (JSON bodies; every non-2xx answer is an :class:`ErrorBody`)::

    POST   /v1/register                RankRecord  → 200 RegisterReply  | 400 401 408 413 409 507
    DELETE /v1/register                RankId      → 200 DeregisterReply | 400 401 408 413 409
    GET    /v1/instances/{instance}    [?dp_rank=0&tp_rank=0,1&pp_rank=1]
                                                   → 200 InstanceInfo   | 503 NotReady | 404 400
    GET    /health                                 → 200 Health

Error tree (all under :class:`kvhandoff.errors.HandoffError`)::

    BootstrapError
    ├── BootstrapUnavailable      server unreachable, or 5xx, after every bounded retry
    ├── BootstrapRejected         the server refused the request (4xx, 507); never retried
    │   └── RegistrationConflict  409: the record contradicts what is registered
    └── BootstrapTimeout          lookup: the instance did not become ready in time

Authentication: given ``key`` (the deployment secret's
:data:`~kvhandoff.secret.PURPOSE_BOOTSTRAP` key), :func:`register` and
:func:`deregister` sign each attempt (:mod:`kvhandoff.bootstrap.auth`); a server
with a secret answers an unsigned or badly signed request 401, raised here as
:class:`BootstrapRejected`. Lookups are never signed.

Every function here is stateless and safe to call from any number of threads at once.
Every loop is bounded in attempts *and* time; each attempt has a socket timeout.
"""

from __future__ import annotations

import http.client
import random
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, cast

import msgspec
from msgspec import Meta

from kvhandoff.bootstrap.auth import sign
from kvhandoff.errors import HandoffError

__all__ = [
    "PROTOCOL_VERSION",
    "BootstrapError",
    "BootstrapRejected",
    "BootstrapTimeout",
    "BootstrapUnavailable",
    "Conflict",
    "DeregisterReply",
    "ErrorBody",
    "Health",
    "InstanceInfo",
    "NotReady",
    "RankFilter",
    "RankId",
    "RankRecord",
    "RegisterReply",
    "RegistrationConflict",
    "Slot",
    "deregister",
    "health",
    "lookup",
    "register",
]

PROTOCOL_VERSION = 1
MAX_REPLY_BYTES = 8 << 20  # a reply larger than this is not from our server

# ---------------------------------------------------------------------------------------
# Wire schema. Constraints are checked by msgspec on decode (server side, and by
# ``register`` before sending); ``__post_init__`` adds the cross-field rank < size rule.

InstanceName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")]
Size = Annotated[int, Meta(ge=1, le=1 << 16)]
Rank = Annotated[int, Meta(ge=0, lt=1 << 16)]
Endpoint = Annotated[str, Meta(pattern=r"^[a-z][a-z0-9+.-]*://\S+$", max_length=256)]
TransportKind = Annotated[str, Meta(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]
Signature = Annotated[str, Meta(pattern=r"^[0-9a-f]{1,128}$")]
Metadata = Annotated[
    dict[Annotated[str, Meta(min_length=1, max_length=64)], Annotated[str, Meta(max_length=1024)]],
    Meta(max_length=32),
]

AXES = ("dp", "tp", "pp")
# Fields every rank of one instance must agree on: one deployment is one model (one model
# signature, Layout.model_signature: TP ranks and PP stages of a model share it whatever
# layers they hold), one topology, one transport.
INSTANCE_FIELDS = ("dp_size", "tp_size", "pp_size", "model_signature", "transport",
                   "protocol_version")


class RankRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one prefill rank registers: who it is, where its control socket listens, and
    what a decode rank must match (model signature, transport kind)."""

    instance: InstanceName
    dp_size: Size
    dp_rank: Rank
    tp_size: Size
    tp_rank: Rank
    pp_size: Size
    pp_rank: Rank
    control_endpoint: Endpoint  # e.g. "tcp://10.0.0.3:17000", the rank's control socket
    transport: TransportKind  # e.g. "tcp", "mooncake", "nixl"
    model_signature: Signature  # Layout.model_signature, lower-case hex
    protocol_version: int = PROTOCOL_VERSION
    metadata: Metadata = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        for axis in AXES:
            rank, size = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            if rank >= size:
                # msgspec turns this into a ValidationError naming the record on decode.
                raise ValueError(f"{axis}_rank {rank} is not below {axis}_size {size}")

    @property
    def slot(self) -> Slot:
        return Slot(dp_rank=self.dp_rank, tp_rank=self.tp_rank, pp_rank=self.pp_rank)

    def where(self) -> str:
        """``instance 'x' rank (dp=0, tp=1, pp=0)``, for messages."""
        return f"instance {self.instance!r} rank {self.slot}"


class Slot(msgspec.Struct, frozen=True, kw_only=True, order=True):
    """One (dp, tp, pp) position of an instance. Ordered by dp, then tp, then pp."""

    dp_rank: int
    tp_rank: int
    pp_rank: int

    def __str__(self) -> str:
        return f"(dp={self.dp_rank}, tp={self.tp_rank}, pp={self.pp_rank})"


class RankId(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Names one registered rank (deregistration). With ``control_endpoint`` set, the
    server removes the rank only if that is still its endpoint, so a stale process
    cannot remove the registration of the process that replaced it."""

    instance: InstanceName
    dp_rank: Rank
    tp_rank: Rank
    pp_rank: Rank
    control_endpoint: Endpoint | None = None


class RegisterReply(msgspec.Struct, frozen=True, kw_only=True):
    created: bool  # False: this exact record was already registered (idempotent repeat)
    ready: bool  # every rank of the instance is now registered
    registered: int
    expected: int


class DeregisterReply(msgspec.Struct, frozen=True, kw_only=True):
    removed: bool  # False: nothing was registered there (deregistration is idempotent)


class InstanceInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A complete instance (200 answer of a lookup), possibly filtered to some ranks."""

    instance: str
    ready: bool
    dp_size: int
    tp_size: int
    pp_size: int
    model_signature: str
    transport: str
    protocol_version: int
    ranks: list[RankRecord]  # sorted by (dp, tp, pp); only the ranks the filter selected

    def rank(self, *, dp_rank: int = 0, tp_rank: int, pp_rank: int = 0) -> RankRecord:
        want = Slot(dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank)
        for r in self.ranks:
            if r.slot == want:
                return r
        raise KeyError(f"instance {self.instance!r}: rank {want} not in this answer "
                       f"(it holds {[str(r.slot) for r in self.ranks]})")


class NotReady(msgspec.Struct, frozen=True, kw_only=True):
    """503 answer of a lookup: some ranks of the instance have not registered yet."""

    ready: bool
    instance: str
    dp_size: int
    tp_size: int
    pp_size: int
    registered: int
    expected: int
    missing: list[Slot]  # the first few missing ranks, in order
    missing_count: int


class InstanceSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One instance in ``GET /v1/instances`` (for status views; lookups use the
    per-instance route)."""

    instance: str
    ready: bool
    registered: int
    expected: int
    transport: str


class InstanceList(msgspec.Struct, frozen=True, kw_only=True):
    instances: list[InstanceSummary]  # sorted by name; at most Limits.max_instances


class Health(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    protocol_version: int
    instances: int
    ready_instances: int
    ranks: int
    server_id: str = ""  # this server run's id: what a signed request names


class Conflict(msgspec.Struct, frozen=True, kw_only=True):
    field: str
    existing: str | int | dict[str, str]
    offered: str | int | dict[str, str]

    def __str__(self) -> str:
        return f"{self.field}: registered {self.existing!r}, offered {self.offered!r}"


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    """Every non-2xx answer. ``error`` is a stable code; ``reason`` a sentence for people."""

    error: str  # malformed | too_large | unsupported_version | conflict | not_found |
    #             capacity | method_not_allowed | internal | http_error | unauthorized |
    #             busy | timeout
    reason: str
    conflicts: list[Conflict] = msgspec.field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankFilter:
    """Which ranks a lookup returns (None = all along that axis). Readiness is still
    judged on the whole instance: a partial instance is never served."""

    dp_rank: int | None = None
    tp_ranks: Sequence[int] | None = None
    pp_ranks: Sequence[int] | None = None

    def query(self) -> str:
        q: dict[str, str] = {}
        if self.dp_rank is not None:
            q["dp_rank"] = str(self.dp_rank)
        if self.tp_ranks is not None:
            q["tp_rank"] = ",".join(map(str, self.tp_ranks))
        if self.pp_ranks is not None:
            q["pp_rank"] = ",".join(map(str, self.pp_ranks))
        return urllib.parse.urlencode(q)


# ---------------------------------------------------------------------------------------
# Errors


class BootstrapError(HandoffError):
    """Base class of every bootstrap failure."""


class BootstrapUnavailable(BootstrapError, ConnectionError):
    """The server could not be reached (or kept answering 5xx) through every retry."""

    def __init__(self, message: str, *, attempts: int, last_error: str) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.last_error = last_error


class BootstrapRejected(BootstrapError):
    """The server refused the request; retrying the same request cannot succeed.
    ``status`` is the HTTP status (None: refused locally, before sending)."""

    def __init__(self, message: str, *, status: int | None, body: ErrorBody | None = None
                 ) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class RegistrationConflict(BootstrapRejected):
    """409: the record contradicts a registration already held. ``conflicts`` names each
    field with the registered and the offered value."""

    def __init__(self, message: str, *, body: ErrorBody) -> None:
        super().__init__(message, status=409, body=body)
        self.conflicts = list(body.conflicts)


class BootstrapTimeout(BootstrapError, TimeoutError):
    """A lookup's wait ran out before the instance was ready. ``missing`` lists the
    ranks still unregistered when it gave up (empty if the instance was unknown)."""

    def __init__(self, message: str, *, missing: list[Slot], missing_count: int) -> None:
        super().__init__(message)
        self.missing = missing
        self.missing_count = missing_count


# ---------------------------------------------------------------------------------------
# HTTP plumbing. http.client, not urllib.request: urllib honours http_proxy variables,
# and a cluster-wide proxy must never sit between a rank and its bootstrap server.

_T = TypeVar("_T")
_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {
    kind: msgspec.json.Decoder(kind) for kind in (
        RankRecord, RankId, RegisterReply, DeregisterReply, InstanceInfo, NotReady, Health,
        ErrorBody)}
"""Every bootstrap message's decoder, built at import, in one thread. msgspec builds a
Struct type's decoding tables on its first decode, and two threads doing that first
decode at once can read half-built tables and crash the process (a segfault, seen when
the ranks of one decode looked their prefill up together); once built they are shared
safely."""


def decode_as(data: bytes, kind: type[_T]) -> _T:
    """``data`` (JSON) as a ``kind`` bootstrap message, through its prebuilt decoder;
    raises ``msgspec.MsgspecError`` (or ``ValueError`` for invalid UTF-8) when it is not."""
    return cast(_T, _DECODERS[kind].decode(data))


_jitter = random.Random()
# Failures worth another attempt: the network, and 5xx except 507 (registry full —
# retrying within a backoff budget will not free room).
_NETWORK_ERRORS = (OSError, http.client.HTTPException)


def _transient(status: int) -> bool:
    return status >= 500 and status != 507


def _request(url: str, method: str, path: str, body: bytes | None, timeout: float,
             key: bytes | None = None) -> tuple[int, bytes]:
    """One HTTP exchange; with ``key``, signed for the server's current run, which a
    ``GET /health`` first asks (a fresh nonce and timestamp each call)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise BootstrapRejected(f"bootstrap url {url!r} is not http://host:port", status=None)
    headers = {"Connection": "close"}
    full = parts.path.rstrip("/") + path
    if key is not None:
        status, data = _request(url, "GET", "/health", None, timeout)
        if status != 200:
            return status, data  # transient (retried) or a refusal: as the request's
        run = _decode(data, Health, "health").server_id
        headers.update(sign(key, method, full, body or b"", now=time.time(), server=run))
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        if body is not None:
            headers["Content-Type"] = "application/json"
        conn.request(method, full, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(MAX_REPLY_BYTES)
    finally:
        conn.close()


def _error_body(data: bytes) -> ErrorBody | None:
    try:
        return decode_as(data, ErrorBody)
    except msgspec.MsgspecError:
        return None


def _describe(status: int, data: bytes) -> str:
    body = _error_body(data)
    text = body.reason if body else data[:200].decode("utf-8", "replace").strip()
    return f"HTTP {status}: {text}" if text else f"HTTP {status}"


def _decode(data: bytes, kind: type[_T], what: str) -> _T:
    try:
        return decode_as(data, kind)
    except msgspec.MsgspecError as e:
        raise BootstrapError(f"{what}: unreadable answer from bootstrap server: {e}") from e


def _reject(what: str, status: int, data: bytes) -> BootstrapRejected:
    body = _error_body(data)
    msg = f"{what}: refused by bootstrap server ({_describe(status, data)})"
    if status == 409 and body is not None:
        return RegistrationConflict(msg, body=body)
    return BootstrapRejected(msg, status=status, body=body)


def _delay(attempt: int, backoff: float, max_backoff: float) -> float:
    # Bounded exponential backoff with jitter, so ranks started together do not retry
    # in lock-step against a server that is just coming up.
    return min(max_backoff, backoff * 2.0**attempt) * _jitter.uniform(0.5, 1.0)


def _with_retries(url: str, what: str, call: Callable[[], tuple[int, bytes]], *,
                  retries: int, backoff: float, max_backoff: float) -> tuple[int, bytes]:
    attempts = max(0, retries) + 1
    last = ""
    for attempt in range(attempts):
        try:
            status, data = call()
        except _NETWORK_ERRORS as e:
            last = f"{type(e).__name__}: {e}"
        else:
            if not _transient(status):
                return status, data
            last = _describe(status, data)
        if attempt + 1 < attempts:
            time.sleep(_delay(attempt, backoff, max_backoff))
    raise BootstrapUnavailable(
        f"{what}: bootstrap server {url} unavailable after {attempts} attempt(s); "
        f"last error: {last}", attempts=attempts, last_error=last)


def _validated(record: RankRecord) -> bytes:
    """Encode, and check the record against the schema the server enforces (msgspec checks
    constraints only on decode), so a bad record fails here with the server's words."""
    data = msgspec.json.encode(record)
    try:
        decode_as(data, RankRecord)
    except msgspec.ValidationError as e:
        raise BootstrapRejected(f"invalid bootstrap record for {record.where()} "
                                f"(not sent): {e}", status=None) from e
    return data


# ---------------------------------------------------------------------------------------
# Public calls


def register(url: str, record: RankRecord, *, retries: int = 5, backoff: float = 0.5,
             max_backoff: float = 8.0, timeout: float = 5.0, key: bytes | None = None
             ) -> RegisterReply:
    """Register one prefill rank; safe to repeat (an identical record answers 200 again).

    Retries connection errors and 5xx (except 507) up to ``retries`` times with bounded
    exponential backoff, so ranks may start before the server. Worst case it blocks about
    ``(retries + 1) * timeout + Σ min(max_backoff, backoff * 2**i)`` seconds.

    With ``key``, every attempt is signed (see the module docstring).

    Raises :class:`RegistrationConflict` at once on 409 (not retried: the same record
    cannot succeed later), :class:`BootstrapRejected` on other refusals (401: unsigned or
    signed with another secret), and
    :class:`BootstrapUnavailable` once the retries are spent.
    """
    body = _validated(record)
    what = f"register {record.where()}"
    status, data = _with_retries(
        url, what, lambda: _request(url, "POST", "/v1/register", body, timeout, key),
        retries=retries, backoff=backoff, max_backoff=max_backoff)
    if status != 200:
        raise _reject(what, status, data)
    return _decode(data, RegisterReply, what)


def deregister(url: str, rank: RankRecord | RankId, *, retries: int = 2, backoff: float = 0.2,
               max_backoff: float = 2.0, timeout: float = 5.0, key: bytes | None = None
               ) -> bool:
    """Remove one rank's registration (e.g. on shutdown). Returns whether anything was
    removed; removing an absent rank is not an error. Given a :class:`RankRecord`, the
    removal is conditional on its endpoint still being the registered one (409 otherwise).
    Same retry policy, signing and errors as :func:`register`, with a smaller default
    budget. A server with a secret removes a rank only when its ``control_endpoint`` is
    named (a :class:`RankRecord` always does)."""
    if isinstance(rank, RankRecord):
        rank = RankId(instance=rank.instance, dp_rank=rank.dp_rank, tp_rank=rank.tp_rank,
                      pp_rank=rank.pp_rank, control_endpoint=rank.control_endpoint)
    body = msgspec.json.encode(rank)
    what = f"deregister instance {rank.instance!r} rank " \
           f"(dp={rank.dp_rank}, tp={rank.tp_rank}, pp={rank.pp_rank})"
    status, data = _with_retries(
        url, what, lambda: _request(url, "DELETE", "/v1/register", body, timeout, key),
        retries=retries, backoff=backoff, max_backoff=max_backoff)
    if status != 200:
        raise _reject(what, status, data)
    return _decode(data, DeregisterReply, what).removed


def lookup(url: str, instance: str, *, filters: RankFilter | None = None,
           wait_timeout: float = 60.0, poll_interval: float = 0.25, timeout: float = 5.0
           ) -> InstanceInfo:
    """Wait until every rank of ``instance`` has registered, then return it (only the
    ranks ``filters`` selects). Polls every ``poll_interval`` seconds until
    ``wait_timeout`` seconds have passed (0: ask once); each poll may take ``timeout``
    more, so it returns or raises within about ``wait_timeout + timeout`` seconds. An
    unknown instance and an unreachable server are waited out too, since decode may
    start before prefill or before the server.

    Raises :class:`BootstrapTimeout` naming the missing ranks (or saying the instance is
    unknown) when the wait runs out, :class:`BootstrapUnavailable` if the server never
    answered during the wait, and :class:`BootstrapRejected` at once on a request the
    server refuses (a bad filter, an invalid name).
    """
    query = filters.query() if filters else ""
    path = f"/v1/instances/{urllib.parse.quote(instance, safe='')}" + (f"?{query}" if query else "")
    what = f"lookup of instance {instance!r}"
    deadline = time.monotonic() + max(0.0, wait_timeout)
    interval = max(poll_interval, 0.001)
    max_polls = int(max(0.0, wait_timeout) / interval) + 2  # bound the count, not just time
    polls = 0
    answer: NotReady | str | None = None  # the server's last word, if it ever answered
    failure = ""  # the last network (or 5xx) failure
    while True:
        polls += 1
        try:
            status, data = _request(url, "GET", path, None, timeout)
        except _NETWORK_ERRORS as e:
            failure = f"{type(e).__name__}: {e}"
        else:
            if status == 200:
                return _decode(data, InstanceInfo, what)
            if status == 404:
                answer = "the instance is unknown (no rank of it has registered)"
            elif status == 503 and (nr := _not_ready(data)) is not None:
                answer = nr
            elif _transient(status):
                failure = _describe(status, data)
            else:
                raise _reject(what, status, data)
        left = deadline - time.monotonic()
        if left <= 0 or polls >= max_polls:
            break
        time.sleep(min(interval, left))
    if answer is None:
        raise BootstrapUnavailable(f"{what}: bootstrap server {url} did not answer in "
                                   f"{wait_timeout:g} s ({polls} attempts); last error: "
                                   f"{failure}", attempts=polls, last_error=failure)
    if isinstance(answer, NotReady):
        shown = ", ".join(map(str, answer.missing))
        more = answer.missing_count - len(answer.missing)
        raise BootstrapTimeout(
            f"{what}: not ready after {wait_timeout:g} s; {answer.registered} of "
            f"{answer.expected} ranks registered, missing {shown}"
            + (f" and {more} more" if more > 0 else ""),
            missing=list(answer.missing), missing_count=answer.missing_count)
    raise BootstrapTimeout(f"{what}: not ready after {wait_timeout:g} s; {answer}",
                           missing=[], missing_count=0)


def _not_ready(data: bytes) -> NotReady | None:
    try:
        return decode_as(data, NotReady)
    except msgspec.MsgspecError:
        return None  # a 503 that is not ours (a proxy, a server shutting down)


def health(url: str, *, timeout: float = 2.0) -> Health:
    """One liveness probe (no retries: callers that heartbeat count failures themselves).
    Raises :class:`BootstrapUnavailable` if the server does not answer 200."""
    try:
        status, data = _request(url, "GET", "/health", None, timeout)
    except _NETWORK_ERRORS as e:
        last = f"{type(e).__name__}: {e}"
        raise BootstrapUnavailable(f"health: bootstrap server {url} unreachable: {last}",
                                   attempts=1, last_error=last) from e
    if status != 200:
        last = _describe(status, data)
        raise BootstrapUnavailable(f"health: bootstrap server {url} unhealthy: {last}",
                                   attempts=1, last_error=last)
    return _decode(data, Health, "health")

