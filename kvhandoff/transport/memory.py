"""The in-process transport: peers are other MemoryTransports in this process.

The mock the tests and same-process users rely on. ``submit`` validates both sides,
then copies with numpy strided views (one fancy-indexed assignment per piece) before
it returns, so every handle it returns is already final (a notice is handed to the
peer's handler on the submitting thread, after the copy). It keeps the full contract:
destinations outside the peer's registered memory refuse the whole submit before
anything is written, and a peer that was closed fails the handle with ``PeerLost``.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import weakref

from kvhandoff.plan.model import Plan
from kvhandoff.transport.base import Capabilities, Handle, Peer, Transport
from kvhandoff.transport.errors import (
    ConnectError,
    PeerLost,
    RemoteOutOfBounds,
    TransportClosed,
)
from kvhandoff.transport.regions import plan_side_problem
from kvhandoff.transport.views import copy_entry

_instances: weakref.WeakValueDictionary[str, MemoryTransport] = weakref.WeakValueDictionary()
_instances_lock = threading.Lock()


class MemoryPeer(Peer):
    def __init__(self, endpoint: bytes, target: MemoryTransport) -> None:
        super().__init__(endpoint, f"memory:{target.token}")
        self._target: MemoryTransport | None = target

    @property
    def target(self) -> MemoryTransport | None:
        return self._target

    @property
    def closed(self) -> bool:
        return self._target is None

    def close(self) -> None:
        self._target = None


class MemoryTransport(Transport):
    """Thread-safe; copies run in the submitting thread, concurrently across threads."""

    name = "memory"
    capabilities = Capabilities(strided=True, cross_process=False, cross_host=False,
                                 self_completing=True, notices=True)

    def __init__(self) -> None:
        super().__init__()
        self.token = secrets.token_hex(8)
        with _instances_lock:
            _instances[self.token] = self

    def endpoint(self) -> bytes:
        self._check_open()
        return json.dumps({"kind": "memory", "pid": os.getpid(), "token": self.token}).encode()

    def connect(self, peer_endpoint: bytes) -> MemoryPeer:
        self._check_open()
        try:
            ep = json.loads(peer_endpoint)
            kind, pid, token = ep["kind"], ep["pid"], ep["token"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConnectError(f"not a memory transport endpoint: {peer_endpoint[:80]!r}") from e
        if kind != "memory" or pid != os.getpid():
            raise ConnectError(
                f"memory transport peers must live in this process (pid {os.getpid()}); "
                f"endpoint is {kind!r} in pid {pid}"
            )
        with _instances_lock:
            target = _instances.get(token)
        if target is None or target.closed:
            raise ConnectError(f"no open memory transport {token} in this process")
        return MemoryPeer(peer_endpoint, target)

    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        peer = self._admit(peer, notice, MemoryPeer)
        if peer.closed:
            raise TransportClosed(f"peer {peer.name} is closed")
        self.check_sources(plan)
        handle = Handle(nbytes=plan.nbytes, peer=peer.name)
        target = peer.target
        if target is None or target.closed:
            handle.set_failed(PeerLost(f"memory transport {peer.name} was closed"))
            return handle
        dst = target.local
        problem = plan_side_problem(plan, dst, "dst")
        if problem is not None:
            handle.set_failed(RemoteOutOfBounds(f"{peer.name} refused the write: {problem}"))
            return handle
        src = self.local
        handle.mark_started()
        for e in plan.entries:
            copy_entry(e, src, dst)
        if notice is not None:
            target._deliver_notice(notice)
        handle.set_done()
        return handle

    def _close(self) -> None:
        with _instances_lock:
            _instances.pop(self.token, None)
