"""The control socket's door: a cap on the connections its ROUTER holds, and no spin when
the process runs out of descriptors.

libzmq accepts every connection to a bound ROUTER, with no cap; and when ``accept``
fails for want of descriptors it returns, and its poller (level-triggered) calls it
again at once for as long as a connection waits: a flood that exhausts the process's
descriptors spins libzmq's I/O thread on a core, silently, until descriptors free up
(issue #30). :class:`ControlDoor` bounds both:

* the ROUTER listens on a socket made here (``ZMQ_USE_FD``), non-blocking, so this side
  can empty the listen queue itself when libzmq cannot;
* the ROUTER holds at most :attr:`cap` connections (below the descriptor limit read at
  start-up, :func:`~kvhandoff.descriptors.connection_cap`), counted from its socket
  monitor: at the cap the listening socket stops taking connections — a socket filter
  drops what arrives, and clients retry, as TCP does after a lost SYN: libzmq cannot be
  told to stop accepting — until one leaves; every connection is also vetted once its
  ZMTP greeting arrived, by a ZAP handler on the channel's own context, which refuses it
  over the cap (those that raced in); ``ZMQ_HANDSHAKE_IVL`` cuts one that never greets;
* a failed accept (the process is out of descriptors), reported by the monitor, is
  counted and logged at a bounded rate, and answered by a back-off: the socket stops
  taking connections for a while, and those already waiting are closed unread
  (:func:`~kvhandoff.descriptors.reset_listen_queue`, which needs no descriptor), so
  libzmq finds nothing to accept and does not spin. The pause doubles while accepts
  keep failing, up to a second, and starts over once one succeeds. Peers whose
  connection was closed reconnect (ZeroMQ's DEALERs retry on their own).

  (It used to accept them with a descriptor kept in reserve, as libuv and nginx do;
  but libzmq's I/O thread, spinning on the same queue, often took the freed
  descriptor first, the reserve could not be reopened, and libzmq spun for as long
  as the flood lasted: ``tests/security/test_descriptor_flood.py`` failed now and
  then with the victim at 100 % of a core.)

Without socket filters (not Linux) only the ZAP refusal and the draining are done.

Everything runs on the channel's I/O thread: its poller watches :attr:`ControlDoor.zap`
and :attr:`ControlDoor.monitor` and calls :meth:`~ControlDoor.on_zap` /
:meth:`~ControlDoor.on_monitor` when they are readable.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import struct

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvhandoff.descriptors import (
    OUT_OF_DESCRIPTORS,
    Backoff,
    connection_cap,
    listening_socket,
    reset_listen_queue,
)
from kvhandoff.transport.throttle import Throttle

__all__ = ["DESCRIPTOR_SHARE", "HANDSHAKE_MS", "MAX_CONNECTIONS", "ControlDoor"]

log = logging.getLogger("kvhandoff.session.control.channel")
_accept_failed = Throttle(log)
_over_cap = Throttle(log)

MAX_CONNECTIONS = 1024
"""Connections a control socket holds at most (fewer when descriptors are scarcer)."""
DESCRIPTOR_SHARE = 0.2
"""The control socket's share of the descriptors free when it starts."""
HANDSHAKE_MS = 10_000
"""A connection that has not completed ZeroMQ's handshake by then is closed."""
_ZAP = "inproc://zeromq.zap.01"  # where libzmq asks, in the socket's own context
_DOMAIN = b"kvhandoff"
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPT_FAILED
_BATCH = 256
# Linux socket filters (<linux/filter.h>): one classic BPF instruction, "return 0": drop.
_ATTACH_FILTER, _DETACH_FILTER = 26, 27  # SO_ATTACH_FILTER, SO_DETACH_FILTER
_DROP_ALL = struct.pack("HBBI", 0x06, 0, 0, 0)  # BPF_RET | BPF_K, k = 0


class ControlDoor:
    """The door of ``router`` (not yet bound), in ``ctx``: call :meth:`bind` once. See
    the module docstring. I/O thread only, after construction."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], router: zmq.Socket[bytes], *,
                 name: str) -> None:
        self.name = name
        self.cap = connection_cap(MAX_CONNECTIONS, DESCRIPTOR_SHARE)
        self.accept_failures = 0  # accepts libzmq could not make
        self.drained = 0  # connections closed unread to empty the listen queue
        self.refused = 0  # connections refused at the cap
        self._router = router
        self._live: set[int] = set()  # descriptors of the ROUTER's accepted connections
        self._fd = -1  # the listening socket, libzmq's once bound
        self._backoff = Backoff()
        self._paused_until: float | None = None  # backing off: no connections until then
        self._filtered = False  # the drop filter is on the listening socket
        self.zap: zmq.Socket[bytes] = ctx.socket(zmq.REP)
        self.monitor: zmq.Socket[bytes] | None = None
        try:
            self.zap.setsockopt(zmq.LINGER, 0)
            self.zap.bind(_ZAP)
            router.setsockopt(zmq.ZAP_DOMAIN, _DOMAIN)
            router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
            self.monitor = router.get_monitor_socket(_EVENTS)
        except BaseException:
            self.close()
            raise

    def bind(self, host: str, port: int) -> int:
        """Bind the ROUTER to ``host:port`` (``*``: every address; 0: any free port) on a
        listening socket of ours; returns the port."""
        sock = listening_socket(host, port)
        try:
            port = int(sock.getsockname()[1])
            self._router.setsockopt(zmq.USE_FD, sock.fileno())
            name = f"[{host}]" if ":" in host else host
            self._router.bind(f"tcp://{name}:{port}")
        except BaseException:
            sock.close()
            raise
        self._fd = sock.detach()  # libzmq's now: it closes it with the ROUTER
        return port

    @property
    def connections(self) -> int:
        """Connections the ROUTER holds now, as its monitor reported them."""
        return len(self._live)

    def on_monitor(self, now: float) -> None:
        """Take the monitor's events: count connections; back off after a failed accept
        (``now``: monotonic seconds)."""
        if self.monitor is None:
            return
        for _ in range(_BATCH):
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            kind, value = event["event"], int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                self._live.add(value)
                self._backoff.reset()
            elif kind == zmq.EVENT_DISCONNECTED:
                self._live.discard(value)
            elif kind == zmq.EVENT_ACCEPT_FAILED:
                self._accept_failed(value, now)
        self._gate()

    def on_tick(self, now: float) -> None:
        """End a back-off that is over (the I/O thread's timer)."""
        if self._paused_until is not None and now >= self._paused_until:
            self._paused_until = None
            self._gate()

    def _gate(self) -> None:
        """Take connections unless at the cap or backing off."""
        closed = self._paused_until is not None or len(self._live) >= self.cap
        if closed != self._filtered:
            self._filtered = closed
            self._filter(closed)

    def _accept_failed(self, err: int, now: float) -> None:
        self.accept_failures += 1
        if err not in OUT_OF_DESCRIPTORS or self._paused_until is not None:
            return  # one back-off at a time: libzmq reports each try it made meanwhile
        wait = self._backoff.next()
        self._paused_until = now + wait
        self._gate()
        drained = self._drain()
        _accept_failed("control socket of %s: accept failed (%s; %d connections held, at "
                       "most %d); not taking connections for %.2f s, %d waiting one(s) "
                       "closed unread, still listening", self.name, os.strerror(err),
                       len(self._live), self.cap, wait, drained)

    def _listener(self) -> socket.socket:
        """A view of libzmq's listening socket: :meth:`socket.socket.detach` it after use
        (closing it would pull the socket from under libzmq)."""
        return socket.socket(fileno=self._fd)

    def _filter(self, drop: bool) -> None:
        """Drop every connection attempt from now on (``drop``), or no more."""
        if self._fd < 0:
            return
        listener = self._listener()
        try:
            if drop:
                code = ctypes.create_string_buffer(_DROP_ALL)  # the kernel copies it
                prog = struct.pack("HL", 1, ctypes.addressof(code))
                listener.setsockopt(socket.SOL_SOCKET, _ATTACH_FILTER, prog)
            else:
                listener.setsockopt(socket.SOL_SOCKET, _DETACH_FILTER, 0)
        except OSError as e:  # not Linux, or no filter attached: draining must do
            log.debug("control socket of %s: socket filter: %s", self.name, e)
        finally:
            listener.detach()

    def _drain(self) -> int:
        """Close every connection waiting to be accepted, unread (no descriptor needed)."""
        if self._fd < 0:
            return 0
        listener = self._listener()
        try:
            n = reset_listen_queue(listener)
        except OSError as e:  # still listening: libzmq's next failure retries
            log.debug("control socket of %s: resetting the listen queue: %s", self.name, e)
            n = 0
        finally:
            listener.detach()
        if self._filtered:  # the drop filter belongs to the paused socket
            self._filter(True)
        self.drained += n
        return n

    def on_zap(self, now: float) -> None:
        """Answer libzmq's requests to admit a connection that greeted: yes while the
        ROUTER holds at most :attr:`cap` (the newcomer counted)."""
        self.on_monitor(now)  # count what was accepted meanwhile first
        for _ in range(_BATCH):
            try:
                frames = self.zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ok = len(self._live) <= self.cap
            if not ok:
                self.refused += 1
                _over_cap("control socket of %s: refused a connection from %s: it holds "
                          "%d connections, its cap below the descriptor limit", self.name,
                          frames[3].decode(errors="replace") if len(frames) > 3 else "?",
                          len(self._live))
            status = (b"200", b"OK") if ok else (b"400", b"connection cap reached")
            self.zap.send_multipart([frames[0], frames[1] if len(frames) > 1 else b"",
                                     *status, b"", b""])

    def close(self) -> None:
        """Close the ZAP and monitor sockets (before the context is terminated; the
        ROUTER closes the listening socket)."""
        self._fd = -1  # libzmq's to close: never touched again, whatever reuses the number
        if self.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._router.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
        self.zap.close(linger=0)
