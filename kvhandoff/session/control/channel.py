"""ZeroMQ plumbing: one agent's control sockets, owned by one I/O thread.

Sockets (all in this channel's own ``zmq.Context``, terminated by :meth:`close`):

* one **ROUTER** bound at ``tcp://host:port``: every message a peer sends us arrives
  here. Its connections are capped below the descriptor limit, and running out of
  descriptors neither spins nor floods the log (:mod:`~kvhandoff.session.control.door`).
  Without a key, peers' DEALERs carry their own control endpoint as ``ROUTING_ID``,
  so the identity tells who spoke (:class:`Origin`); with one, the ROUTER names each
  connection and the verified header tells who spoke.
* one **DEALER** per peer endpoint we send to, connected lazily, ``ROUTING_ID`` = our
  endpoint (none with a key). Replies a peer sends back on its ROUTER (heartbeat acks,
  error replies) arrive on these and are handled like any other message. Each DEALER
  sends ZMTP heartbeats, which the peer's libzmq answers without its Python, and its
  monitor tells whether the link is up (:mod:`~kvhandoff.session.control.links`,
  :meth:`ControlChannel.link_up`): how liveness tells a busy peer from a dead one.

Sending is direct: :meth:`send` writes to the peer's DEALER on the caller's thread,
under the channel's dealer lock (a mutex is the full barrier ZeroMQ asks for when a
socket is used by several threads, never at once), so a status leaves the process
from the thread that decided it, without waking the I/O thread. The I/O thread never
passes a DEALER to ``zmq_poll``: it polls each DEALER's notification descriptor
(``ZMQ_FD``) and reads the DEALERs under the same lock; a sender that finds input
pending after its send (it may have consumed that edge) wakes the I/O thread. Only
the I/O thread closes sockets (retired DEALERs are handed to it).

Authentication (with a key: the deployment secret's control key, see
:mod:`~kvhandoff.session.control.auth`, which also says why MACs and not CURVE): every
message leaves as one frame, a signed header and then the message, and every message
that arrives is checked before it is decoded: the MAC over the sender's endpoint (the one
its header names, which for a reply on our DEALER must be the endpoint it dials) and
ours, its timestamp, and its sequence number against replays; the verified endpoint is
the :class:`Origin`'s. One that fails is dropped unread and counted in
``stats["unauthenticated"]``, logged at a bounded rate, and, if it came on the ROUTER,
answered with an :class:`ErrorReply` saying only
:data:`~kvhandoff.session.control.auth.UNAUTHENTICATED`. A reply on one of our DEALERs
that fails (or, without a key, one that is signed) goes to ``on_unauthenticated`` with
the endpoint and why: the peer there does not hold our secret, which a decode rank's
handshake reports at once. Without a key the channel sends and takes plain one-frame
messages (loopback development); a signed message is then refused, naming the cause
(a plain message never starts with the header's magic bytes).

Bytes in, messages out: every frame goes through :func:`~kvhandoff.protocol.decode_message`.
Anything that does not decode (junk, an unknown tag, an extra frame, an oversized
message up to twice the protocol limit) is answered with an ``ErrorReply`` on the ROUTER
and counted; a handler that raises is logged with its traceback and counted. Neither ever
stops the thread. (Frames beyond twice the limit make ZeroMQ drop that connection: no
peer of ours sends them, and reading them would let anyone make us allocate at will.)

Thread-safety: :meth:`send`, :meth:`reply`, :meth:`forget` and :meth:`close` may be called
from any thread. ``send`` writes at once (above); ``reply`` (on the ROUTER) and
socket closes are queued for the I/O thread, which is woken through a pipe (no polling
while idle). Messages to one endpoint leave in the order their ``send`` calls took the
lock. ``on_message``, ``on_tick`` and ``on_undeliverable`` run on the I/O thread, one at
a time, and must not block; ``on_drained`` runs there too, after each round of reading
(every message that was ready handled, up to a bound per socket) and after each tick.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from kvhandoff.protocol import (
    MAX_MESSAGE_BYTES,
    ErrorReply,
    Message,
    ProtocolError,
    decode_message,
    encode_message,
)
from kvhandoff.session.control.auth import (
    UNAUTHENTICATED,
    Signer,
    Stream,
    Unauthenticated,
    Verifier,
    is_signed,
)
from kvhandoff.session.control.door import ControlDoor
from kvhandoff.session.control.links import heartbeat, link_up
from kvhandoff.transport.throttle import Throttle

log = logging.getLogger("kvhandoff.session.control.channel")
_malformed = Throttle(log)  # junk is counted in stats; logged at most every 10 s
_unauthenticated = Throttle(log)  # as junk, but apart: one must not hide the other
_NO_KEY = ("control message is signed but this agent has no deployment secret: is "
           "KVHANDOFF_SECRET_FILE the same on both sides?")

_BATCH = 256  # messages read from one socket per wake-up, so no socket starves the others
_HWM = 100_000
_JOIN_S = 5.0
_IDLE_S = 600.0  # a DEALER unused this long is closed (re-dialled on the next send)


@dataclass(frozen=True, slots=True)
class Origin:
    """Who sent a message. ``endpoint``: the peer's control endpoint when known;
    ``identity``: the ROUTER identity to answer on (None when it came on a DEALER)."""

    endpoint: str | None
    identity: bytes | None

    def __str__(self) -> str:
        return self.endpoint or f"<unnamed client {self.identity!r}>"


MessageHandler = Callable[[Origin, Message], None]
TickHandler = Callable[[float], None]
FailureHandler = Callable[[str, str], None]  # (peer endpoint, why)


class ControlChannel:
    """The control sockets of one agent; see the module docstring for the contract."""

    def __init__(self, *, host: str, port: int, dial_host: str, on_message: MessageHandler,
                 on_tick: TickHandler, on_undeliverable: FailureHandler, tick: float,
                 name: str = "agent", flush_timeout: float = 0.25, key: bytes | None = None,
                 on_unauthenticated: FailureHandler | None = None,
                 on_drained: Callable[[], None] | None = None,
                 heartbeat_interval: float = 1.0, heartbeat_timeout: float = 5.0) -> None:
        self._on_message = on_message
        self._beat = (heartbeat_interval, heartbeat_timeout)  # the DEALERs' ZMTP heartbeat
        self._on_drained = on_drained
        self._on_tick = on_tick
        self._on_undeliverable = on_undeliverable
        self._on_unauthenticated = on_unauthenticated
        self._signer: Signer | None = None
        self._verifier: Verifier | None = None
        self._tick = tick
        self._flush_ms = int(flush_timeout * 1000)
        self.stats: collections.Counter[str] = collections.Counter()
        self._ctx = zmq.Context()
        self._router: zmq.Socket[bytes] | None = None
        self._door: ControlDoor | None = None
        self._wake_r, self._wake_w = -1, -1
        self._fd_lock = threading.Lock()  # no write to, or close of, a wake fd once closed
        try:
            router = self._ctx.socket(zmq.ROUTER)
            self._router = router
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            router.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_MESSAGE_BYTES)
            router.setsockopt(zmq.RCVHWM, _HWM)
            router.setsockopt(zmq.SNDHWM, _HWM)
            self._door = ControlDoor(self._ctx, router, name=name)
            port = self._door.bind("*" if host in ("0.0.0.0", "") else host, port)
            self.endpoint = f"tcp://{dial_host}:{port}"
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            if key is not None:
                self._signer = Signer(key, endpoint=self.endpoint, now=time.time())
                self._verifier = Verifier(key, endpoint=self.endpoint)
        except BaseException:
            self._teardown()
            raise
        self._out: collections.deque[tuple[str, Any, Any]] = collections.deque()
        self._armed = False
        self._stop = False
        # Guarded by _dlock (and every operation on a DEALER socket is made under it):
        self._dlock = threading.Lock()
        self._closing = False  # no more sends: the I/O thread is closing the DEALERs
        self._dealers: dict[str, _Dealer] = {}
        self._retired: list[_Dealer] = []  # to be closed by the I/O thread
        self._thread = threading.Thread(target=self._run, name=f"kvh-io-{name}", daemon=True)
        self._thread.start()

    # --- any thread ----------------------------------------------------------------

    def send(self, endpoint: str, msg: Message) -> None:
        """Send ``msg`` to the peer at ``endpoint`` now, from this thread. Raises
        LocalProtocolError when it cannot be encoded (a local bug); delivery problems go
        to ``on_undeliverable`` (on the I/O thread)."""
        buf = encode_message(msg)
        problem: str | None = None
        wake = False
        with self._dlock:
            if self._closing:
                return
            try:
                d = self._dealers.get(endpoint)
                if d is None:
                    d = self._open_dealer(endpoint)
                    wake = True  # the I/O thread watches the new DEALER
                if self._signer is None:
                    d.sock.send(buf, zmq.NOBLOCK)
                else:  # signed here, under the lock: this DEALER's frames stay in order
                    d.sock.send(self._signer.seal(buf, recipient=d.name, stream=Stream.DEALER,
                                                  now=time.time()), zmq.NOBLOCK)
                d.used = time.monotonic()
                self.stats["sent"] += 1
                # our send may have consumed the descriptor's edge for a pending reply
                wake |= _readable(d.sock)
            except zmq.Again:
                problem = (f"control queue to {endpoint} is full ({_HWM} messages): the peer "
                           f"is not reading")
            except zmq.ZMQError as e:
                problem = f"cannot send to control endpoint {endpoint!r}: {e}"
        if problem is not None:
            self._push(("undeliverable", endpoint, problem))
        elif wake:
            self._push(("sync", "", b""))

    def reply(self, origin: Origin, msg: Message) -> None:
        """Answer ``origin`` on the connection it spoke on (works for unnamed clients)."""
        if origin.identity is not None:
            self._answer(origin, encode_message(msg))
        elif origin.endpoint is not None:
            self.send(origin.endpoint, msg)

    def forget(self, endpoint: str) -> None:
        """Close our DEALER to ``endpoint`` (a lost peer): messages still queued in it are
        dropped; a later :meth:`send` dials afresh."""
        with self._dlock:
            d = self._dealers.pop(endpoint, None)
            if d is None:
                return
            self._retired.append(d)
        self._push(("sync", "", b""))

    def link_up(self, endpoint: str) -> bool:
        """Whether our DEALER to ``endpoint`` is connected and its peer's libzmq answers
        its ZMTP heartbeats (as of the I/O thread's last look, before each tick). False
        when we have no DEALER to it, or it is not (yet, or any more) connected. I/O
        thread only (the liveness rules ask it on the tick)."""
        with self._dlock:
            d = self._dealers.get(endpoint)
            return d is not None and d.up

    @property
    def authenticated(self) -> bool:
        """Whether this channel signs and checks every message (it has a key)."""
        return self._signer is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Flush what is queued (bounded by ``flush_timeout``), stop the I/O thread, close
        every socket and the context. Idempotent."""
        if self._stop:
            return
        self._stop = True
        self._wake()
        self._thread.join(_JOIN_S + self._flush_ms / 1000)
        if self._thread.is_alive():  # a handler is stuck; sockets belong to that thread
            log.error("control I/O thread %s did not stop within %.1f s",
                      self._thread.name, _JOIN_S)
            return
        self._teardown()

    def _answer(self, origin: Origin, buf: bytes) -> None:
        """Queue ``buf`` for ``origin``'s connection to our ROUTER; signed (on the I/O
        thread) for the endpoint it is from."""
        assert origin.identity is not None
        to = origin.endpoint.encode() if origin.endpoint is not None else origin.identity
        self._push(("router", origin.identity, (buf, to)))

    def _push(self, item: tuple[str, Any, Any]) -> None:
        self._out.append(item)
        if not self._armed:
            self._armed = True
            self._wake()

    def _wake(self) -> None:
        # A full pipe already wakes the thread; dropping this byte loses nothing. Under the
        # lock: once teardown closed the pipe its number may be another socket's.
        with self._fd_lock, contextlib.suppress(BlockingIOError, OSError):
            if self._wake_w >= 0:
                os.write(self._wake_w, b"\0")

    def _open_dealer(self, endpoint: str) -> _Dealer:
        """A DEALER to ``endpoint`` (caller holds the dealer lock)."""
        sock = self._ctx.socket(zmq.DEALER)
        try:
            if self._signer is None:  # with a key, the signed header names us instead
                sock.setsockopt(zmq.ROUTING_ID, self.endpoint.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, _HWM)
            sock.setsockopt(zmq.RCVHWM, _HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            monitor = heartbeat(sock, interval=self._beat[0], timeout=self._beat[1])
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        try:
            sock.connect(endpoint)
            fd = int(sock.getsockopt(zmq.FD))
        except zmq.ZMQError:
            monitor.close(linger=0)
            sock.close(linger=0)
            raise
        d = _Dealer(endpoint, endpoint.encode(), sock, fd, time.monotonic(), monitor)
        self._dealers[endpoint] = d
        return d

    # --- the I/O thread ------------------------------------------------------------

    def _run(self) -> None:
        assert self._router is not None and self._door is not None
        door = self._door
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(door.zap, zmq.POLLIN)
        if door.monitor is not None:
            poller.register(door.monitor, zmq.POLLIN)
        watched: dict[int, _Dealer] = {}  # DEALER descriptors in the poller
        next_tick = time.monotonic() + self._tick
        try:
            while not self._stop:
                wait_ms = max(0, int((next_tick - time.monotonic()) * 1000) + 1)
                for sock, _ in poller.poll(wait_ms):
                    if sock is self._router:
                        self._read_router()
                    elif sock == self._wake_r:
                        self._drain_wake()
                    elif sock is door.zap or sock is door.monitor:
                        self._at_door(sock is door.zap)
                self._read_dealers()  # cheap: a few EVENTS checks; covers lost edges
                self._drained()
                self._flush()
                self._sync(poller, watched)
                now = time.monotonic()
                door.on_tick(now)
                if now >= next_tick:
                    next_tick = now + self._tick
                    self._read_links()  # what liveness asks on the tick is fresh
                    self._guard("tick", functools.partial(self._on_tick, now))
                    self._drained()
                    self._prune(now)
            self._flush()
        except zmq.ZMQError as e:  # the context was terminated under us: nothing to save
            log.error("control I/O thread stopped by ZeroMQ: %s", e)
        finally:
            with self._dlock:
                self._closing = True
                for d in self._dealers.values():
                    d.close(linger=self._flush_ms)  # what was sent still goes out
                for d in self._retired:
                    d.close(linger=0)
                self._dealers.clear()
                self._retired.clear()

    def _at_door(self, zap: bool) -> None:
        """Connections knocking (ZAP) or coming and going (monitor): see door.py."""
        door = self._door
        assert door is not None
        now = time.monotonic()
        door.on_zap(now) if zap else door.on_monitor(now)
        self.stats["accept_failed"] = door.accept_failures
        self.stats["connections_refused"] = door.refused

    def in_io_thread(self) -> bool:
        """Whether the caller is this channel's I/O thread (where handlers run)."""
        return threading.get_ident() == self._thread.ident

    def _drained(self) -> None:
        """Every message that was ready has been handled: ``on_drained`` (prefill submits
        the writes they produced, batched; see :mod:`kvhandoff.session.control.write_batch`)."""
        if self._on_drained is not None:
            self._guard("drained", self._on_drained)

    def _drain_wake(self) -> None:
        self._armed = False
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 4096):
                pass

    def _flush(self) -> None:
        self._armed = False
        for _ in range(len(self._out)):  # only what is queued now: bounded
            kind, target, payload = self._out.popleft()
            if kind == "router":
                assert self._router is not None
                buf, to = payload
                if self._signer is not None:  # signed on this thread: in queue order
                    buf = self._signer.seal(buf, recipient=to, stream=Stream.ROUTER,
                                            now=time.time())
                try:
                    self._router.send_multipart([target, buf], zmq.NOBLOCK)
                    self.stats["sent"] += 1
                except zmq.ZMQError as e:  # unknown or gone identity: nothing to tell
                    self.stats["reply_dropped"] += 1
                    log.debug("reply to %r dropped: %s", target, e)
            elif kind == "undeliverable":
                self.stats["undeliverable"] += 1
                self._guard("undeliverable",
                            functools.partial(self._on_undeliverable, target, payload))
            # "sync": only wakes us; _sync runs after every flush

    def _sync(self, poller: zmq.Poller, watched: dict[int, _Dealer]) -> None:
        """Close retired DEALERs and watch the descriptors of the current ones."""
        with self._dlock:
            retired, self._retired = self._retired, []
            live = {d.fd: d for d in self._dealers.values()}
            for fd, d in list(watched.items()):
                if live.get(fd) is not d:
                    poller.unregister(fd)
                    del watched[fd]
            for d in retired:
                d.close(linger=0)
            for fd, d in live.items():
                if fd not in watched:
                    poller.register(fd, zmq.POLLIN)
                    watched[fd] = d

    def _prune(self, now: float) -> None:
        """Retire DEALERs unused for ``_IDLE_S`` (peers come and go over a long run)."""
        with self._dlock:
            for ep in [e for e, d in self._dealers.items() if now - d.used > _IDLE_S]:
                self._retired.append(self._dealers.pop(ep))

    def _read_links(self) -> None:
        """Take in every DEALER's link changes from its monitor (under the lock: the
        records are shared with senders; the monitors are this thread's)."""
        with self._dlock:
            for d in self._dealers.values():
                d.up = link_up(d.monitor, d.up)

    def _read_router(self) -> None:
        assert self._router is not None
        for _ in range(_BATCH):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, payload = frames[0], frames[1:]
            opened = self._open(payload, sender=None, stream=Stream.DEALER)
            if isinstance(opened, _Refused):
                self._refuse(Origin(_name(identity) if self._verifier is None else None,
                                    identity), opened)
                continue
            msg, named = opened
            self._dispatch(Origin(_name(identity if named is None else named), identity), msg)

    def _read_dealers(self) -> None:
        """Read what arrived on the DEALERs (under the lock), then handle it (without)."""
        got: list[tuple[tuple[str, bytes], list[bytes]]] = []
        with self._dlock:
            for d in self._dealers.values():
                for _ in range(_BATCH):
                    if not _readable(d.sock):
                        break
                    try:
                        got.append(((d.endpoint, d.name), d.sock.recv_multipart(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
        for (endpoint, name), frames in got:
            opened = self._open(frames, sender=name, stream=Stream.ROUTER)
            if isinstance(opened, _Refused):
                self._refuse(Origin(endpoint, None), opened)
                continue
            self._dispatch(Origin(endpoint, None), opened[0])

    def _open(self, frames: list[bytes], *, sender: bytes | None, stream: Stream
              ) -> tuple[bytes | memoryview, bytes | None] | _Refused:
        """The message of what arrived, and (with a key) the endpoint its verified header
        names (``sender``: the one it must name, when known); else why it is refused."""
        if len(frames) != 1:
            return _Refused(f"expected one frame per message, got {len(frames)}",
                            unauthenticated=self._verifier is not None)
        if self._verifier is None:
            if is_signed(frames[0]):
                return _Refused(_NO_KEY, unauthenticated=True)
            return frames[0], None
        try:
            return self._verifier.open(frames[0], sender=sender, stream=stream,
                                       now=time.time())
        except Unauthenticated as e:
            return _Refused(e.reason, unauthenticated=True)

    def _refuse(self, origin: Origin, why: _Refused) -> None:
        """Drop what failed :meth:`_open`: counted, logged at a bounded rate; a peer that
        spoke on our ROUTER is told (only that it is not authenticated, for an
        authentication failure); a reply on our DEALER is never answered, and a failed
        authentication there is reported to ``on_unauthenticated``."""
        if not why.unauthenticated:
            self._reject(origin, why.reason)
            return
        self.stats["unauthenticated"] += 1
        _unauthenticated("control message from %s not authenticated (%s): is "
                         "KVHANDOFF_SECRET_FILE the same on both sides?", origin, why.reason)
        if origin.identity is not None:
            answer = UNAUTHENTICATED if self._verifier is not None else _NO_KEY
            self._answer(origin, encode_message(ErrorReply(reason=answer)))
        elif origin.endpoint is not None and self._on_unauthenticated is not None:
            hint = "is KVHANDOFF_SECRET_FILE the same on both sides?"
            if self._verifier is None:
                what = ("its answers are signed, but this agent has no deployment secret "
                        "(KVHANDOFF_SECRET_FILE unset)")
            else:
                what = f"its answer failed authentication: {why.reason}"
            self._guard("unauthenticated", functools.partial(
                self._on_unauthenticated, origin.endpoint,
                f"control message not authenticated: {hint} (the peer at {origin.endpoint}: "
                f"{what})"))

    def _dispatch(self, origin: Origin, payload: bytes | memoryview) -> None:
        self.stats["received"] += 1
        try:
            msg = decode_message(payload)
        except ProtocolError as e:
            self._reject(origin, str(e))
            return
        self._guard(type(msg).__name__, functools.partial(self._on_message, origin, msg))

    def _reject(self, origin: Origin, reason: str) -> None:
        self.stats["malformed"] += 1
        _malformed("malformed control message from %s: %s", origin, reason[:200])
        if origin.identity is not None:  # never answer a reply: no error ping-pong
            self._answer(origin, encode_message(ErrorReply(reason=reason[:4000])))

    def _guard(self, what: str, call: Callable[[], None]) -> None:
        """Run a callback; a bug in it is logged, counted, and never stops the thread."""
        try:
            call()
        except Exception:
            self.stats["handler_errors"] += 1
            log.exception("control handler for %s failed", what)

    def _teardown(self) -> None:
        if self._door is not None:
            self._door.close()
            self._door = None
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        with self._fd_lock:  # taken once: a second teardown must not close a reused number
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._ctx.term()


def _name(identity: bytes) -> str | None:
    """The control endpoint an identity names, if it names one."""
    return identity.decode("ascii", "replace") if identity.startswith(b"tcp://") else None


def _readable(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message waits on ``sock`` (processes its pending commands)."""
    return bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


@dataclass(frozen=True, slots=True)
class _Refused:
    """Why an arriving message is dropped before decoding."""

    reason: str
    unauthenticated: bool = False  # an authentication failure (else malformed)


@dataclass(eq=False, slots=True)
class _Dealer:
    """One DEALER, its notification descriptor and its link (used under the dealer
    lock; the monitor is read and closed on the I/O thread only)."""

    endpoint: str
    name: bytes  # the endpoint as bytes: what a signed frame to or from it names
    sock: zmq.Socket[bytes]
    fd: int
    used: float  # last send
    monitor: zmq.Socket[bytes]  # its link's events (links.heartbeat)
    up: bool = False  # connected, and the peer's libzmq answers (links.link_up)

    def close(self, *, linger: int) -> None:
        self.monitor.close(linger=0)
        self.sock.close(linger=linger)
