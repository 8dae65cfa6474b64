"""What the socket-served transports (tcp, shm, and the engines' staging channel) share.

* :class:`ThreadedServer`: one thread accepts on a listening socket, one thread serves
  each connection; nothing that arrives on the wire can raise out of a serving thread
  (it is logged and the connection dropped); ``close`` wakes and joins every thread.
* :class:`WorkerPeer`: a peer whose transfers are carried by worker threads. It tracks
  the pending transfers, turns whatever ends a worker into one error for all of them
  (``PeerLost`` for the wire, ``TransportClosed`` for ``close``), and joins its threads.
* :class:`ServedTransport`: a transport whose peers are ``WorkerPeer``s and whose
  receiving side is a ``ThreadedServer``: peer bookkeeping, ``submit`` and ``close``.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, TypeVar

from kvhandoff.plan.model import Plan
from kvhandoff.transport.base import Handle, Peer, Transport
from kvhandoff.transport.errors import (
    PeerLost,
    ProtocolError,
    TransferFailed,
    TransportClosed,
    TransportError,
)
from kvhandoff.transport.tcp_io import recv_exact, recv_header
from kvhandoff.transport.tcp_wire import Header, Kind

log = logging.getLogger("kvhandoff.transport")

P = TypeVar("P", bound="WorkerPeer")

JOIN_S = 5.0
"""How long ``close`` waits for each worker thread (they exit once their socket is shut)."""


class ThreadedServer(abc.ABC):
    """Accepts on ``listener`` (already bound and listening) and calls :meth:`serve` for
    each connection in its own daemon thread. ``close`` is thread-safe and idempotent."""

    def __init__(self, listener: socket.socket, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._closing = False
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._listener = listener
        self._accepter = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"kvh-{name}-accept")
        self._accepter.start()

    @abc.abstractmethod
    def serve(self, conn: socket.socket) -> None:
        """Serve one connection until it ends (return or raise; the socket is closed
        afterwards). ``OSError``/``EOFError`` end it quietly, ``ProtocolError`` with a
        warning, anything else with a logged traceback."""

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _addr = self._listener.accept()
            except OSError:
                return  # listener shut down by close()
            with self._lock:
                if self._closing:
                    conn.close()
                    return
                t = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                     name=f"kvh-{self.name}-serve")
                self._conns[conn] = t
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self.serve(conn)
        except (OSError, EOFError) as e:
            log.debug("%s server: connection ended: %s", self.name, e)
        except ProtocolError as e:
            log.warning("%s server: dropping connection after a malformed frame: %s",
                        self.name, e)
        except Exception:  # never let a serving thread die silently
            log.exception("%s server: internal error; connection dropped", self.name)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    @property
    def closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            conns = dict(self._conns)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        self._listener.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)  # wakes recv() in the serving thread
        self._accepter.join(JOIN_S)
        for t in conns.values():
            t.join(JOIN_S)


class Tracked(Protocol):
    """Anything a :class:`WorkerPeer` tracks: one submit and its handle."""

    handle: Handle


class WorkerPeer(Peer):
    """A peer whose transfers run on worker threads (``self._threads``, started by the
    subclass). Thread-safe.

    ``_fail(error)`` is the one way a peer becomes unusable: it fails every tracked
    transfer with ``error`` and calls :meth:`_wake` so the workers notice and exit.
    ``close`` fails them with ``TransportClosed``, joins the workers (bounded), then
    calls :meth:`_release` (close sockets, drop mappings)."""

    def __init__(self, endpoint: bytes, name: str) -> None:
        super().__init__(endpoint, name)
        self._lock = threading.Lock()
        self._error: TransportError | None = None  # set once: lost or closed
        self._pending: set[Tracked] = set()
        self._threads: list[threading.Thread] = []

    @abc.abstractmethod
    def submit(self, plan: Plan) -> Handle:
        """Queue ``plan`` (validated by the transport); returns its handle at once."""

    @abc.abstractmethod
    def _wake(self) -> None:
        """Make every worker notice ``self._error`` (shut sockets down, post sentinels)."""

    def _release(self) -> None:
        """Free what the workers used, once they have exited (or were given up on)."""

    def _track(self, item: Tracked) -> bool:
        """Start tracking a new transfer. Raises ``TransportClosed`` if the peer was
        closed by its owner; fails the handle (and returns False) if it was lost."""
        with self._lock:
            if isinstance(self._error, TransportClosed):
                raise TransportClosed(f"peer {self.name} is closed")
            if self._error is not None:
                item.handle.set_failed(self._error)
                return False
            self._pending.add(item)
        return True

    def _forget(self, item: Tracked) -> None:
        with self._lock:
            self._pending.discard(item)

    def _guard(self, loop: Callable[..., None], *args: Any) -> None:
        """Run a worker loop; turn whatever ends it into a lost peer (never raise)."""
        try:
            loop(*args)
        except (OSError, EOFError) as e:
            self._fail(PeerLost(f"lost {self.name}: {type(e).__name__}: {e}"))
        except TransportError as e:
            self._fail(e)
        except Exception as e:
            log.exception("peer %s: internal error in a worker thread", self.name)
            self._fail(TransferFailed(f"internal error talking to {self.name}: {e!r}"))

    def _fail(self, error: TransportError) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            pending = list(self._pending)
            self._pending.clear()
        for item in pending:
            item.handle.set_failed(error)
        self._wake()

    @property
    def closed(self) -> bool:
        return self._error is not None

    @property
    def error(self) -> TransportError | None:
        """Why the peer is unusable (lost or closed); None while it works."""
        return self._error

    def close(self) -> None:
        self._fail(TransportClosed(f"peer {self.name} was closed"))
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(JOIN_S)
        self._release()


MAX_REPLY = 1 << 16


def recv_reply(sock: socket.socket, buf: bytearray, name: str,
               oldest_sent: Callable[[], float | None], io_timeout: float
               ) -> tuple[Header, str] | None:
    """Read one REPLY frame: ``(header, message)``. None if the socket stayed idle for
    its timeout, unless the oldest request awaiting a reply (sent at
    ``oldest_sent()``, monotonic) is overdue by ``io_timeout``: then ``PeerLost``.
    ``ProtocolError`` for anything but a REPLY without payload and a short message."""
    if not recv_header(sock, memoryview(buf), idle_ok=True):
        sent = oldest_sent()
        if sent is not None and time.monotonic() - sent > io_timeout:
            raise PeerLost(f"{name} sent no reply within {io_timeout}s")
        return None
    h = Header.unpack(buf)
    if h.kind is not Kind.REPLY or h.desc_len > MAX_REPLY or h.payload_len:
        raise ProtocolError(f"{name} sent an unexpected {h.kind.name} frame")
    body = bytearray(h.desc_len)
    recv_exact(sock, memoryview(body))
    return h, body.decode(errors="replace")


def shut(sock: socket.socket) -> None:
    """Shut a socket down both ways (wakes a thread blocked on it); errors ignored."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class ServedTransport(Transport):
    """A transport whose peers are :class:`WorkerPeer`\\ s and whose receiving side is a
    :class:`ThreadedServer` started by the subclass's ``endpoint()`` (under
    ``self._lock``, into ``self._server``). Peers are closed with the transport."""

    peer_type: ClassVar[type[WorkerPeer]]

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._server: ThreadedServer | None = None
        self._peers: weakref.WeakSet[WorkerPeer] = weakref.WeakSet()

    def _adopt(self, peer: P) -> P:
        """Track a freshly connected peer (closed at once if the transport closed
        meanwhile)."""
        with self._lock:
            if self.closed:
                peer.close()
                self._check_open()
            self._peers.add(peer)
        return peer

    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        self._check_open()
        self._check_notice(notice)
        if not isinstance(peer, self.peer_type):
            raise TypeError(f"{self.name} transport cannot submit to {peer!r}")
        self.check_sources(plan)
        return peer.submit(plan)

    def _close(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            peers = list(self._peers)
        for p in peers:
            p.close()
        if server is not None:
            server.close()
