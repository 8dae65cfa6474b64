"""Signed bootstrap requests: the MAC a registering rank adds, and the server's check.

Sans-IO and standard library only (the client side runs in worker processes that import
no aiohttp). The key is the deployment secret's
:data:`~kvhandoff.secret.PURPOSE_BOOTSTRAP` key, shared by the server and every
prefill rank.

A signed request carries three headers::

    X-Kvhandoff-Timestamp: 1764088000          unix seconds of the signer's clock
    X-Kvhandoff-Nonce:     32 hex digits        fresh random per request (and per retry)
    X-Kvhandoff-Signature: v1=<64 hex digits>   HMAC-SHA256(key, canonical request)

where the canonical request is ``v1``, the method, the path (with its query string),
the timestamp, the nonce and the SHA-256 of the body, one per line. The server
(:class:`Verifier`) accepts a request only if the MAC matches, the timestamp is within
``window`` seconds of its own clock (either side, for skew), and that signature was not
accepted before: it remembers each accepted signature until its timestamp leaves the
window, after which the timestamp check refuses a replay anyway. The memory is bounded
(``max_remembered``); only signatures that verified are remembered, so only key holders
can fill it, and a full memory refuses (503) rather than forgets.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import re
import secrets
import threading
from collections.abc import Mapping

__all__ = ["NONCE", "SIGNATURE", "TIMESTAMP", "AuthRefused", "Verifier", "sign"]

TIMESTAMP = "X-Kvhandoff-Timestamp"
NONCE = "X-Kvhandoff-Nonce"
SIGNATURE = "X-Kvhandoff-Signature"
_VERSION = "v1"
_NONCE_RE = re.compile(r"^[0-9a-f]{32}$")
_SIG_RE = re.compile(r"^v1=([0-9a-f]{64})$")
_TS_RE = re.compile(r"^[0-9]{1,12}$")


def _mac(key: bytes, method: str, path: str, timestamp: str, nonce: str, body: bytes) -> str:
    canonical = "\n".join((_VERSION, method.upper(), path, timestamp, nonce,
                           hashlib.sha256(body).hexdigest()))
    return hmac.new(key, canonical.encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, method: str, path: str, body: bytes, *, now: float,
         nonce: str | None = None) -> dict[str, str]:
    """The three headers that authenticate ``method path`` with ``body`` at time ``now``
    (``nonce``: tests only; a fresh random one by default)."""
    ts, nonce = str(int(now)), nonce or secrets.token_hex(16)
    return {TIMESTAMP: ts, NONCE: nonce,
            SIGNATURE: f"{_VERSION}={_mac(key, method, path, ts, nonce, body)}"}


class AuthRefused(Exception):
    """The request is not authenticated: ``status`` (401, or 503 when the replay memory
    is full) and a ``reason`` a person can act on."""

    def __init__(self, reason: str, status: int = 401) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


class Verifier:
    """Checks signed requests against one key. Thread-safe; the clock is passed in."""

    def __init__(self, key: bytes, *, window: float = 60.0, max_remembered: int = 65536
                 ) -> None:
        self._key = key
        self.window = window
        self.max_remembered = max_remembered
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._expiry: list[tuple[float, str]] = []  # heap of (forget after, signature)

    def check(self, method: str, path: str, body: bytes, headers: Mapping[str, str], *,
              now: float) -> None:
        """Return if the request is authentic and new (and remember it); raise
        :class:`AuthRefused` naming why not. Nothing is remembered for a refusal."""
        ts, nonce, sig = (headers.get(h) for h in (TIMESTAMP, NONCE, SIGNATURE))
        missing = [h for h, v in ((TIMESTAMP, ts), (NONCE, nonce), (SIGNATURE, sig))
                   if v is None]
        if missing:
            raise AuthRefused(f"{method} {path}: not signed (missing {', '.join(missing)}); "
                              "this bootstrap server requires requests signed with the "
                              "deployment secret (KVHANDOFF_SECRET_FILE)")
        assert ts is not None and nonce is not None and sig is not None
        m = _SIG_RE.match(sig)
        if not (_TS_RE.match(ts) and _NONCE_RE.match(nonce) and m):
            raise AuthRefused(f"{method} {path}: malformed signature headers "
                              f"(want {TIMESTAMP}: unix seconds, {NONCE}: 32 hex digits, "
                              f"{SIGNATURE}: v1=64 hex digits)")
        want = _mac(self._key, method, path, ts, nonce, body)
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
