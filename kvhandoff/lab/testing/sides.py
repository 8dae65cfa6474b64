"""Run a session scenario's prefill ranks and decode ranks, in this process or in workers.

Test support. A *side* is every rank of one role in one process: :class:`PrefillSide`
builds each prefill rank's memory, layout and :class:`~kvhandoff.session.Agent`, then
drives its requests from one thread per rank (``Sender`` per request, chunks sent round
robin across requests, the last with state and aux); :class:`DecodeSide` does the same
with ``Receiver``\\ s and, once every request is terminal, checks its memory with
:class:`~kvhandoff.lab.testing.handoff.Verifier`.

:class:`Worker` runs a side in a ``spawn``-ed child process and talks to it over a pipe
(``run`` → result, ``close`` → leak report: live threads and file descriptors after the
agents closed). :func:`run_scenario` runs both sides (in two workers, or in threads
here for transports that cannot cross processes) and returns both sides' reports.

Fault knobs (``Scenario.faults``), read by the drivers:

* ``prefill_delay`` / ``chunk_delay`` (s): before the first chunk / between chunks.
* ``decode_abort`` / ``prefill_abort``: ``"bootstrapping"``, ``"waiting_for_input"`` or
  ``"transferring"`` — abort every request on that side once it is in that state. The
  driver records ``poll()`` right before ``abort()`` (:attr:`Outcome.aborted_in`), and
  prefill *holds* the request there until it is terminal: it sends no chunk
  (``bootstrapping`` / ``waiting_for_input``) or none after the first :data:`HOLD_ROUND`
  rounds (``transferring``), so the abort always finds the named state.
* ``decode_init_delay`` (s): decode waits this long before its first ``Receiver.init``
  (prefill's Senders stay in ``bootstrapping`` meanwhile).
* ``prefill_skip_last``: never send the last chunk.
* ``prefill_withhold`` (request ids): prefill sends these requests no chunk after the
  first :data:`HOLD_ROUND` rounds, so they cannot finish: for a test whose other decode
  deployment dies mid-transfer (``decode_exit`` on that side) while this prefill serves
  a healthy one too, which a hold of every request would starve.
* ``prefill_exit`` / ``decode_exit``: ``"transferring"`` — the process dies (``os._exit``)
  once a request reaches that state (for ``decode_exit`` prefill holds after
  :data:`HOLD_ROUND` rounds, so the requests cannot finish first).
* ``prefill_write_delay`` (s): prefill's tcp writes start this long after submit, so
  they are in flight when a test aborts (tcp only: :class:`~kvhandoff.lab.testing.faulty.
  DelayedTcp`; any other transport refuses it).
* ``reuse_after_abort``: decode, after an abort, waits for ``released`` and then writes a
  marker into the request's KV pages; the verifier checks the marker survived.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import os
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvhandoff.lab.testing.handoff import (
    DECODE,
    PREFILL,
    Arena,
    RequestPlan,
    Scenario,
    Verifier,
    arena_key,
    aux_name,
    chunks_of,
    decode_lists,
    first_token,
    kv_name,
    layout_of,
    prefill_pages,
    prefill_state,
    request_of,
)
from kvhandoff.layout import Layout
from kvhandoff.session import (
    Agent,
    DecodeAgent,
    PrefillAgent,
    Receiver,
    Sender,
    SessionConfig,
    Status,
)
from kvhandoff.session.request.views import TensorViews
from kvhandoff.transport import Transport, create_transport

log = logging.getLogger("kvhandoff.lab.testing.sides")

MARKER = 0xA5
_TERMINAL = (Status.SUCCESS, Status.FAILED)
HOLD_ROUND = 2
"""Chunk rounds prefill sends before holding, when a request is to be aborted (or decode
killed) in ``transferring``: with a write delay, round 1's writes are still in flight
when round 0's complete and the request turns ``transferring``."""
PATIENCE = 120.0
"""The longest a driver waits for a state a fault needs (a request reaching the state
an abort or an exit is for, prefill holding requests for the fault to land, suspects to
clear). Each wait ends as soon as the state is reached; only a hang waits it out, so it
is long: a fault test must not depend on how fast a loaded machine gets there."""
HOLD_LIMIT = PATIENCE  # the longest prefill holds a request for the abort to land


@dataclass
class Outcome:
    """One request on one rank: final status, reason, release, timings."""

    rank: str
    rid: Any
    status: str
    reason: str | None
    released: bool = True
    release_reason: str = ""
    seconds: float = 0.0  # from the driver's start until terminal (and settled / released)
    aborted_in: str = ""  # poll() right before this side called abort(); "" if it did not


@dataclass
class SideReport:
    outcomes: list[Outcome] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # verification failures, driver crashes
    stats: dict[str, dict[str, int]] = field(default_factory=dict)

    def by_status(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.outcomes:
            out[o.status] = out.get(o.status, 0) + 1
        return out


def config_of(scn: Scenario) -> SessionConfig:
    # the timers a scenario does not test are patient (PATIENCE): on a loaded machine a
    # bootstrap, a claim or a chunk may take long, and must not look like a fault
    base: dict[str, Any] = {"bootstrap_timeout": PATIENCE, "heartbeat_interval": 0.2,
                            "heartbeat_timeout": 3.0, "transfer_timeout": PATIENCE,
                            "lease": PATIENCE, "release_timeout": 5.0, "workers": 2,
                            "transport": scn.transport,
                            "transport_options": dict(scn.transport_options)}
    base.update(scn.config)
    return SessionConfig.from_env({}, **base)


def _transport(scn: Scenario, role: str = "") -> Transport:
    """The transport of a side: keyed as its agent keys its own (``config_of``)."""
    opts: dict[str, Any] = ({"io_timeout": 5.0, "connect_timeout": 5.0,
                             "data_secret": config_of(scn).data_key()}
                            if scn.transport != "memory" else {})
    opts.update(scn.transport_options)
    delay = scn.faults.get(f"{role}_write_delay")
    if delay:  # writes that start late: in flight for a while (tcp only)
        if scn.transport != "tcp":
            raise ValueError(f"{role}_write_delay needs the tcp transport, not "
                             f"{scn.transport!r}")
        from kvhandoff.lab.testing.faulty import DelayedTcp
        return DelayedTcp(delay=float(delay), **opts)
    return create_transport(scn.transport, **opts)


def _wait(pred: Any, timeout: float, step: float = 0.002) -> bool:
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / step) + 2):
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return bool(pred())


def _in_state(x: Sender | Receiver, state: str) -> bool:
    return x.poll().value == state


class _Side:
    """Common part: agents, transports, driver threads, teardown."""

    role = ""

    def __init__(self, scn: Scenario, url: str) -> None:
        self.scn, self.url = scn, url
        self.config = config_of(scn)
        self.agents: list[Agent] = []
        self.report = SideReport()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._aborted_in: dict[tuple[str, Any], str] = {}

    def _spawn(self, target: Any, *args: Any) -> threading.Thread:
        def run() -> None:
            try:
                target(*args)
            except Exception:
                with self._lock:
                    self.report.problems.append(f"{self.role} driver crashed:\n"
                                                f"{traceback.format_exc()}")
        t = threading.Thread(target=run, name=f"driver-{self.role}-{len(self._threads)}")
        self._threads.append(t)
        t.start()
        return t

    def join(self, timeout: float) -> SideReport:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                self.report.problems.append(f"{self.role} driver {t.name} did not finish")
        self.finish()
        # a request leaves the agent's table just after its settled / released event is
        # set: give that bookkeeping a moment before taking the numbers
        _wait(lambda: all(a.live_requests == 0 for a in self.agents), 2.0, 0.01)
        # a peer a write was lost to is probed until it answers or is declared lost
        # (and dropped): within heartbeat_timeout plus a tick
        _wait(lambda: all(a.stats.get("suspect_peers", 0) == 0 for a in self.agents),
              PATIENCE, 0.02)
        self.report.stats = {a.name: a.stats for a in self.agents}
        return self.report

    def finish(self) -> None:
        """After every driver returned (override: verification)."""

    def close(self) -> None:
        for a in self.agents:
            a.close()

    def abort(self, rank: str, x: Sender | Receiver, state: str) -> None:
        """Abort ``x``, recording the state it was in right before."""
        seen = x.poll().value
        with self._lock:  # before abort(): the driver may record the outcome right after
            self._aborted_in[(rank, x.request_id)] = seen
        x.abort(f"test abort in {state}")

    def outcome(self, rank: str, x: Sender | Receiver, t0: float) -> None:
        rel = x.released if isinstance(x, Receiver) else x.settled
        rr = x.release_reason if isinstance(x, Receiver) else ""
        with self._lock:
            seen = self._aborted_in.get((rank, x.request_id), "")
            self.report.outcomes.append(Outcome(rank, x.request_id, x.poll().value, x.reason,
                                                rel, rr, time.monotonic() - t0, seen))


class PrefillSide(_Side):
    role = "prefill"

    def start(self, dp_groups: list[int] | None = None) -> None:
        scn = self.scn
        for dp, tp, pp in scn.topo.prefill_ranks():
            if dp_groups is not None and dp not in dp_groups:
                continue
            transport = _transport(scn, "prefill")
            arena = Arena(arena_key(scn, PREFILL, dp, tp, pp))
            layout = layout_of(scn.topo, PREFILL, tp, pp, arena)
            agent = Agent(layout, role="prefill", bootstrap_url=self.url, dp_rank=dp,
                          dp_size=scn.topo.dp_size, config=self.config, transport=transport,
                          name=f"prefill-dp{dp}-tp{tp}-pp{pp}")
            self.agents.append(agent)
            mine = [rp for rp in scn.requests if scn.dp_of(rp) == dp]
            self._spawn(self.drive, agent, layout, mine, arena)

    def drive(self, agent: PrefillAgent, src: Layout, mine: list[RequestPlan],
              arena: Arena) -> None:
        del arena
        scn, f = self.scn, self.scn.faults
        dst = _peer_layout(scn, DECODE)
        kv, ax = kv_name(src), aux_name(src)
        views = TensorViews(src)
        aux_t = src.component(ax).tensors[0] if ax else None
        t0 = time.monotonic()
        work = []
        for rp in mine:
            s = Sender(agent, rp.rid)
            req = request_of(scn, rp, src, dst)
            pages = prefill_pages(scn.topo, rp, req, kv)
            s.init(len(pages), rp.block + 1 if ax else None,
                   num_tokens=rp.num_tokens if scn.topo.prefill_page != scn.topo.decode_page
                   else None)
            if aux_t is not None:
                row = views.row(aux_t, rp.block + 1)
                assert row is not None
                from kvhandoff.lab.testing.handoff import AUX
                AUX.pack(row, first_token=first_token(rp.rid), first_logprob=-0.5)
            work.append((rp, s, chunks_of(rp, pages), prefill_state(req, src)))
        senders = [s for _, s, _, _ in work]
        aborter = (self._abort_at(agent.name, str(f["prefill_abort"]), senders)
                   if f.get("prefill_abort") else None)
        if f.get("prefill_delay"):
            time.sleep(float(f["prefill_delay"]))
        hold = self._hold_round()
        withheld = set(f.get("prefill_withhold") or ())
        depth = max((len(c) for _, _, c, _ in work), default=0)
        for k in range(depth):
            if k == hold:
                self._hold(agent.name, senders)
            for rp, s, chunks, state in work:
                if k >= len(chunks) or (k >= HOLD_ROUND and rp.rid in withheld):
                    continue
                last = k == len(chunks) - 1
                if last and f.get("prefill_skip_last"):
                    continue
                s.send(chunks[k], state_indices=state if last else None, last=last)
            if f.get("chunk_delay"):
                time.sleep(float(f["chunk_delay"]))
            if f.get("prefill_exit") == "transferring" and k == 0:
                _wait(lambda: any(_in_state(s, "transferring") for _, s, _, _ in work),
                      PATIENCE)
                os._exit(3)
        if aborter is not None:  # every abort recorded before the outcomes
            aborter.join(scn.timeout)
        for rp, s, _, _ in work:
            s.wait(scn.timeout)
            s.wait_settled(scn.timeout)
            self.outcome(agent.name, s, t0)
            del rp

    def _abort_at(self, rank: str, state: str, senders: list[Sender]) -> threading.Thread:
        def run() -> None:
            for s in senders:
                _wait(lambda s=s: _in_state(s, state) or s.poll() in _TERMINAL, PATIENCE)
                self.abort(rank, s, state)
        return self._spawn(run)

    def _hold_round(self) -> int | None:
        """The chunk round before which this side waits for every request to end (see
        the module docstring), or None."""
        f = self.scn.faults
        planned = {f.get("decode_abort"), f.get("prefill_abort"), f.get("decode_exit")}
        if "transferring" in planned:
            return HOLD_ROUND
        if planned & {"bootstrapping", "waiting_for_input"}:
            return 0
        return None

    def _hold(self, rank: str, senders: list[Sender]) -> None:
        if not _wait(lambda: all(s.poll() in _TERMINAL for s in senders), HOLD_LIMIT, 0.005):
            with self._lock:
                self.report.problems.append(
                    f"{rank}: held {HOLD_LIMIT:g} s for the fault, requests still "
                    f"{[s.poll().value for s in senders]}")


class DecodeSide(_Side):
    role = "decode"

    def start(self) -> None:
        scn = self.scn
        self.verifiers: list[tuple[Verifier, Layout, Arena]] = []
        self.done: dict[tuple[int, int], list[RequestPlan]] = {}
        self.failed: dict[tuple[int, int], list[RequestPlan]] = {}
        self.marked: dict[str, list[tuple[RequestPlan, str]]] = {}
        for tp, pp in scn.topo.decode_ranks():
            transport = _transport(scn)
            allocate = transport.allocate if transport.capabilities.needs_allocate else None
            arena = Arena(arena_key(scn, DECODE, 0, tp, pp), allocate)
            layout = layout_of(scn.topo, DECODE, tp, pp, arena)
            agent = Agent(layout, role="decode", config=self.config, transport=transport,
                          name=f"decode-tp{tp}-pp{pp}")
            self.agents.append(agent)
            self.verifiers.append((Verifier(scn, tp, pp, layout, arena), layout, arena))
            self.done[(tp, pp)] = []
            self.failed[(tp, pp)] = []
            self._spawn(self.drive, agent, layout, (tp, pp))

    def drive(self, agent: DecodeAgent, dst: Layout, where: tuple[int, int]) -> None:
        scn, f = self.scn, self.scn.faults
        src = _peer_layout(scn, PREFILL)
        t0 = time.monotonic()
        work: list[tuple[RequestPlan, Receiver]] = []
        for rp in scn.requests:
            r = Receiver(agent, self.url, rp.rid, dp_rank=rp.dp_rank)
            if f.get("decode_abort") == "bootstrapping":
                self.abort(agent.name, r, "bootstrapping")
            if f.get("decode_init_delay") and not work:
                time.sleep(float(f["decode_init_delay"]))
            lists, row = decode_lists(request_of(scn, rp, src, dst), dst)
            r.init(lists, row, decode_prefix_len=rp.prefix_len)
            work.append((rp, r))
        if f.get("decode_abort") in ("waiting_for_input", "transferring"):
            state = str(f["decode_abort"])
            for _, r in work:
                _wait(lambda r=r: _in_state(r, state) or r.poll() in _TERMINAL, PATIENCE)
                self.abort(agent.name, r, state)
        if f.get("decode_exit") == "transferring":
            # dies mid-transfer with every request's indices sent: a request whose indices
            # never left can only time out on prefill (indices_timeout), a different fault
            _wait(lambda: any(_in_state(r, "transferring") for _, r in work) and all(
                r.poll() is not Status.BOOTSTRAPPING for _, r in work), PATIENCE)
            time.sleep(0.05)  # ZeroMQ's I/O thread puts the queued indices on the wire
            os._exit(3)
        for rp, r in work:
            r.wait(scn.timeout)
            if r.poll() is Status.FAILED:
                r.wait_released(scn.timeout)
            self.outcome(agent.name, r, t0)
            with self._lock:
                (self.done if r.poll() is Status.SUCCESS else self.failed)[where].append(rp)
            if r.poll() is not Status.SUCCESS and f.get("reuse_after_abort") and r.released:
                self._mark(agent, dst, rp, src)

    def _mark(self, agent: DecodeAgent, dst: Layout, rp: RequestPlan, src: Layout) -> None:
        """Reuse an aborted request's KV pages: write the marker into them."""
        kv = kv_name(dst)
        if kv is None:
            return
        idx = request_of(self.scn, rp, src, dst)[kv]
        assert idx is not None
        for t in dst.component(kv).tensors:
            buf = agent.views.tensor(t)
            if buf is None:
                continue
            for p in idx.dst.tolist():
                buf[p * t.item_stride:p * t.item_stride + t.item_bytes] = MARKER
        with self._lock:
            self.marked.setdefault(agent.name, []).append((rp, kv))

    def finish(self) -> None:
        if not self.scn.verify:
            return
        if self.scn.faults.get("reuse_after_abort"):
            # writes in flight at the abort land within the write delay: give any that
            # (wrongly) outlived "released" time to land before looking at the marker
            time.sleep(3 * float(self.scn.faults.get("prefill_write_delay", 0.1)) + 0.3)
        if self.scn.faults.get("reuse_after_abort") and not any(self.marked.values()):
            self.report.problems.append("reuse_after_abort: no aborted request's pages were "
                                        "reused (nothing for the marker check to check)")
        for (v, layout, arena), key in zip(self.verifiers, self.done, strict=True):
            if self.scn.faults.get("reuse_after_abort"):
                self.report.problems += self._check_marks(layout, arena, key)
            # a failed request's destination may hold anything (the marker included);
            # every other byte must be as the oracle says
            self.report.problems += v.check(self.done[key], self.failed[key])

    def _check_marks(self, dst: Layout, arena: Arena, where: tuple[int, int]) -> list[str]:
        """After the reuse-after-abort run: the marker must still be in every page the
        decode engine reused (no stale write landed after ``released``)."""
        del arena
        name = f"decode-tp{where[0]}-pp{where[1]}"
        out = []
        views = TensorViews(dst)
        src = _peer_layout(self.scn, PREFILL)
        for rp, kv in self.marked.get(name, []):
            idx = request_of(self.scn, rp, src, dst)[kv]
            assert idx is not None
            for t in dst.component(kv).tensors:
                buf = views.tensor(t)
                if buf is None:
                    continue
                rows = np.stack([buf[p * t.item_stride:p * t.item_stride + t.item_bytes]
                                 for p in idx.dst.tolist()]) if len(idx.dst) else None
                if rows is not None and not (rows == MARKER).all():
                    out.append(f"{name}: request {rp.rid!r} tensor {t.name} layer {t.layer_id}: "
                               f"a write landed after the pages were released")
        return out


def _peer_layout(scn: Scenario, side: int) -> Layout:
    """A layout of the other side with fake addresses: requests depend only on page sizes
    and capacities, which are the same on every rank of a side."""
    from kvhandoff.lab import shapes
    topo = scn.topo
    if side == PREFILL:
        return shapes.layout_for(topo.model(), tp_rank=0, tp_size=topo.prefill_tp,
                                 page_size=topo.prefill_page, num_pages=topo.num_pages,
                                 num_slots=topo.num_slots, pp_rank=0, pp_size=1)
    return shapes.layout_for(topo.model(), tp_rank=0, tp_size=topo.decode_tp,
                             page_size=topo.decode_page, num_pages=topo.num_pages,
                             num_slots=topo.num_slots)


# ---------------------------------------------------------------------------------------
# Worker processes


def _fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def _kvh_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvh")]


def _warm(name: str, warmed: set[str]) -> None:
    """Create and close one transport of this kind, so an engine's one-time process
    set-up (logging, allocators: descriptors it keeps for good) is not counted as a leak."""
    if name not in warmed:
        warmed.add(name)
        t = create_transport(name)
        t.endpoint()
        t.close()
        gc.collect()


def _start_side(role: str, scn: Scenario, url: str, groups: list[int] | None) -> _Side:
    if role == "prefill":
        p = PrefillSide(scn, url)
        p.start(groups)
        return p
    d = DecodeSide(scn, url)
    d.start()
    return d


def _serve(conn: Connection) -> None:
    """A worker's loop: ``("run", role, scenario, url)`` → report, ``("close",)`` → leaks."""
    side: _Side | None = None
    base_fds = 0
    warmed: set[str] = set()
    for _ in range(1_000_000):  # bounded; each command is one iteration
        try:
            cmd = conn.recv()
        except EOFError:
            break
        if cmd[0] == "run":
            _, role, scn, url, groups = cmd
            _warm(scn.transport, warmed)
            base_fds = _fds()
            try:
                side = _start_side(role, scn, url, groups)
                report = side.join(scn.timeout + 30)
            except Exception:
                report = SideReport(problems=[f"{role} side failed:\n{traceback.format_exc()}"])
            conn.send(report)
        elif cmd[0] == "close":
            if side is not None:
                side.close()
                side = None
                gc.collect()  # buffers mapped from a transport's arena hold a descriptor
            threads, fds = _kvh_threads(), _fds() - base_fds
            for _ in range(100):  # transports' helper threads may take a moment to exit
                if not threads and fds <= 0:
                    break
                time.sleep(0.02)
                threads, fds = _kvh_threads(), _fds() - base_fds
            conn.send({"threads": threads, "fds": fds})
        elif cmd[0] == "exit":
            break


class Worker:
    """A spawned process that runs one side at a time; see :func:`_serve`."""

    def __init__(self, name: str) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), name=name, daemon=True)
        self.proc.start()
        child.close()

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def run(self, role: str, scn: Scenario, url: str, groups: list[int] | None = None) -> None:
        self._conn.send(("run", role, scn, url, groups))

    def result(self, timeout: float) -> SideReport | None:
        """The side's report, or None if the process died or did not answer in time."""
        if not self._conn.poll(timeout):
            return None
        try:
            report: SideReport = self._conn.recv()
        except EOFError:
            return None
        return report

    def close_side(self, timeout: float = 30.0) -> dict[str, Any] | None:
        try:
            self._conn.send(("close",))
        except (BrokenPipeError, OSError):
            return None
        if not self._conn.poll(timeout):
            return None
        try:
            leaks: dict[str, Any] = self._conn.recv()
        except EOFError:
            return None
        return leaks

    def stop(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self._conn.send(("exit",))
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._conn.close()


@dataclass
class RunResult:
    prefill: SideReport
    decode: SideReport
    prefill_leaks: dict[str, Any] | None
    decode_leaks: dict[str, Any] | None

    @property
    def problems(self) -> list[str]:
        return self.prefill.problems + self.decode.problems


def run_scenario(scn: Scenario, url: str, prefill: Worker | None = None,
                 decode: Worker | None = None) -> RunResult:
    """Run both sides: in the given workers (cross-process), or in threads of this
    process when no worker is given (the memory transport)."""
    limit = scn.timeout + 60
    if prefill is None or decode is None:
        p, d = PrefillSide(scn, url), DecodeSide(scn, url)
        try:
            p.start()
            d.start()
            dr, pr = d.join(limit), p.join(limit)
        finally:
            d.close()
            p.close()
        return RunResult(pr, dr, None, None)
    prefill.run("prefill", scn, url)
    decode.run("decode", scn, url)
    dr = decode.result(limit) or SideReport(problems=["decode worker gave no report"])
    pr = prefill.result(limit) or SideReport(problems=["prefill worker gave no report"])
    dl = decode.close_side()
    pl = prefill.close_side()
    return RunResult(pr, dr, pl, dl)


class WorkerPair:
    """A prefill and a decode worker; :meth:`get` replaces any that died (fault tests
    kill them on purpose)."""

    def __init__(self, tag: str = "kvh-test") -> None:
        self.tag = tag
        self.prefill = Worker(f"{tag}-prefill")
        self.decode = Worker(f"{tag}-decode")

    def get(self) -> tuple[Worker, Worker]:
        if not self.prefill.alive:
            self.prefill.stop()
            self.prefill = Worker(f"{self.tag}-prefill")
        if not self.decode.alive:
            self.decode.stop()
            self.decode = Worker(f"{self.tag}-decode")
        return self.prefill, self.decode

    def stop(self) -> None:
        self.prefill.stop()
        self.decode.stop()


@contextlib.contextmanager
def workers() -> Iterator[tuple[Worker, Worker]]:
    """A prefill worker and a decode worker, stopped on exit."""
    p, d = Worker("kvh-test-prefill"), Worker("kvh-test-decode")
    try:
        yield p, d
    finally:
        p.stop()
        d.stop()
