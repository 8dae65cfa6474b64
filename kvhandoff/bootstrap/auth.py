"""Signed bootstrap requests: the MAC a registering rank adds, and the server's check.

Sans-IO and standard library only (the client side runs in worker processes that import
no aiohttp). The key is the deployment secret's
:data:`~kvhandoff.secret.PURPOSE_BOOTSTRAP` key, shared by the server and every
prefill rank.

A signed request carries four headers::

    X-Kvhandoff-Timestamp: 1764088000          unix seconds of the signer's clock
    X-Kvhandoff-Nonce:     32 hex digits        fresh random per request (and per retry)
    X-Kvhandoff-Server:    32 hex digits        the server run it is meant for
    X-Kvhandoff-Signature: v2=<64 hex digits>   HMAC-SHA256(key, canonical request)

where the canonical request is ``v2``, the method, the path (with its query string),
the timestamp, the nonce, the server run and the SHA-256 of the body, one per line. The
server (:class:`Verifier`) accepts a request only if it names this server's run (a
random id drawn when the server starts, which ``GET /health`` tells), the MAC matches,
the timestamp is within ``window`` seconds of its own clock (either side, for skew), and
that signature was not accepted before: it remembers each accepted signature until its
timestamp leaves the window, after which the timestamp check refuses a replay anyway.
The memory is bounded (``max_remembered``); only signatures that verified are
remembered, so only key holders can fill it, and a full memory refuses (503) rather than
forgets.

Why the server run: the memory of used signatures is one server's, and lasts one run. A
request signed for one server would otherwise be accepted once more by a second server
holding the same secret, or by the same server restarted, within the window (finding
"lower"): a deregistration replayed at a fresh server, say. Naming the run costs a
signer one ``GET /health`` per request.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import re
import secrets
import threading
from collections.abc import Mapping

__all__ = ["NONCE", "SERVER", "SIGNATURE", "TIMESTAMP", "AuthRefused", "Verifier",
           "new_server_id", "sign"]

TIMESTAMP = "X-Kvhandoff-Timestamp"
NONCE = "X-Kvhandoff-Nonce"
SERVER = "X-Kvhandoff-Server"
SIGNATURE = "X-Kvhandoff-Signature"
_VERSION = "v2"
_NONCE_RE = re.compile(r"^[0-9a-f]{32}$")  # the nonce, and a server run's id
_SIG_RE = re.compile(r"^v2=([0-9a-f]{64})$")
_TS_RE = re.compile(r"^[0-9]{1,12}$")


def _mac(key: bytes, method: str, path: str, timestamp: str, nonce: str, server: str,
         body: bytes) -> str:
    canonical = "\n".join((_VERSION, method.upper(), path, timestamp, nonce, server,
                           hashlib.sha256(body).hexdigest()))
    return hmac.new(key, canonical.encode(), hashlib.sha256).hexdigest()


def new_server_id() -> str:
    """A server run's id: drawn once when a server starts, told by ``GET /health``."""
    return secrets.token_hex(16)


def sign(key: bytes, method: str, path: str, body: bytes, *, now: float, server: str,
         nonce: str | None = None) -> dict[str, str]:
    """The headers that authenticate ``method path`` with ``body`` at time ``now`` for
    the server run ``server`` (its ``/health`` ``server_id``); ``nonce``: tests only (a
    fresh random one by default)."""
    ts, nonce = str(int(now)), nonce or secrets.token_hex(16)
    return {TIMESTAMP: ts, NONCE: nonce, SERVER: server,
            SIGNATURE: f"{_VERSION}={_mac(key, method, path, ts, nonce, server, body)}"}


class AuthRefused(Exception):
    """The request is not authenticated: ``status`` (401, or 503 when the replay memory
    is full) and a ``reason`` a person can act on."""

    def __init__(self, reason: str, status: int = 401) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


class Verifier:
    """Checks signed requests against one key, for the server run ``server`` (its id,
    :func:`new_server_id`). Thread-safe; the clock is passed in."""

    def __init__(self, key: bytes, *, server: str, window: float = 60.0,
                 max_remembered: int = 65536) -> None:
        if not _NONCE_RE.match(server):
            raise ValueError(f"a server run's id is 32 hex digits, got {server!r}")
        self._key = key
        self.server = server
        self.window = window
        self.max_remembered = max_remembered
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._expiry: list[tuple[float, str]] = []  # heap of (forget after, signature)

    def check(self, method: str, path: str, body: bytes, headers: Mapping[str, str], *,
              now: float) -> None:
        """Return if the request is authentic and new (and remember it); raise
        :class:`AuthRefused` naming why not. Nothing is remembered for a refusal."""
        ts, nonce, server, sig = (headers.get(h) for h in (TIMESTAMP, NONCE, SERVER,
                                                            SIGNATURE))
        missing = [h for h, v in ((TIMESTAMP, ts), (NONCE, nonce), (SERVER, server),
                                  (SIGNATURE, sig)) if v is None]
        if missing:
            raise AuthRefused(f"{method} {path}: not signed (missing {', '.join(missing)}); "
                              "this bootstrap server requires requests signed with the "
                              "deployment secret (KVHANDOFF_SECRET_FILE)")
        assert ts is not None and nonce is not None and server is not None and sig is not None
        m = _SIG_RE.match(sig)
        if not (_TS_RE.match(ts) and _NONCE_RE.match(nonce) and m):
            raise AuthRefused(f"{method} {path}: malformed signature headers "
                              f"(want {TIMESTAMP}: unix seconds, {NONCE}: 32 hex digits, "
                              f"{SERVER}: 32 hex digits, {SIGNATURE}: v2=64 hex digits)")
        if not hmac.compare_digest(server, self.server):
            raise AuthRefused(f"{method} {path}: signed for bootstrap server run "
                              f"{server[:32]!r}, not this one ({self.server}): a request "
                              "meant for another server, or for this one before it "
                              "restarted (a replay?); sign again after GET /health")
        want = _mac(self._key, method, path, ts, nonce, server, body)
        if not hmac.compare_digest(want, m.group(1)):
            raise AuthRefused(f"{method} {path}: bad signature (a different deployment "
                              "secret, or the request was altered)")
        skew = now - int(ts)
        if abs(skew) > self.window:
            raise AuthRefused(f"{method} {path}: timestamp {ts} is {skew:+.0f} s from this "
                              f"server's clock, outside the ±{self.window:g} s window "
                              "(a replay, or clocks out of sync)")
        with self._lock:
            self._forget(now)
            if want in self._seen:
                raise AuthRefused(f"{method} {path}: this signature was already used "
                                  "(a replayed request)")
            if len(self._seen) >= self.max_remembered:
                raise AuthRefused(f"{method} {path}: more than {self.max_remembered} signed "
                                  f"requests within {self.window:g} s; try again later",
                                  status=503)
            self._seen.add(want)
            heapq.heappush(self._expiry, (int(ts) + self.window, want))

    def _forget(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(heapq.heappop(self._expiry)[1])

    @property
    def remembered(self) -> int:
        with self._lock:
            return len(self._seen)
