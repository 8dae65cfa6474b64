"""Authenticated control messages: the MAC a sender adds to each one, and the receiver's
check. Sans-IO and standard library only; the clock is passed in.

**Why per-message MACs, not ZeroMQ CURVE.** Every party of a deployment already holds
the one deployment secret (:mod:`~kvhandoff.secret`), so a MAC keyed by its
:data:`~kvhandoff.secret.PURPOSE_CONTROL` subkey proves "one of us" without a
key exchange. The MAC binds the sender's endpoint (the name a peer is known by, which
unauthenticated ZeroMQ takes from a ``ROUTING_ID`` anyone can choose) to the secret
inside the frame path the channel already has: no ZAP handler thread, no libsodium, no
per-peer key distribution. HMAC-SHA256 of a small frame is about a microsecond in C
(signing or checking one, Python included, a few). What CURVE would add and this does
not: encryption (control messages travel in clear, as the KV bytes do) and refusal at
connection time (a stranger can still open a connection; everything it sends is dropped
unread). With a key the channel's DEALERs set no ``ROUTING_ID``: the ROUTER names each
connection itself, and the sender's endpoint is the one in the verified header, so a
stranger cannot take over a peer's route by connecting under its name (ZeroMQ's
``ROUTER_HANDOVER`` would otherwise hand it the peer's connection and leave the peer's
own link silently dead).

**The envelope.** An authenticated message is one ZeroMQ frame: this module's header,
then the message's own bytes (:func:`~kvhandoff.protocol.encode_message`, exactly what
an unauthenticated deployment sends; :meth:`Signer.seal` / :meth:`Verifier.open`)::

    frame  = header | payload
    header = MAGIC(4) | tag(16) | ts_ms(8) | epoch_start_ms(8) | epoch_nonce(8) | seq(8)
             | sender length(2) | sender
    tag    = HMAC-SHA256(key, sender | recipient | stream | ts_ms | epoch | seq | payload)[:16]

* ``MAGIC`` (``KVA1``) cannot begin a plain message (a msgpack map), so each side can
  tell "my peer has no secret" (or "has one and I do not") from a forgery, and say so.
* ``sender`` / ``recipient``: the endpoints (length-prefixed in the MAC). The receiver
  takes the sender from the header (for a reply on one of its DEALERs it must be the
  endpoint that DEALER dials) and puts in its own endpoint: a frame captured on its way
  to one agent is worthless at another, and nobody can speak under another's name.
* ``stream``: which of the sender's sockets it left on (its DEALER to us, or its ROUTER
  answering our DEALER). Each stream is in order; the two are not with each other.
* ``ts_ms``: the sender's wall clock. A frame more than :data:`WINDOW_S` from the
  receiver's clock is refused (a stale replay, or clocks out of sync: keep them in NTP).
* ``epoch``: the sender's channel start (wall-clock ms) and a 64-bit nonce drawn for
  this recipient and stream (a peer learns only the nonces of the frames sent to it);
  ``seq``: one counter per channel. Per (sender, stream) the receiver keeps the highest
  seq accepted in each of the last :data:`MAX_EPOCHS` epochs it heard: a seq not above
  it is a replay. An epoch may not start after its own frame's timestamp.
* The tag is truncated to 128 bits (HMAC-SHA-256-128, as IPsec uses, RFC 4868): a
  forgery can only be tried online, one message per guess, so 2^-128 per try is as out
  of reach as 2^-256, and 16 bytes fewer per tiny message.

Only a frame whose MAC verified touches the replay state, so strangers cannot fill or
evict it; it holds at most :data:`MAX_SENDERS` (sender, stream) pairs, the least
recently heard forgotten first, and per pair at most :data:`MAX_EPOCHS` epochs, the
least recently heard forgotten first (a forgotten sender's or epoch's next frame starts
afresh, so one of its frames from the last :data:`WINDOW_S` could then be replayed once;
only key holders can make us forget). An agent that restarts at the same endpoint within
the window may be handed frames captured on their way to its previous run.

**Why every epoch, not the newest** (finding "lower", a frame signed under another
peer's name): every holder of the deployment secret can sign a frame naming any sender.
Had the receiver kept only the newest epoch per sender, one frame naming peer X with an
epoch that starts in the future (or with X's own epoch and the largest sequence number)
would have made every later frame of X look like a replay: X's link silenced for the
run. Now such a frame only adds an epoch of its own; X's epoch and its sequence numbers
are untouched, and X's nonce towards this receiver is not in any frame another peer
gets. (A holder of the secret can still *speak* as X; what it may then do to a request
is bounded by the request's own checks, e.g. :mod:`kvhandoff.binding`.) The price: a
frame X sent in an earlier run, never delivered and replayed within the window, is
accepted once.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import hmac
import secrets
import struct
import threading

__all__ = ["HEADER_BYTES", "MAGIC", "MAX_ENDPOINT_BYTES", "MAX_EPOCHS", "MAX_SENDERS",
           "TAG_BYTES",
           "UNAUTHENTICATED",
           "WINDOW_S", "Signer", "Stream", "Unauthenticated", "Verifier", "is_signed"]

MAGIC = b"KVA1"
TAG_BYTES = 16
_HEADER = struct.Struct(">4s16sQQQQH")  # magic, tag, ts_ms, epoch start, nonce, seq, len
_SIGNED = struct.Struct(">QQQQ")  # the fixed header fields the tag covers
HEADER_BYTES = _HEADER.size
"""Bytes of a header before the sender's endpoint."""
MAX_ENDPOINT_BYTES = 1024
WINDOW_S = 120.0
"""A frame's timestamp may be this far from the receiver's clock, either way."""
MAX_SENDERS = 4096
"""(sender, stream) pairs whose replay state is kept."""
MAX_EPOCHS = 8
"""Epochs (runs of a sender's channel, and any a key holder made up under its name) whose
highest sequence number is kept per (sender, stream)."""
UNAUTHENTICATED = ("control message not authenticated: is KVHANDOFF_SECRET_FILE the same "
                   "on both sides?")
"""All an agent tells a peer whose message it refused (nothing about why)."""

_U64 = (1 << 64) - 1


class Stream(enum.Enum):
    """Which of the sender's sockets a frame left on."""

    DEALER = b"D"  # the sender's DEALER: arrives on the receiver's ROUTER
    ROUTER = b"R"  # the sender's ROUTER, answering: arrives on the receiver's DEALER


class Unauthenticated(Exception):
    """A frame failed the check; ``reason`` says why, for this side's log only."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def is_signed(frame: bytes) -> bool:
    """Whether ``frame`` is an authentication header (not a plain message)."""
    return frame[:len(MAGIC)] == MAGIC


def _ms(now: float) -> int:
    return max(0, min(_U64, int(now * 1000)))


def _bound(name: bytes) -> bytes:
    return len(name).to_bytes(2, "big") + name


def _names(sender: bytes, recipient: bytes, stream: Stream) -> bytes:
    return _bound(sender) + _bound(recipient) + stream.value


_ONE_UPDATE = 64 << 10  # payloads up to this are joined to the fields (one update call)


class _Mac:
    """HMAC-SHA256 of the signed fields and the payload, truncated. The key schedule is
    done once; each message copies it (cheaper here than ``hmac.digest``'s one shot)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("a control key needs at least 16 bytes")
        self._base = hmac.new(key, digestmod=hashlib.sha256)

    def tag(self, names: bytes, signed: bytes, payload: bytes | memoryview) -> bytes:
        """``names``: :func:`_names` of the frame's sender, recipient and stream."""
        h = self._base.copy()
        head = names + signed
        if len(payload) <= _ONE_UPDATE:
            h.update(head + payload)
        else:  # never copy a big payload
            h.update(head)
            h.update(payload)
        return h.digest()[:TAG_BYTES]


class Signer:
    """Signs what one channel sends. Thread-safe: sequence numbers are taken under a
    lock, so frames signed one after another on a stream carry increasing numbers
    (the caller signs each stream's frames in the order they leave).

    ``endpoint``: the channel's own endpoint (its ``ROUTING_ID``); ``now``: wall-clock
    seconds when the channel starts (the epoch's start); ``nonce``: seeds the epoch
    nonces, tests only (random by default)."""

    def __init__(self, key: bytes, *, endpoint: str, now: float, nonce: int | None = None
                 ) -> None:
        self._mac = _Mac(key)
        self._me = endpoint.encode()
        if len(self._me) > MAX_ENDPOINT_BYTES:
            raise ValueError(f"endpoint of {len(self._me)} B (at most {MAX_ENDPOINT_BYTES})")
        self.start = _ms(now)
        seed = secrets.randbits(64) if nonce is None else nonce & _U64
        self._nonces = hmac.new(seed.to_bytes(8, "big"), digestmod=hashlib.sha256)
        self._seq = 0
        self._lock = threading.Lock()
        self._tail = _bound(self._me)
        # per (recipient, stream): the MAC's name prefix and this epoch's nonce there
        self._names: dict[tuple[bytes, Stream], tuple[bytes, int]] = {}

    def nonce(self, recipient: bytes, stream: Stream) -> int:
        """The epoch nonce of frames to ``recipient`` on ``stream``: drawn per recipient
        (a keyed hash of its name), so no peer learns the nonce of another's frames."""
        h = self._nonces.copy()
        h.update(_bound(recipient) + stream.value)
        return int.from_bytes(h.digest()[:8], "big")

    def seal(self, payload: bytes, *, recipient: bytes, stream: Stream, now: float) -> bytes:
        """The frame to send: :meth:`sign`'s header, then ``payload``."""
        return self.sign(payload, recipient=recipient, stream=stream, now=now) + payload

    def sign(self, payload: bytes, *, recipient: bytes, stream: Stream, now: float) -> bytes:
        """The header to send before ``payload`` (to ``recipient``: the endpoint dialed,
        or the endpoint of the peer answered)."""
        with self._lock:
            self._seq += 1
            seq = self._seq
            known = self._names.get((recipient, stream))
            if known is None:
                if len(self._names) >= MAX_SENDERS:
                    self._names.clear()
                known = self._names[(recipient, stream)] = (
                    _names(self._me, recipient, stream), self.nonce(recipient, stream))
        names, nonce = known
        signed = _SIGNED.pack(_ms(now), self.start, nonce, seq)
        return MAGIC + self._mac.tag(names, signed, payload) + signed + self._tail


class Verifier:
    """Checks what one channel receives. Thread-safe.

    ``endpoint``: the channel's own endpoint (the recipient every frame to it names)."""

    def __init__(self, key: bytes, *, endpoint: str, window: float = WINDOW_S,
                 max_senders: int = MAX_SENDERS, max_epochs: int = MAX_EPOCHS) -> None:
        self._mac = _Mac(key)
        self._me = endpoint.encode()
        self.window = window
        self.max_senders = max_senders
        self.max_epochs = max_epochs
        self._lock = threading.Lock()
        # (sender, stream) → its epochs (start, nonce) → the highest seq accepted in each;
        # both least recently heard first
        self._seen: collections.OrderedDict[tuple[bytes, bytes],
                                            collections.OrderedDict[tuple[int, int], int]] = \
            collections.OrderedDict()

    def open(self, frame: bytes, *, stream: Stream, now: float, sender: bytes | None = None
             ) -> tuple[memoryview, bytes]:
        """The payload of a frame :meth:`Signer.seal` made (a view, not a copy) and the
        sender its header names, once :meth:`check` passed; raises
        :class:`Unauthenticated` otherwise."""
        n = int.from_bytes(frame[HEADER_BYTES - 2:HEADER_BYTES], "big") \
            if len(frame) >= HEADER_BYTES else 0
        payload = memoryview(frame)[HEADER_BYTES + n:]
        return payload, self.check(frame[:HEADER_BYTES + n], payload, stream=stream,
                                   now=now, sender=sender)

    def check(self, header: bytes, payload: bytes | memoryview, *, stream: Stream,
              now: float, sender: bytes | None = None) -> bytes:
        """The sender's endpoint if ``payload`` is authentic, fresh and new from it on
        ``stream`` (and remember it); else raise :class:`Unauthenticated`, remembering
        nothing. ``sender``: who it must come from, when the receiver knows (a reply on
        a DEALER: the endpoint dialed)."""
        if len(header) < HEADER_BYTES or not is_signed(header):
            raise Unauthenticated("no MAC (does the peer have the deployment secret?)")
        _, tag, ts, start, nonce, seq, n = _HEADER.unpack_from(header)
        named = header[HEADER_BYTES:]
        if len(named) != n or n > MAX_ENDPOINT_BYTES:
            raise Unauthenticated("malformed header")
        if sender is not None and named != sender:
            raise Unauthenticated(f"names sender {named[:100]!r}, but came from {sender!r}")
        want = self._mac.tag(_names(named, self._me, stream),
                             header[4 + TAG_BYTES:HEADER_BYTES - 2], payload)
        if not hmac.compare_digest(want, tag):
            raise Unauthenticated("bad MAC (a different deployment secret, or an altered "
                                  "or misaddressed message)")
        skew = ts / 1000 - now
        if abs(skew) > self.window:
            raise Unauthenticated(f"timestamp {skew:+.0f} s from this agent's clock, outside "
                                  f"the ±{self.window:g} s window (a replay, or clocks out "
                                  f"of sync)")
        if start > ts:
            raise Unauthenticated("its channel starts after the frame was signed")
        self._remember((named, stream.value), (start, nonce), seq)
        return named

    def _remember(self, key: tuple[bytes, bytes], epoch: tuple[int, int], seq: int) -> None:
        """Accept ``seq`` of ``epoch`` from ``key`` (sender, stream), or raise if it is
        not above the highest seen there. Bounded: see the module docstring."""
        with self._lock:
            epochs = self._seen.get(key)
            if epochs is None:
                epochs = self._seen[key] = collections.OrderedDict()
                while len(self._seen) > self.max_senders:
                    self._seen.popitem(last=False)
            last = epochs.get(epoch)
            if last is not None and seq <= last:
                raise Unauthenticated(f"replayed (sequence {seq}, already at {last})")
            epochs[epoch] = seq
            epochs.move_to_end(epoch)
            while len(epochs) > self.max_epochs:
                epochs.popitem(last=False)
            self._seen.move_to_end(key)

    @property
    def senders(self) -> int:
        """(sender, stream) pairs remembered."""
        with self._lock:
            return len(self._seen)
