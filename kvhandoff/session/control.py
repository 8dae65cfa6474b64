"""ZeroMQ plumbing: one agent's control sockets, owned by one I/O thread.

Sockets (all in this channel's own ``zmq.Context``, terminated by :meth:`close`):

* one **ROUTER** bound at ``tcp://host:port``: every message a peer sends us arrives
  here. Peers' DEALERs carry their own control endpoint as ``ROUTING_ID``, so the
  identity tells who spoke (:class:`Origin`).
* one **DEALER** per peer endpoint we send to, connected lazily, ``ROUTING_ID`` = our
  endpoint. Replies a peer sends back on its ROUTER (heartbeat acks, error replies)
  arrive on these and are handled like any other message.

Bytes in, messages out: every frame goes through :func:`~kvhandoff.protocol.decode_message`.
Anything that does not decode (junk, an unknown tag, an extra frame, an oversized
message up to twice the protocol limit) is answered with an ``ErrorReply`` on the ROUTER
and counted; a handler that raises is logged with its traceback and counted. Neither ever
stops the thread. (Frames beyond twice the limit make ZeroMQ drop that connection: no
peer of ours sends them, and reading them would let anyone make us allocate at will.)

Thread-safety: :meth:`send`, :meth:`reply`, :meth:`forget` and :meth:`close` may be called
from any thread; they queue work for the I/O thread and wake it through a pipe (no
polling while idle). ``on_message`` and ``on_tick`` run on the I/O thread, one at a time,
and must not block.
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

log = logging.getLogger("kvhandoff.session.control")

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
FailureHandler = Callable[[str, str], None]


class ControlChannel:
    """The control sockets of one agent; see the module docstring for the contract."""

    def __init__(self, *, host: str, port: int, dial_host: str, on_message: MessageHandler,
                 on_tick: TickHandler, on_undeliverable: FailureHandler, tick: float,
                 name: str = "agent", flush_timeout: float = 0.25) -> None:
        self._on_message = on_message
        self._on_tick = on_tick
        self._on_undeliverable = on_undeliverable
        self._tick = tick
        self._flush_ms = int(flush_timeout * 1000)
        self.stats: collections.Counter[str] = collections.Counter()
        self._ctx = zmq.Context()
        self._router: zmq.Socket[bytes] | None = None
        self._wake_r, self._wake_w = -1, -1
        try:
            router = self._ctx.socket(zmq.ROUTER)
            self._router = router
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            router.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_MESSAGE_BYTES)
            router.setsockopt(zmq.RCVHWM, _HWM)
            router.setsockopt(zmq.SNDHWM, _HWM)
            bind_host = "*" if host in ("0.0.0.0", "") else host
            if port:
                router.bind(f"tcp://{bind_host}:{port}")
            else:
                port = router.bind_to_random_port(f"tcp://{bind_host}")
            self.endpoint = f"tcp://{dial_host}:{port}"
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            self._teardown()
            raise
        self._out: collections.deque[tuple[str, Any, bytes]] = collections.deque()
        self._armed = False
        self._stop = False
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._used: dict[str, float] = {}  # last send per DEALER
        self._by_socket: dict[zmq.Socket[bytes], str] = {}
        self._thread = threading.Thread(target=self._run, name=f"kvh-io-{name}", daemon=True)
        self._thread.start()

    # --- any thread ----------------------------------------------------------------

    def send(self, endpoint: str, msg: Message) -> None:
        """Queue ``msg`` for the peer at ``endpoint``. Raises LocalProtocolError when it
        cannot be encoded (a local bug); delivery problems go to ``on_undeliverable``."""
        self._push(("dealer", endpoint, encode_message(msg)))

    def reply(self, origin: Origin, msg: Message) -> None:
        """Answer ``origin`` on the connection it spoke on (works for unnamed clients)."""
        buf = encode_message(msg)
        if origin.identity is not None:
            self._push(("router", origin.identity, buf))
        elif origin.endpoint is not None:
            self._push(("dealer", origin.endpoint, buf))

    def forget(self, endpoint: str) -> None:
        """Close our DEALER to ``endpoint`` (a lost peer): queued messages to it are
        dropped; a later :meth:`send` dials afresh."""
        self._push(("forget", endpoint, b""))

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

    def _push(self, item: tuple[str, Any, bytes]) -> None:
        self._out.append(item)
        if not self._armed:
            self._armed = True
            self._wake()

    def _wake(self) -> None:
        # A full pipe already wakes the thread; dropping this byte loses nothing.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    # --- the I/O thread ------------------------------------------------------------

    def _run(self) -> None:
        assert self._router is not None
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_tick = time.monotonic() + self._tick
        try:
            while not self._stop:
                wait_ms = max(0, int((next_tick - time.monotonic()) * 1000) + 1)
                for sock, _ in poller.poll(wait_ms):
                    if sock is self._router:
                        self._read_router()
                    elif sock == self._wake_r:
                        self._drain_wake()
                    else:
                        self._read_dealer(sock)
                self._flush(poller)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + self._tick
                    self._guard("tick", functools.partial(self._on_tick, now))
                    self._prune(poller, now)
            self._flush(poller)
        except zmq.ZMQError as e:  # the context was terminated under us: nothing to save
            log.error("control I/O thread stopped by ZeroMQ: %s", e)
        finally:
            for sock in self._dealers.values():
                sock.close(linger=self._flush_ms)
            self._dealers.clear()
            self._by_socket.clear()

    def _drain_wake(self) -> None:
        self._armed = False
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 4096):
                pass

    def _flush(self, poller: zmq.Poller) -> None:
        self._armed = False
        for _ in range(len(self._out)):  # only what is queued now: bounded
            kind, target, buf = self._out.popleft()
            if kind == "forget":
                self._close_dealer(poller, target)
            elif kind == "router":
                assert self._router is not None
                try:
                    self._router.send_multipart([target, buf], zmq.NOBLOCK)
                    self.stats["sent"] += 1
                except zmq.ZMQError as e:  # unknown or gone identity: nothing to tell
                    self.stats["reply_dropped"] += 1
                    log.debug("reply to %r dropped: %s", target, e)
            else:
                self._send_dealer(poller, target, buf)

    def _send_dealer(self, poller: zmq.Poller, endpoint: str, buf: bytes) -> None:
        try:
            sock = self._dealers.get(endpoint) or self._open_dealer(poller, endpoint)
            sock.send(buf, zmq.NOBLOCK)
            self._used[endpoint] = time.monotonic()
            self.stats["sent"] += 1
        except zmq.Again:
            self._undeliverable(endpoint, f"control queue to {endpoint} is full ({_HWM} "
                                          f"messages): the peer is not reading")
        except zmq.ZMQError as e:
            self._undeliverable(endpoint, f"cannot send to control endpoint {endpoint!r}: {e}")

    def _undeliverable(self, endpoint: str, reason: str) -> None:
        self.stats["undeliverable"] += 1
        self._guard("undeliverable", lambda: self._on_undeliverable(endpoint, reason))

    def _open_dealer(self, poller: zmq.Poller, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.ROUTING_ID, self.endpoint.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, _HWM)
            sock.setsockopt(zmq.RCVHWM, _HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.connect(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._dealers[endpoint] = sock
        self._by_socket[sock] = endpoint
        poller.register(sock, zmq.POLLIN)
        return sock

    def _prune(self, poller: zmq.Poller, now: float) -> None:
        """Close DEALERs unused for ``_IDLE_S`` (peers come and go over a long run)."""
        for ep in [e for e, t in self._used.items() if now - t > _IDLE_S]:
            self._close_dealer(poller, ep)

    def _close_dealer(self, poller: zmq.Poller, endpoint: str) -> None:
        sock = self._dealers.pop(endpoint, None)
        self._used.pop(endpoint, None)
        if sock is not None:
            self._by_socket.pop(sock, None)
            poller.unregister(sock)
            sock.close(linger=0)

    def _read_router(self) -> None:
        assert self._router is not None
        for _ in range(_BATCH):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, payload = frames[0], frames[1:]
            name = identity.decode("ascii", "replace") if identity.startswith(b"tcp://") else None
            origin = Origin(name, identity)
            if len(payload) != 1:
                self._reject(origin, f"expected one frame per message, got {len(payload)}")
                continue
            self._dispatch(origin, payload[0])

    def _read_dealer(self, sock: Any) -> None:
        endpoint = self._by_socket.get(sock)
        if endpoint is None:
            return
        for _ in range(_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 1:
                self.stats["malformed"] += 1
                continue
            self._dispatch(Origin(endpoint, None), frames[0])

    def _dispatch(self, origin: Origin, payload: bytes) -> None:
        self.stats["received"] += 1
        try:
            msg = decode_message(payload)
        except ProtocolError as e:
            self._reject(origin, str(e))
            return
        self._guard(type(msg).__name__, lambda: self._on_message(origin, msg))

    def _reject(self, origin: Origin, reason: str) -> None:
        self.stats["malformed"] += 1
        log.warning("malformed control message from %s: %s", origin, reason)
        if origin.identity is not None:  # never answer a reply: no error ping-pong
            self._push(("router", origin.identity,
                        encode_message(ErrorReply(reason=reason[:4000]))))

    def _guard(self, what: str, call: Callable[[], None]) -> None:
        """Run a callback; a bug in it is logged, counted, and never stops the thread."""
        try:
            call()
        except Exception:
            self.stats["handler_errors"] += 1
            log.exception("control handler for %s failed", what)

    def _teardown(self) -> None:
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r = self._wake_w = -1
        self._ctx.term()
