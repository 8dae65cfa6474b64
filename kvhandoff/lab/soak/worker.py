"""A soak worker process: one prefill instance (all its TP ranks) or one decode instance,
with one agent per rank per transport, serving requests from the parent over a pipe.

Started with ``spawn`` (:func:`serve`). The parent sends :class:`Job`\\ s; each runs on a
thread of its own and answers one :class:`Ended` (any thread may answer: sends are
serialised by a lock). Prefill writes the request's fill (:mod:`kvhandoff.lab.soak.pattern`)
into its block, then sends it in chunks from every rank; decode opens a ``Receiver``
per request and, for a ``SUCCESS``, compares every byte the oracle says landed with the
fill. A request marked ``flip`` has one source byte of its first chunk flipped right
after ``send`` returned with every decode index in, so the chunk's writes were submitted
and its checksum taken (decode agents ask for checksums): the byte either was read before
the flip (the request succeeds, bytes intact) or after it (decode must fail it on the
checksum). A flip before the chunk's submission would be the engine handing over wrong
data, which no transport can detect, so it is never done. :data:`LEAKS` closes every
agent and answers :class:`Leaks`: what is still open compared with just before the agents
started.

Only the session layer's public API is used (``Agent``, ``Sender``, ``Receiver``,
``SessionConfig``), as an engine would.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.soak.messages import (
    LEAKS,
    Ended,
    Failed,
    Job,
    Leaks,
    Ready,
    WorkerSpec,
    prefill_instance,
)
from kvhandoff.lab.soak.pattern import (
    DECODE,
    PREFILL,
    Geometry,
    MirrorArena,
    byte_map,
    expected,
    fake_layouts,
    fill,
    indices,
    request_key,
)
from kvhandoff.lab.testing.handoff import (
    AUX,
    aux_name,
    decode_lists,
    first_token,
    kv_name,
    prefill_state,
)
from kvhandoff.lab.testing.oracle import ByteMap
from kvhandoff.layout import Layout
from kvhandoff.session import (
    Agent,
    Receiver,
    Sender,
    SessionConfig,
    Status,
    as_decode,
    as_prefill,
)
from kvhandoff.session.request.views import TensorViews
from kvhandoff.transport import create_transport

_TERMINAL = (Status.SUCCESS, Status.FAILED)

def _fds() -> tuple[int, int]:
    """Open descriptors and, of them, sockets."""
    total = sockets = 0
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            total += 1
            with contextlib.suppress(OSError):
                sockets += os.readlink(f"/proc/self/fd/{name}").startswith("socket:")
    return total, sockets


@dataclass(slots=True)
class _Rank:
    agent: Agent
    layout: Layout
    arena: MirrorArena


class _Worker:
    """The agents of this process and the request threads."""

    def __init__(self, spec: WorkerSpec, conn: Connection) -> None:
        self.spec, self.conn = spec, conn
        self.geo = spec.geometry
        self._send_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.bootstrap: BootstrapServer | None = None
        if spec.bootstrap_port:
            self.bootstrap = BootstrapServer(spec.host, spec.bootstrap_port)
            self.bootstrap.start()
        for name in spec.transports:  # engines' one-time set-up is not a leak
            t = create_transport(name)
            t.endpoint()
            if t.capabilities.needs_allocate:
                t.allocate(4096)  # shm keeps one memfd for good after its first arena
            t.close()
        gc.collect()
        self.base_fds = _fds()
        self.ranks: dict[str, list[_Rank]] = {}
        try:
            for name in spec.transports:
                self.ranks[name] = [self._rank(name, tp) for tp in range(self.geo.tp(spec.role))]
        except BaseException:
            self.close()
            raise

    def _rank(self, transport: str, tp: int) -> _Rank:
        spec = self.spec
        instance = (prefill_instance(spec.index, transport) if spec.role == PREFILL
                    else f"soak-d{spec.index}")
        where: dict[str, Any] = {"host": spec.host, "advertise_host": spec.host} \
            if spec.host else {}
        options: dict[str, Any] = {"host": spec.host} if spec.host else {}
        cfg = SessionConfig.from_env({}, **{**spec.session, **where, "instance": instance,
                                            "transport": transport,
                                            "transport_options": options,
                                            "checksum": spec.role == DECODE})
        tr = create_transport(transport, **options)
        allocate = tr.allocate if tr.capabilities.needs_allocate and spec.role == DECODE \
            else None
        arena = MirrorArena(self.geo.fake_base(spec.role, tp), allocate)
        layout = self.geo.layout(spec.role, tp, arena)
        name = f"{spec.role}{spec.index}-{transport}-tp{tp}"
        if spec.role == PREFILL:
            agent: Agent = Agent(layout, role="prefill", bootstrap_url=spec.url, config=cfg,
                                 transport=tr, name=name)
        else:
            agent = Agent(layout, role="decode", config=cfg, transport=tr, name=name)
        return _Rank(agent, layout, arena)

    def answer(self, msg: object) -> None:
        with self._send_lock, contextlib.suppress(OSError):
            self.conn.send(msg)

    def start(self, job: Job) -> None:
        target = self._prefill if self.spec.role == PREFILL else self._decode
        t = threading.Thread(target=self._guarded, args=(target, job), daemon=True,
                             name=f"soak-req-{job.spec.rid}")
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _guarded(self, target: Any, job: Job) -> None:
        t0 = time.monotonic()
        try:
            self.answer(target(job, t0))
        except Exception as e:  # an answer the parent can count, never a silent thread
            self.answer(Ended(rid=job.spec.rid, role=self.spec.role, worker=self.spec.index,
                              status="failed", reason=f"soak worker: {type(e).__name__}: {e}\n"
                              f"{traceback.format_exc(limit=3)}", started=t0,
                              ended=time.monotonic()))

    # --- prefill ---------------------------------------------------------------------------

    def _prefill(self, job: Job, t0: float) -> Ended:
        spec, geo = job.spec, self.geo
        ranks = self.ranks[spec.transport]
        req = indices(geo, spec.num_tokens, job.prefill_block, job.decode_block)
        bm = byte_map(geo, req)
        key = request_key(spec.rid)
        slot = job.prefill_block + 1
        for li, rk in enumerate(ranks):
            _, src = bm.of_layout(li)
            rk.arena.write(src, fill(key, src))
            ax = aux_name(rk.layout)
            if ax is not None:
                row = TensorViews(rk.layout).row(rk.layout.component(ax).tensors[0], slot)
                assert row is not None
                AUX.pack(row, first_token=first_token(spec.rid), first_logprob=-0.5)
        kv = kv_name(ranks[0].layout)
        kv_idx = req[kv] if kv is not None else None
        pages = kv_idx.src if kv_idx is not None else np.zeros(0, np.int64)
        step = max(1, spec.chunk_pages)
        chunks = [pages[i:i + step] for i in range(0, len(pages), step)] or [pages[:0]]
        state = prefill_state(req, ranks[0].layout)
        senders = [Sender(as_prefill(rk.agent), spec.rid) for rk in ranks]
        for s in senders:
            s.init(len(pages), slot)
        flip_ready = spec.flip and _wait(
            lambda: senders[0].poll() is not Status.BOOTSTRAPPING, min(job.limit, 10.0))
        flipped = False
        for k, chunk in enumerate(chunks):
            last = k == len(chunks) - 1
            for s in senders:
                s.send(chunk, state_indices=state if last else None, last=last)
            if k == 0 and flip_ready and len(chunk):
                flipped = self._flip(ranks[0], bm, int(chunk[0]), kv)
            if k == 0 and spec.abort is not None and spec.abort.side == PREFILL:
                time.sleep(spec.abort.after)
                for s in senders:
                    s.abort("soak: chaos abort")
                break
        statuses = [s.wait(job.limit) for s in senders]
        status_at = time.monotonic()
        settled = all(s.wait_settled(job.limit) for s in senders)
        hung = [s for s, st in zip(senders, statuses, strict=True) if st not in _TERMINAL]
        for s in hung:
            s.abort("soak: no terminal status within the limit")
        failed = [s for s in senders if s.poll() is Status.FAILED]
        status = "hung" if hung else "failed" if failed else "success"
        reason = "; ".join(str(s.reason) for s in failed)
        return Ended(rid=spec.rid, role=PREFILL, worker=self.spec.index, status=status,
                     reason=reason, started=t0, ended=time.monotonic(), status_at=status_at,
                     settled=settled, flipped=flipped)

    def _flip(self, rank: _Rank, bm: ByteMap, page: int, kv: str | None) -> bool:
        """Flip one source byte of KV ``page`` (already submitted: its digest is taken)."""
        if kv is None:
            return False
        t = rank.layout.component(kv).tensors[0]
        fake = fake_tensor_ptr(self.geo, self.spec.role, kv)
        stride = t.item_stride or t.item_bytes
        lo = fake + page * stride
        _, src = bm.of_layout(0)
        inside = src[(src >= lo) & (src < lo + t.item_bytes)]
        if not len(inside):
            return False
        addr = inside[len(inside) // 2:len(inside) // 2 + 1]
        rank.arena.write(addr, rank.arena.read(addr) ^ np.uint8(0xFF))
        return True

    # --- decode ----------------------------------------------------------------------------

    def _decode(self, job: Job, t0: float) -> Ended:
        spec, geo = job.spec, self.geo
        rk = self.ranks[spec.transport][0]
        req = indices(geo, spec.num_tokens, job.prefill_block, job.decode_block)
        r = Receiver(as_decode(rk.agent), self.spec.url, spec.rid,
                     instance=prefill_instance(spec.prefill, spec.transport))
        lists, row = decode_lists(req, rk.layout)
        r.init(lists, row, decode_prefix_len=0)
        if spec.abort is not None and spec.abort.side == DECODE:
            time.sleep(spec.abort.after)
            r.abort("soak: chaos abort")
        st = r.wait(job.limit)
        status_at = time.monotonic()
        if st not in _TERMINAL:
            r.abort("soak: no terminal status within the limit")
        released = r.poll() is Status.SUCCESS or r.wait_released(job.limit)
        checked = wrong = 0
        if st is Status.SUCCESS:
            bm = byte_map(geo, req)
            got = rk.arena.read(bm.dst)
            checked, wrong = len(got), int(np.count_nonzero(got != expected(geo, spec.rid, bm)))
        return Ended(rid=spec.rid, role=DECODE, worker=self.spec.index,
                     status="hung" if st not in _TERMINAL else st.value,
                     reason=str(r.reason or ""), started=t0, ended=time.monotonic(),
                     status_at=status_at, settled=released, release_reason=r.release_reason,
                     checked_bytes=checked, wrong_bytes=wrong)

    # --- the end ---------------------------------------------------------------------------

    def leaks(self) -> Leaks:
        for t in self._threads:
            t.join(5.0)
        live = sum(rk.agent.live_requests for rs in self.ranks.values() for rk in rs)
        self.close()
        threads: list[str] = []
        fds = sockets = 0
        for _ in range(100):  # helper threads and descriptors may take a moment to go
            threads = [t.name for t in threading.enumerate() if t.name.startswith("kvh")]
            now = _fds()
            fds, sockets = now[0] - self.base_fds[0], now[1] - self.base_fds[1]
            if not threads and fds <= 0 and sockets <= 0:
                break
            time.sleep(0.05)
        return Leaks(role=self.spec.role, index=self.spec.index, live_requests=live,
                     threads=threads, fds=max(fds, 0), sockets=max(sockets, 0),
                     request_threads=sum(t.is_alive() for t in self._threads))

    def close(self) -> None:
        for rs in self.ranks.values():
            for rk in rs:
                rk.agent.close()
        self.ranks = {}
        if self.bootstrap is not None:
            self.bootstrap.close()
        gc.collect()  # buffers mapped from a transport's arena hold a descriptor


def fake_tensor_ptr(geo: Geometry, role: str, component: str) -> int:
    """The fake address of rank 0's first tensor of ``component``."""
    srcs, dst = fake_layouts(geo)
    lay = srcs[0] if role == PREFILL else dst
    return lay.component(component).tensors[0].ptr


def _wait(pred: Any, timeout: float, step: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def enter_netns(name: str) -> None:
    """Move this process into network namespace ``name`` (``ip netns add`` made it), before
    any socket is opened; the pipe to the parent stays usable."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


def serve(conn: Connection, spec: WorkerSpec) -> None:
    """The process: start the agents, answer :class:`Ready` (or :class:`Failed`), then
    run :class:`Job`\\ s until :data:`LEAKS` (answered) or ``None`` / EOF."""
    import faulthandler

    faulthandler.enable()  # a crash in native code prints every thread's Python stack
    logging.basicConfig(format=f"%(asctime)s {spec.role}{spec.index} %(message)s")
    logging.getLogger().setLevel(spec.log_level)  # engines' own loggers (NIXL) too
    logging.getLogger("kvhandoff").setLevel(spec.log_level)
    if spec.log_level > logging.INFO:
        os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's glog INFO lines
    try:
        if spec.netns:
            enter_netns(spec.netns)
        w = _Worker(spec, conn)
    except Exception as e:
        conn.send(Failed(role=spec.role, index=spec.index,
                         error=f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))
        return
    w.answer(Ready(role=spec.role, index=spec.index, pid=os.getpid()))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg is None:
                break
            if msg == LEAKS:
                w.answer(w.leaks())
                break
            w.start(msg)
    finally:
        w.close()
