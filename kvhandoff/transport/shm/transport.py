"""Same-host fast path: the sender copies straight into the receiver's shared memory.

The receiver allocates its destination buffers with :meth:`ShmTransport.allocate`
(memfd arenas, see :mod:`shm_arena`). ``connect`` opens a Unix socket to the receiver
(abstract namespace: nothing on disk), passes the mutual challenge–response of
:mod:`~kvhandoff.transport.framing.handshake` (keyed with the endpoint's token, or
HMAC(``data_secret``, token) with the deployment secret's data-plane key; the token is
never sent, and the socket's name carries only the public endpoint id), and receives
the arena file descriptors (``SCM_RIGHTS``) and the list of allocations. The sender maps
the arenas and builds a :class:`RegionTable` whose addresses are the *receiver's* and
whose buffers are its own mappings, so plan destination addresses resolve directly.

``submit`` queues the transfer for the peer's copier thread, which checks every
destination byte against the receiver's allocations (refused: nothing written),
copies with numpy views (one copy), then sends a COMMIT on the socket; the handle is
DONE when the receiver acknowledges it, so DONE also means "the receiver is alive".
A receiver that dies closes the socket (pending handles → PeerLost at once); one that
stops answering fails them after ``io_timeout``.

Trust (finding L9): the bounds check runs in the *sender's* copier, against the
allocations the receiver listed; once a peer passed the handshake it maps the
receiver's arenas read-write and could write anywhere in them. The handshake is what
keeps strangers out; an authenticated peer is trusted with the arenas (allocate only
KV destinations there). Connections from one process-namespace are capped
(``max_connections_per_host``).

Ordering: destinations allocated after a peer connected are not visible to it;
reconnect (the base contract's ordering rule).
"""

from __future__ import annotations

import json
import os
import queue
import socket
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvhandoff.layout import Region
from kvhandoff.plan.model import Plan, TensorPlan
from kvhandoff.transport.base import Availability, Capabilities, Handle, TransferState
from kvhandoff.transport.errors import (
    ConnectError,
    ProtocolError,
    RemoteOutOfBounds,
)
from kvhandoff.transport.framing.handshake import derive_key
from kvhandoff.transport.framing.io import recv_exact
from kvhandoff.transport.framing.served import (
    MAX_PER_HOST,
    ServedTransport,
    WorkerPeer,
    endpoint_fields,
    prove,
    shut,
)
from kvhandoff.transport.framing.wire import HEADER, Header, Kind, Status
from kvhandoff.transport.host import boot_id
from kvhandoff.transport.regions import U8, RegionTable, plan_side_problem
from kvhandoff.transport.shm.arena import Arenas, map_fd
from kvhandoff.transport.shm.server import MAX_FDS, ShmServer
from kvhandoff.transport.small import copy_views, plan_views
from kvhandoff.transport.views import by_source, copy_entry, split_work

ENDPOINT_VERSION = 2  # v2: the endpoint id, and the data-plane handshake


def _copy_all(entries: list[TensorPlan], src: RegionTable, dst: RegionTable) -> None:
    for e in entries:
        copy_entry(e, src, dst)


class _Job:
    __slots__ = ("handle", "plan", "sent_at", "seq")

    def __init__(self, handle: Handle, plan: Plan) -> None:
        self.handle, self.plan = handle, plan
        self.seq = 0
        self.sent_at: float | None = None


class ShmPeer(WorkerPeer):
    """Thread-safe. One copier thread (copies, then COMMITs) and one reader thread."""

    def __init__(self, endpoint: bytes, *, address: str, key: bytes, endpoint_id: str,
                 io_timeout: float, connect_timeout: float, table: Callable[[], RegionTable],
                 pool: ThreadPoolExecutor, pool_size: int) -> None:
        super().__init__(endpoint, f"shm:{endpoint_id[:8]}")
        self._pool, self._pool_size = pool, pool_size
        self._io_timeout = io_timeout
        self._local = table
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._inflight: deque[_Job] = deque()
        self._seq = 0
        self._sock, self.remote = self._dial(address, key, endpoint_id, connect_timeout)
        self._start((self._copy_loop, "kvh-shm-copy"), (self._read_loop, "kvh-shm-read"))

    def _dial(self, address: str, key: bytes, endpoint_id: str, timeout: float
              ) -> tuple[socket.socket, RegionTable]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fds: list[int] = []
        try:
            sock.settimeout(timeout)
            sock.connect(address)
            prove(sock, key=key, endpoint_id=endpoint_id, timeout=timeout, peer=self.name)
            sock.settimeout(timeout)
            sock.sendall(Header(Kind.HELLO, 0, 0, 0, 0).pack())
            first, fds, _flags, _addr = socket.recv_fds(sock, HEADER.size, MAX_FDS)
            if not first:
                raise EOFError("receiver closed the connection during the handshake")
            hdr = bytearray(first) + bytearray(HEADER.size - len(first))
            recv_exact(sock, memoryview(hdr)[len(first):])
            h = Header.unpack(hdr)
            body = bytearray(h.desc_len)
            recv_exact(sock, memoryview(body))
            if h.kind is not Kind.REPLY or h.code != Status.OK:
                raise ConnectError(f"receiver refused the handshake: "
                                   f"{body.decode(errors='replace')}")
            info = json.loads(body)
            maps = [map_fd(fd, int(n)) for fd, n in zip(fds, info["sizes"], strict=True)]
            blocks: list[tuple[Region, U8]] = []
            for ptr, n, arena, off in info["allocs"]:
                blocks.append((Region(ptr=int(ptr), nbytes=int(n)),
                               maps[int(arena)][int(off):int(off) + int(n)]))
            sock.settimeout(self._io_timeout)
            return sock, RegionTable(blocks)
        except ConnectError:
            sock.close()
            raise
        except (OSError, EOFError, ProtocolError, ValueError, KeyError, TypeError) as e:
            sock.close()
            raise ConnectError(f"shm handshake with {address!r} failed: {e}") from e
        finally:
            for fd in fds:
                os.close(fd)  # the mappings keep the memory

    def submit(self, plan: Plan) -> Handle:
        if not plan:
            return Handle.completed(peer=self.name)
        handle, job = self._open(plan.nbytes, lambda h: _Job(h, plan))
        if job is not None:
            self._queue.put(job)
        return handle

    def _copy_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None or self._error is not None:
                return
            if job.handle.state is not TransferState.PENDING:
                continue
            small = plan_views(job.plan, self.remote, "dst")  # a tiny handoff: no numpy
            problem = small if isinstance(small, str) else (
                None if small is not None else plan_side_problem(job.plan, self.remote, "dst"))
            if problem is not None:
                job.handle.set_failed(RemoteOutOfBounds(
                    f"{self.name} refused the write: {problem} (shm destinations must come "
                    f"from the receiver's allocate(), before this peer connected)"))
                self._forget(job)
                continue
            src = plan_views(job.plan, self._local(), "src") if small is not None else None
            job.handle.mark_started()
            if isinstance(small, list) and isinstance(src, list):
                copy_views(small, src)
            else:
                self._copy(job.plan)
            job.plan = Plan(entries=())  # drop references to the plan's arrays
            self._seq += 1
            job.seq = self._seq
            self._inflight.append(job)
            self._sock.sendall(Header(Kind.WRITE, 0, job.seq, 0, 0).pack())
            job.sent_at = time.monotonic()

    def _copy(self, plan: Plan) -> None:
        """Copy every entry; with a pool, share the units between this thread and the
        pool's (scattered small pages are bound by per-page overhead, not bandwidth,
        so two threads nearly double them)."""
        src, dst = self._local(), self.remote
        entries = tuple(by_source(e) for e in plan.entries)  # contiguous source blocks
        parts = split_work(entries, 1 + (self._pool_size if plan.nbytes >= 4 << 20 else 0))
        futures = [self._pool.submit(_copy_all, part, src, dst) for part in parts[1:] if part]
        try:
            _copy_all(parts[0], src, dst)
        finally:
            for f in futures:
                f.result()  # bounded: a memory copy; re-raises a worker's error

    def _read_loop(self) -> None:
        self._read_replies(self._sock, self._inflight, self._io_timeout, self._replied)

    def _wake(self) -> None:
        shut(self._sock)
        self._queue.put(None)

    def _release(self) -> None:
        self._sock.close()
        self.remote = RegionTable()  # unmaps once the last view is gone


class ShmTransport(ServedTransport):
    """Same-host transport. Destinations must be allocated with :meth:`allocate`;
    sources may be any registered host memory. Options: ``io_timeout`` (default 30 s),
    ``connect_timeout`` (default 5 s; also bounds the handshake), ``copy_threads``
    (threads sharing one transfer's copies, default 2), ``data_secret`` (the deployment
    secret's data-plane key; None: the token alone), ``max_connections_per_host``
    (default 32)."""

    name = "shm"
    capabilities = Capabilities(strided=True, cross_host=False, needs_allocate=True,
                                 self_completing=True)
    peer_type = ShmPeer

    def __init__(self, *, io_timeout: float = 30.0, connect_timeout: float = 5.0,
                 copy_threads: int = 2, data_secret: bytes | None = None,
                 max_connections_per_host: int = MAX_PER_HOST) -> None:
        super().__init__(io_timeout=io_timeout, connect_timeout=connect_timeout,
                         data_secret=data_secret,
                         max_connections_per_host=max_connections_per_host,
                         copy_threads=copy_threads)
        # helpers beside each peer's copier thread; threads start on first use
        self._pool_size = copy_threads - 1
        self._pool = ThreadPoolExecutor(max_workers=max(1, self._pool_size),
                                        thread_name_prefix="kvh-shm-copy-helper")
        self._arenas = Arenas(self._id[:8])

    @classmethod
    def usable(cls) -> Availability:
        if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
            return Availability(False, "needs Linux memfd_create and SCM_RIGHTS (Python 3.9+)")
        return Availability(True, "built in (same host only)")

    def allocate(self, nbytes: int) -> np.ndarray:
        self._check_open()
        buf = self._arenas.allocate(nbytes)
        self.register(buf)
        return buf

    def _table(self) -> RegionTable:
        return self.local

    def endpoint(self) -> bytes:
        self._check_open()
        with self._lock:
            if self._server is None:
                self._server = ShmServer(
                    f"\0kvhandoff-shm-{self._id}",
                    key=derive_key(self._token.encode(), self._data_secret),
                    endpoint_id=self._id, arenas=self._arenas, io_timeout=self._io_timeout,
                    max_per_host=self._max_per_host)
        return json.dumps({"kind": "shm", "v": ENDPOINT_VERSION, "host": boot_id(),
                           "address": f"kvhandoff-shm-{self._id}",
                           "token": self._token, "id": self._id}).encode()

    def connect(self, peer_endpoint: bytes) -> ShmPeer:
        self._check_open()
        host, address, token, eid = endpoint_fields(peer_endpoint, "shm", ENDPOINT_VERSION,
                                                    "host", "address", "token", "id")
        if host != boot_id():
            raise ConnectError("the shm transport only reaches peers on this host "
                               f"(peer boot id {host}, ours {boot_id()}); use tcp")
        return self._adopt(ShmPeer(
            peer_endpoint, address="\0" + str(address),
            key=derive_key(str(token).encode(), self._data_secret), endpoint_id=str(eid),
            io_timeout=self._io_timeout, connect_timeout=self._connect_timeout,
            table=self._table, pool=self._pool, pool_size=self._pool_size))

    def _close(self) -> None:
        super()._close()
        self._pool.shutdown(wait=True)
        self._arenas.close()
