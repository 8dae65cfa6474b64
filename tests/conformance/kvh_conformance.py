"""Helpers for the transport conformance suite (imported by its tests and conftest)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhandoff.lab.testing.params import transport_params
from kvhandoff.lab.testing.transport import PlanBuilder, bump, noise, serve_peer
from kvhandoff.transport import (
    Peer,
    TransferState,
    Transport,
    available_transports,
    create_transport,
)

# A connect timeout short enough that refusals are seen quickly. The I/O timeout is not
# short: it bounds healthy transfers too (cma's receiver will not start a copy older than
# half of it), and a starved machine (`make test-stress`, 12 hogs on 2 cores) can hold a
# queued copy for seconds. Tests that want a frozen peer noticed pass their own.
_SHORT = {"io_timeout": 30.0, "connect_timeout": 3.0}
OPTIONS: dict[str, dict[str, Any]] = {n: dict(_SHORT) for n in ("tcp", "shm", "cma", "auto",
                                                                "mooncake", "nixl")}

def params() -> list[Any]:
    """One pytest param per known transport; unusable ones are skipped with the reason."""
    return transport_params()


def make(name: str, **extra: Any) -> Transport:
    return create_transport(name, **{**OPTIONS.get(name, {}), **extra})


@dataclass
class Pair:
    """A sender and a receiver transport in this process.

    Follows the contract's ordering: build plans (which registers memory on both
    sides) first, then :meth:`connect` (a fresh endpoint, a fresh peer)."""

    sender: Transport
    receiver: Transport
    peer: Peer | None = None

    def connect(self) -> Peer:
        if self.peer is not None:
            self.peer.close()
        self.peer = self.sender.connect(self.receiver.endpoint())
        return self.peer

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()

    def builder(self, seed: int = 0) -> PlanBuilder:
        def src_alloc(n: int) -> np.ndarray:
            a = np.empty(n, np.uint8)
            self.sender.register(a)
            return a

        def dst_alloc(n: int) -> tuple[int, np.ndarray]:
            a = self.receiver.allocate(n)
            a[:] = noise(rng, n)
            return int(a.ctypes.data), a

        rng = np.random.default_rng(seed)
        return PlanBuilder(rng, src_alloc, dst_alloc)


def deliver(pair: Pair, kind: str, seed: int = 0, timeout: float = 60.0) -> Peer:
    """Build a ``kind`` plan, connect afresh, send it, and check every destination
    tensor against the numpy executor; returns the peer used."""
    b = pair.builder(seed)
    p = b.plan(kind)
    want = b.expected(p)
    peer = pair.connect()
    h = pair.sender.submit(peer, p)
    assert pair.sender.wait(h, timeout) is TransferState.DONE, h.error
    assert pair.sender.poll(h) is TransferState.DONE
    assert h.nbytes == p.nbytes
    h.release()
    for i, ((_, got), exp) in enumerate(zip(b.dsts, want, strict=True)):
        assert np.array_equal(got, exp), f"{kind}: destination tensor {i} differs"
    return peer


class RemotePeer:
    """A receiving transport in a spawned child process (see ``serve_peer``)."""

    def __init__(self, name: str, nbytes: int, seed: int = 7) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve_peer,
                                args=(child, name, OPTIONS.get(name, {}), nbytes, seed),
                                daemon=True)
        self.proc.start()
        child.close()
        self._closed = False
        try:
            if not self.conn.poll(60):
                raise TimeoutError("child transport did not start within 60 s")
            self.endpoint, self.base = self.conn.recv()
        except BaseException:
            self.kill()
            raise
        self.mirror = noise(np.random.default_rng(seed), nbytes)

    def builder(self, sender: Transport, seed: int = 0) -> PlanBuilder:
        def src_alloc(n: int) -> np.ndarray:
            a = np.empty(n, np.uint8)
            sender.register(a)
            return a

        return PlanBuilder(np.random.default_rng(seed), src_alloc, bump(self.base, self.mirror))

    def buffer(self) -> np.ndarray:
        self.conn.send("bytes")
        if not self.conn.poll(60):
            raise TimeoutError("child did not answer")
        return np.frombuffer(self.conn.recv_bytes(), np.uint8)

    def assert_holds(self, dsts: list[tuple[int, np.ndarray]], want: list[np.ndarray]) -> None:
        """The child's buffer holds ``want[i]`` at every destination ``dsts[i]`` (the
        pairs a :meth:`builder`'s plan targets)."""
        got = self.buffer()
        for i, ((ptr, _), exp) in enumerate(zip(dsts, want, strict=True)):
            off = ptr - self.base
            assert np.array_equal(got[off:off + len(exp)], exp), f"destination {i} differs"

    def kill(self) -> None:
        """Idempotent; also frees the Process object's pipes (for fd accounting)."""
        if self._closed:
            return
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.conn.close()
        if not self.proc.is_alive():
            self.proc.close()
            self._closed = True

    def stop(self) -> None:
        """SIGSTOP the child (alive but silent), and wait until every one of its threads
        has stopped: the signal is delivered asynchronously, and a thread still running
        could answer one more request."""
        pid = self.proc.pid or 0
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not all(
                _task_state(pid, t) in ("T", "t", "") for t in _tasks(pid)):
            time.sleep(0.005)

    def close(self) -> None:
        if not self._closed and self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send("exit")
            self.proc.join(10)
        self.kill()


def _tasks(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def _task_state(pid: int, tid: str) -> str:
    """A thread's state letter from /proc ("T": stopped); "" if it is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def settle(measure: Callable[[], int], target: int, timeout: float = 120.0) -> int:
    """Poll ``measure`` until it drops to ``target`` (threads and fds close
    asynchronously); returns the last value. Patient: it returns as soon as the target is
    reached, so only a real leak waits the whole ``timeout`` — on a loaded machine an
    engine's threads can take many seconds to wind down."""
    deadline = time.monotonic() + timeout
    value = measure()
    while value > target and time.monotonic() < deadline:
        time.sleep(0.02)
        value = measure()
    return value


def thread_count() -> int:
    return threading.active_count()


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def serve_cuda_peer(conn: Any, name: str, nbytes: int, seed: int) -> None:
    """Child-process receiver in GPU memory: ``nbytes`` of noise (``seed``) in a CUDA
    tensor registered with a ``cuda=True`` transport; sends ``(endpoint, address)``,
    answers "bytes" with the tensor's bytes until "exit". (CUDA IPC, which engines use
    between processes on one host, cannot open a handle in the process that made it, so
    a GPU receiver lives in its own process.)"""
    import torch

    from kvhandoff.layout import MemoryKind, Region

    with make(name, cuda=True) as transport:
        buf = torch.from_numpy(noise(np.random.default_rng(seed), nbytes)).to("cuda")
        transport.register(Region(ptr=buf.data_ptr(), nbytes=buf.nbytes, memory=MemoryKind.CUDA,
                                  device=buf.device.index or 0))
        conn.send((transport.endpoint(), buf.data_ptr()))
        while conn.poll(120):
            cmd = conn.recv()
            if cmd == "bytes":
                torch.cuda.synchronize()
                conn.send_bytes(buf.cpu().numpy().tobytes())
            else:
                break


NOBODY = 65534


def serve_as_nobody(conn: Any, name: str, nbytes: int, seed: int) -> None:
    """``serve_peer``, after this child gave up root for user ``nobody`` (spawned as root:
    it imports what it needs first, since the interpreter's own files may not be
    readable by nobody)."""
    from kvhandoff.lab.testing.transport import serve_peer

    # import (and probe) every transport while still root: auto builds others lazily
    available_transports()
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    serve_peer(conn, name, OPTIONS.get(name, {}), nbytes, seed)


def connect_undumpable(conn: Any, name: str, endpoint: bytes) -> None:
    """A sender that made itself non-dumpable (``PR_SET_DUMPABLE 0``: only
    ``CAP_SYS_PTRACE`` holders may read it) connects to ``endpoint``; sends back
    ``"connected"`` or the error's text."""
    import ctypes

    from kvhandoff.transport import TransportError

    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    with make(name) as t:
        t.register(np.zeros(4096, np.uint8))
        try:
            t.connect(endpoint).close()
            conn.send("connected")
        except TransportError as e:
            conn.send(f"{type(e).__name__}: {e}")
