"""What the socket-served transports (tcp, shm, and the engines' staging channel) share.

* :class:`ThreadedServer`: one thread accepts on a listening socket, one thread serves
  each connection; nothing that arrives on the wire can raise out of a serving thread
  (it is logged and the connection dropped); ``close`` wakes and joins every thread.
  Every connection opens with the mutual challenge–response of
  :mod:`~kvhandoff.transport.framing.handshake` before :meth:`ThreadedServer.serve` sees it.
  Strangers cannot stop the accept loop or hold the port: see the class docstring.
* :func:`prove`: the client's side of that handshake, on a freshly dialled socket.
* :class:`WorkerPeer`: a peer whose transfers are carried by worker threads. It tracks
  the pending transfers, turns whatever ends a worker into one error for all of them
  (``PeerLost`` for the wire, ``TransportClosed`` for ``close``), and joins its threads.
* :class:`ServedTransport`: a transport whose peers are ``WorkerPeer``s and whose
  receiving side is a ``ThreadedServer``: peer bookkeeping, ``submit`` and ``close``.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import json
import logging
import secrets
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, TypeVar

from kvhandoff.descriptors import Backoff, connection_cap
from kvhandoff.plan.model import Plan
from kvhandoff.transport.base import Handle, Peer, Transport
from kvhandoff.transport.errors import (
    ConnectError,
    PeerLost,
    ProtocolError,
    TransferFailed,
    TransportClosed,
    TransportError,
)
from kvhandoff.transport.framing.handshake import (
    CLIENT_FRAME,
    SERVER_FRAME,
    ClientHandshake,
    HandshakeFailed,
    Refusal,
    ServerHandshake,
    new_endpoint_id,
    refusal,
)
from kvhandoff.transport.framing.io import FrameReader
from kvhandoff.transport.framing.wire import HEADER, Header, Kind, Status, reply_error
from kvhandoff.transport.throttle import Throttle

log = logging.getLogger("kvhandoff.transport")

P = TypeVar("P", bound="WorkerPeer")
R = TypeVar("R", bound="InFlight")
T = TypeVar("T", bound="Tracked")

JOIN_S = 5.0
"""How long ``close`` waits for each worker thread (they exit once their socket is shut)."""

MAX_CONNECTIONS = 1024
"""Connections a server holds in all, proven or not, at most: its cap is this or a quarter
of the descriptors free when it starts (:func:`~kvhandoff.descriptors.connection_cap`),
whichever is less, so strangers cannot take the process's last descriptor."""
DESCRIPTOR_SHARE = 0.2
"""A data server's share of the free descriptors (the control socket takes as much)."""
MAX_UNPROVEN = 256
"""Connections a server holds that have not passed the handshake yet, in all."""
MAX_UNPROVEN_PER_HOST = 64
"""... and from one source address."""
MAX_PER_HOST = 32
"""The default cap on connections a server holds from one source address, proven or
not (the transports' ``max_connections_per_host`` option). A sending rank holds a few
(tcp: ``connections``, 2 by default; staging and shm: one), so this leaves room for a
host full of prefill ranks and their reconnections."""
HELLO_DEADLINE_S = 10.0
"""An unproven connection is cut this long after it was accepted; its handshake reads
give up at the same deadline."""
_REAP_S = 1.0  # how often the accept loop looks for overdue unproven connections
_DEAD_LISTENER = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK})
_accept_failed = Throttle(log)
_refused = Throttle(log)
_unauthenticated = Throttle(log)
_malformed = Throttle(log)


class ThreadedServer(abc.ABC):
    """Accepts on ``listener`` (already bound and listening) and calls :meth:`serve` for
    each connection in its own daemon thread. ``close`` is thread-safe and idempotent.

    Authentication: the serving thread runs the server's side of the handshake
    (:mod:`~kvhandoff.transport.framing.handshake`, keyed with ``key``, naming
    ``endpoint_id``) first: it sends a fixed-size CHALLENGE, reads exactly one fixed-size
    ANSWER within ``HELLO_DEADLINE_S`` of the accept, and only a connection that proved
    the key reaches :meth:`serve`; a wrong proof gets a REFUSED frame and the close
    (logged, rate-limited). Nothing is allocated for a connection before that.

    Hostile clients cannot take the port down or hold it: a failed ``accept`` (out of
    file descriptors, say) is logged (rate-limited) and retried with backoff, never the
    end of the loop; all connections are capped at :attr:`max_connections`, which stays
    below the descriptor limit read at start-up (:data:`MAX_CONNECTIONS`); a connection
    stays *unproven* until its handshake succeeded, and unproven connections are capped
    (``MAX_UNPROVEN`` in all, ``MAX_UNPROVEN_PER_HOST`` per source address) and cut after
    ``HELLO_DEADLINE_S`` seconds, however slowly they trickle bytes; all connections from
    one address are capped at ``max_per_host``. A connection over a cap gets a REFUSED
    (busy) frame and is closed at once; the reason is logged, rate-limited."""

    def __init__(self, listener: socket.socket, name: str, *, key: bytes, endpoint_id: str,
                 max_per_host: int = MAX_PER_HOST) -> None:
        try:
            ServerHandshake.new(key, endpoint_id)  # a bad id is ours, not a client's fault
            problem = "" if max_per_host >= 1 else (
                f"max_connections_per_host must be >= 1, got {max_per_host}")
        except HandshakeFailed as e:
            problem = str(e)
        if problem:
            listener.close()
            raise ValueError(f"{name} server: {problem}")
        self.name = name
        self._key, self.endpoint_id = key, endpoint_id
        self.max_per_host = max_per_host
        self.max_connections = connection_cap(MAX_CONNECTIONS, DESCRIPTOR_SHARE)
        self.accept_failures = 0  # accepts that failed (out of descriptors, say)
        self._lock = threading.Lock()
        self._closing = False
        self._wake = threading.Event()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._hosts: dict[socket.socket, str] = {}
        self._unproven: dict[socket.socket, float] = {}  # → when accepted (monotonic)
        self._listener = listener
        listener.settimeout(_REAP_S)  # accept wakes up to cut overdue unproven connections
        self._accepter = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"kvh-{name}-accept")
        self._accepter.start()

    @abc.abstractmethod
    def serve(self, conn: socket.socket) -> None:
        """Serve one connection, which passed the handshake, until it ends (return or
        raise; the socket is closed afterwards). ``OSError``/``EOFError`` end it quietly,
        ``ProtocolError`` with a warning, anything else with a logged traceback."""

    def _authenticate(self, conn: socket.socket) -> None:
        """The server's side of the handshake; ``ProtocolError`` if the client fails it
        (it was sent a REFUSED frame). Reads exactly one ANSWER frame, by the deadline."""
        with self._lock:
            accepted = self._unproven.get(conn)
        deadline = (time.monotonic() if accepted is None else accepted) + HELLO_DEADLINE_S
        hs = ServerHandshake.new(self._key, self.endpoint_id)
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        conn.sendall(hs.challenge())
        try:
            answer = recv_fixed(conn, CLIENT_FRAME, deadline)
        except TimeoutError as e:  # a trickle or a silent client: refused like a bad proof
            raise _Unauthenticated(str(e)) from None
        try:
            verdict = hs.verdict(answer)
        except HandshakeFailed as e:
            with contextlib.suppress(OSError):
                conn.sendall(refusal(Refusal.BAD_PROOF, self.endpoint_id))
            raise _Unauthenticated(str(e)) from None
        conn.sendall(verdict)
        with self._lock:
            self._unproven.pop(conn, None)  # no longer subject to the unproven caps

    def _accept_loop(self) -> None:
        """Accept until :meth:`close`; then close the listening socket. This thread owns
        it: ``close`` only shuts it down (to wake ``accept``), and both happen under the
        lock, so neither can reach a descriptor number the other just freed for reuse."""
        try:
            self._accept_until_closed()
        finally:
            with self._lock:
                self._listener.close()

    def _accept_until_closed(self) -> None:
        backoff = Backoff()
        while not self._closing:
            try:
                conn, addr = self._listener.accept()
            except TimeoutError:
                self._reap(time.monotonic())
                continue
            except OSError as e:
                if self.closing:
                    return  # listener shut down by close()
                if e.errno in _DEAD_LISTENER:  # someone else shut or closed it: say so
                    log.error("%s server: its listening socket stopped (%s) although the "
                              "server was not closed; nothing accepts its connections any "
                              "more", self.name, e)
                    return
                self.accept_failures += 1
                wait = backoff.next()
                _accept_failed("%s server: accept failed (%s; %d connections held, at most "
                               "%d); retrying in %.2f s, still listening", self.name, e,
                               len(self._conns), self.max_connections, wait)
                self._wake.wait(wait)
                continue
            backoff.reset()
            self._admit(conn, addr[0] if isinstance(addr, tuple) and addr else "local")
            self._reap(time.monotonic())

    def _admit(self, conn: socket.socket, host: str) -> None:
        """Start serving ``conn`` from ``host``, or close it if it is over a cap."""
        with self._lock:
            over = self._over_cap(host)
            if self._closing or over:
                if over:  # logged before the client can learn it was refused
                    _refused("%s server: refused a connection from %s: %s", self.name, host,
                             over)
                    _send_now(conn, refusal(Refusal.BUSY, self.endpoint_id))
                conn.close()
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                 name=f"kvh-{self.name}-serve")
            self._conns[conn] = t
            self._hosts[conn] = host
            self._unproven[conn] = time.monotonic()
        t.start()

    def _over_cap(self, host: str) -> str | None:
        """Which cap a new connection from ``host`` would break (caller holds the lock)."""
        if len(self._conns) >= self.max_connections:
            return (f"the server holds {self.max_connections} connections, its cap below "
                    f"the descriptor limit")
        if len(self._unproven) >= MAX_UNPROVEN:
            return f"{MAX_UNPROVEN} connections have not shown the token yet"
        here = [c for c, h in self._hosts.items() if h == host]
        if len(here) >= self.max_per_host:
            return (f"it holds {self.max_per_host} connections already "
                    f"(max_connections_per_host)")
        if sum(c in self._unproven for c in here) >= MAX_UNPROVEN_PER_HOST:
            return f"{MAX_UNPROVEN_PER_HOST} of its connections have not shown the token yet"
        return None

    def _reap(self, now: float) -> None:
        """Cut unproven connections older than ``HELLO_DEADLINE_S`` (their serving
        threads wake, see the socket shut and end)."""
        with self._lock:  # shut under the lock: its serving thread closes it under it
            late = [c for c, t0 in self._unproven.items() if now - t0 > HELLO_DEADLINE_S]
            for c in late:
                del self._unproven[c]
                shut(c)
        for _ in late:
            _refused("%s server: cut a connection that did not pass the handshake within "
                     "%g s", self.name, HELLO_DEADLINE_S)

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._authenticate(conn)
            self.serve(conn)
        except _Unauthenticated as e:  # strangers can do this at will: rate-limited
            _unauthenticated("%s server: refused a connection that failed the data-plane "
                             "handshake: %s", self.name, e)
        except (OSError, EOFError) as e:
            log.debug("%s server: connection ended: %s", self.name, e)
        except ProtocolError as e:  # strangers can send these at will: rate-limited
            _malformed("%s server: dropping connection after a malformed frame: %s",
                       self.name, e)
        except Exception:  # never let a serving thread die silently
            log.exception("%s server: internal error; connection dropped", self.name)
        finally:
            with self._lock:  # closed under the lock, see close()
                self._conns.pop(conn, None)
                self._hosts.pop(conn, None)
                self._unproven.pop(conn, None)
                conn.close()

    @property
    def closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Stop accepting, end every connection, join the threads (bounded by JOIN_S).

        Sockets are only shut down here, never closed: the thread that uses a socket
        closes it (the accept thread its listener, a serving thread its connection),
        and shutting down and closing both happen under the lock. A socket shut down
        here is therefore still open; one shut down *after* another thread closed it
        could hit a new socket that reused its descriptor number (CPython reads the
        number after releasing the GIL): a stranger's listener would stop listening,
        its connection end (seen as refused connections and handshakes cut at 0 B)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            threads = list(self._conns.values())
            shut(self._listener)  # wakes accept() on Linux (EINVAL)
            for c in self._conns:
                shut(c)  # wakes recv() in the serving thread
        self._wake.set()
        self._accepter.join(JOIN_S)
        for t in threads:
            t.join(JOIN_S)


class _Unauthenticated(ProtocolError):
    """A client failed the handshake (it was refused; the message says why)."""


def recv_fixed(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes from ``sock``, all by ``deadline`` (monotonic), however slowly
    they trickle: ``TimeoutError`` past it, ``EOFError`` if the peer closed first. Reads
    nothing beyond the ``n`` bytes (it changes the socket's timeout)."""
    buf = bytearray(n)
    view = memoryview(buf)
    while len(view):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"handshake frame incomplete ({n - len(view)} of {n} B) "
                               f"at its deadline")
        sock.settimeout(left)
        got = sock.recv_into(view)
        if got == 0:
            raise EOFError(f"peer closed the connection during the handshake ({n - len(view)} "
                           f"of {n} B)")
        view = view[got:]
    return bytes(buf)


def prove(sock: socket.socket, *, key: bytes, endpoint_id: str, timeout: float,
          peer: str) -> None:
    """The client's side of the handshake on a freshly connected ``sock``: answer the
    server's challenge, then check its proof, all within ``timeout`` seconds. Returns
    once the server proved the key: only then may anything be sent. ``ConnectError``
    (naming ``peer``) if it refused us or did not prove the key; ``OSError`` /
    ``EOFError`` from the socket propagate (the caller closes it)."""
    deadline = time.monotonic() + timeout
    hs = ClientHandshake.new(key, endpoint_id, peer=peer)
    try:
        challenge = recv_fixed(sock, SERVER_FRAME, deadline)
        sock.sendall(hs.answer(challenge))
        hs.check_verdict(challenge, recv_fixed(sock, SERVER_FRAME, deadline))
    except HandshakeFailed as e:
        raise ConnectError(f"data-plane handshake failed: {e}") from None


def _send_now(sock: socket.socket, data: bytes) -> None:
    """Send ``data`` if the socket takes it at once (a fresh socket does); never block."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.send(data)


class Tracked(Protocol):
    """Anything a :class:`WorkerPeer` tracks: one submit and its handle."""

    handle: Handle


class InFlight(Protocol):
    """A request awaiting its reply, as :meth:`WorkerPeer._read_replies` reads it."""

    @property
    def seq(self) -> int:
        """The frame number its reply echoes."""

    @property
    def sent_at(self) -> float | None:
        """When it went out (monotonic); None while it has not."""


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
        # _wake (shut sockets down) and _release (close them) never overlap, and nothing
        # is woken once released: a socket shut down after its close could hit a new
        # socket that reused its descriptor number (see ThreadedServer.close)
        self._sockets_lock = threading.Lock()
        self._released = False

    def _start(self, *loops: tuple[Callable[[], None], str]) -> None:
        """Start one daemon worker thread per ``(loop, thread name)``, each run under
        :meth:`_guard`, into ``self._threads``."""
        self._threads = [threading.Thread(target=self._guard, args=(loop,), daemon=True,
                                          name=name) for loop, name in loops]
        for t in self._threads:
            t.start()

    @abc.abstractmethod
    def submit(self, plan: Plan) -> Handle:
        """Queue ``plan`` (validated by the transport); returns its handle at once."""

    @abc.abstractmethod
    def _wake(self) -> None:
        """Make every worker notice ``self._error`` (shut sockets down, post sentinels)."""

    def _release(self) -> None:
        """Free what the workers used, once they have exited (or were given up on)."""

    def _open(self, nbytes: int, make: Callable[[Handle], T], *,
              handle_type: type[Handle] = Handle, peer: str | None = None,
              ) -> tuple[Handle, T | None]:
        """A new transfer of ``nbytes``: its handle (a ``handle_type`` naming ``peer``,
        this peer by default, that stops the tracking when released) and the item
        ``make(handle)`` built for it, tracked (:meth:`_track`). The item is None when
        the peer was lost: the handle is failed already and only needs returning.
        Raises ``TransportClosed`` if the owner closed the peer."""
        item: T
        handle = handle_type(nbytes=nbytes, peer=self.name if peer is None else peer,
                             on_release=lambda h: self._forget(item))
        item = make(handle)
        return handle, item if self._track(item) else None

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

    def _read_replies(self, sock: socket.socket, inflight: deque[R], io_timeout: float,
                      on_reply: Callable[[R, Header, str], None]) -> None:
        """A reader thread's loop, until the peer fails: every REPLY on ``sock`` answers
        the oldest request in ``inflight`` (the sender appends, only this loop pops),
        which is popped and handed to ``on_reply(request, header, message)``.
        ``ProtocolError`` for a reply to any other frame; ``PeerLost`` when the oldest
        request waits more than ``io_timeout`` (see :func:`recv_reply`)."""
        reader = FrameReader(sock)

        def oldest() -> float | None:
            return inflight[0].sent_at if inflight else None

        while self._error is None:
            got = recv_reply(reader, self.name, oldest, io_timeout)
            if got is None:
                continue
            h, message = got
            if not inflight or inflight[0].seq != h.seq:
                raise ProtocolError(f"{self.name} replied to frame {h.seq}, which is not the "
                                    f"oldest in flight")
            on_reply(inflight.popleft(), h, message)

    def _replied(self, item: Tracked, h: Header, message: str) -> None:
        """What a REPLY does to the transfer it answers (the usual ``on_reply`` of
        :meth:`_read_replies`): DONE on OK, else failed with the receiver's verdict."""
        if h.code == Status.OK:
            item.handle.set_done()
        else:
            item.handle.set_failed(reply_error(h.code, message, self.name))
        self._forget(item)

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
        with self._sockets_lock:
            if not self._released:
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
        with self._sockets_lock:
            if not self._released:
                self._released = True
                self._release()


MAX_REPLY = 1 << 16


def recv_reply(reader: FrameReader, name: str, oldest_sent: Callable[[], float | None],
               io_timeout: float) -> tuple[Header, str] | None:
    """Read one REPLY frame (through ``reader``: one syscall when it has arrived whole):
    ``(header, message)``. None if the socket stayed idle for its timeout, unless the
    oldest request awaiting a reply (sent at ``oldest_sent()``, monotonic) is overdue by
    ``io_timeout``: then ``PeerLost``. ``ProtocolError`` for anything but a REPLY
    without payload and a short message."""
    view = reader.header(HEADER.size, idle_ok=True)
    if view is None:
        sent = oldest_sent()
        if sent is not None and time.monotonic() - sent > io_timeout:
            raise PeerLost(f"{name} sent no reply within {io_timeout}s")
        return None
    h = Header.unpack(view)
    if h.kind is not Kind.REPLY or h.desc_len > MAX_REPLY or h.payload_len:
        raise ProtocolError(f"{name} sent an unexpected {h.kind.name} frame")
    return h, reader.exact(h.desc_len).decode(errors="replace")


def shut(sock: socket.socket) -> None:
    """Shut a socket down both ways (wakes a thread blocked on it); errors ignored."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def unix_listener(address: str) -> socket.socket:
    """A listening Unix stream socket bound to ``address`` (abstract when it starts with
    NUL: nothing on disk, reachable within this network namespace only)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(address)
        listener.listen(64)
    except BaseException:
        listener.close()
        raise
    return listener


def require_positive(transport: str, **options: float) -> None:
    """ValueError naming ``transport`` and every option given that is not positive
    (timeouts in seconds, counts of threads or connections)."""
    bad = [f"{k}={v}" for k, v in options.items() if not v > 0]
    if bad:
        raise ValueError(f"{transport} transport needs positive {', '.join(options)}; got "
                         f"{', '.join(bad)}")


def endpoint_fields(raw: bytes, kind: str, version: int, *fields: str) -> list[Any]:
    """The ``fields`` of a JSON endpoint of ``kind`` and ``version``; ConnectError naming
    what is wrong otherwise (not JSON, another transport or version, a field missing)."""
    try:
        ep = json.loads(raw)
        got_kind, got_version = ep["kind"], ep["v"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConnectError(f"not a {kind} transport endpoint: {raw[:80]!r}") from e
    if got_kind != kind or got_version != version:
        raise ConnectError(f"endpoint is {got_kind!r} v{got_version}; this is {kind!r} "
                           f"v{version}")
    try:
        return [ep[f] for f in fields]
    except KeyError as e:
        raise ConnectError(f"{kind} endpoint lacks {e}: {raw[:80]!r}") from None


class ServedTransport(Transport):
    """A transport whose peers are :class:`WorkerPeer`\\ s and whose receiving side is a
    :class:`ThreadedServer` started by the subclass's ``endpoint()`` (under
    ``self._lock``, into ``self._server``). Peers are closed with the transport.

    The options every served transport takes are checked and kept here:
    ``io_timeout`` and ``connect_timeout`` (seconds), ``data_secret`` (the deployment
    secret's data-plane key; None: the endpoint's token alone) and
    ``max_connections_per_host`` (the server's cap per source address, kept as
    ``_max_per_host``). A subclass passes its own counts that must be positive in
    ``positive`` (``copy_threads=2``), so one ValueError names every bad option. Each
    transport also draws its endpoint's secret ``_token`` (the handshake key's material,
    never sent on a socket) and public ``_id`` here."""

    peer_type: ClassVar[type[WorkerPeer]]

    def __init__(self, *, io_timeout: float, connect_timeout: float,
                 data_secret: bytes | None, max_connections_per_host: int,
                 **positive: float) -> None:
        require_positive(self.name, io_timeout=io_timeout, connect_timeout=connect_timeout,
                         **positive, max_connections_per_host=max_connections_per_host)
        super().__init__()
        self._io_timeout, self._connect_timeout = io_timeout, connect_timeout
        self._data_secret = data_secret
        self._max_per_host = max_connections_per_host
        self._token = secrets.token_hex(16)
        self._id = new_endpoint_id()  # public: names the endpoint (shm: also its memfds)
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
        worker = self._admit(peer, notice, self.peer_type)
        self.check_sources(plan)
        return worker.submit(plan)

    def _close(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            peers = list(self._peers)
        for p in peers:
            p.close()
        if server is not None:
            server.close()
