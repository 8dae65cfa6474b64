"""``kvhandoff soak``: the shell that runs a soak plan against real processes.

One bootstrap server (a thread here), ``prefills`` prefill and ``decodes`` decode worker
processes (:mod:`kvhandoff.lab.soak.worker`), requests handed out ``concurrency`` at a time
(:func:`~kvhandoff.lab.soak.plan.request_spec`), and the faults of
:func:`~kvhandoff.lab.soak.plan.chaos_schedule` executed on time: ``SIGKILL`` then a fresh
process after the hold, ``SIGSTOP`` then ``SIGCONT``. Each request owns a block of pages on
both sides until both sides answered; a block whose writes may still land is
quarantined instead of reused. Every wait here is bounded: the loop polls the pipes with
a short timeout, the drain at the end has a deadline, and a worker that does not answer
its leak question in time is reported, not waited for.

The parent samples each worker's RSS every second, prints progress every
:data:`PROGRESS_EVERY` seconds, and at the end prints the summary
(:func:`~kvhandoff.lab.soak.checker.summarise`) and the time-to-detect table
(:func:`~kvhandoff.lab.soak.checker.detection`) and writes both as JSON
(:mod:`~kvhandoff.lab.soak.report`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.soak.checker import Blocks, Record, detection, summarise
from kvhandoff.lab.soak.messages import LEAKS, Ended, Failed, Job, Leaks, Ready, WorkerSpec
from kvhandoff.lab.soak.plan import ChaosEvent, Fault, Settings, chaos_schedule, request_spec
from kvhandoff.lab.soak.report import Report
from kvhandoff.lab.soak.worker import serve
from kvhandoff.lab.testing import netns
from kvhandoff.lab.testing.netns import TwoHosts

PROGRESS_EVERY = 10.0
LANE_BOOTSTRAP_PORT = 18999  # the namespaced pair's own bootstrap server (in its prefill)
SESSION: dict[str, Any] = {
    "bootstrap_timeout": 10.0, "indices_timeout": 15.0, "waiting_timeout": 15.0,
    "transfer_timeout": 10.0, "release_timeout": 5.0, "heartbeat_interval": 0.5,
    "heartbeat_timeout": 3.0, "register_retries": 3, "workers": 2,
}
"""The workers' session timeouts: short, so a soak sees many faults end."""

START_TIMEOUT = 120.0  # a worker's agents must be up within this (a busy 2-core machine)


def job_limit(session: dict[str, Any], s: Settings) -> float:
    """How long a side waits for a terminal status: every timeout on its path, a freeze,
    and slack for a busy machine."""
    return float(session["bootstrap_timeout"] + session["indices_timeout"]
                 + session["waiting_timeout"] + session["transfer_timeout"]
                 + session["release_timeout"] + session["heartbeat_timeout"]
                 + s.max_freeze + 10.0)


@dataclass(slots=True)
class _Proc:
    """One worker's current process (``epoch`` counts its restarts)."""

    role: str
    index: int
    epoch: int
    proc: Any
    conn: Connection
    started: float
    pid: int = 0
    ready: bool = False
    frozen: bool = False

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"


@dataclass(slots=True)
class _Flight:
    rec: Record
    pblock: tuple[str, int, int, int]  # (worker, epoch, transport index, block)
    dblock: tuple[str, int, int, int]


def _readable(conns: list[Connection], timeout: float) -> list[Connection]:
    """The pipes of ``conns`` with something to read (or closed), within ``timeout``."""
    ready = wait(conns, timeout)
    return [c for c in conns if c in ready]


def _rss(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Soak:
    """One run; :meth:`run` returns its :class:`Report`."""

    def __init__(self, s: Settings, *, say: Callable[[str], None] = print,
                 session: dict[str, Any] | None = None, log_level: int = logging.ERROR
                 ) -> None:
        self.s = s
        self.log_level = log_level
        self.say = say
        self.session = dict(session or SESSION)
        self.limit = job_limit(self.session, s)
        self.events = chaos_schedule(s)
        self.ctx = mp.get_context("spawn")
        self.procs: dict[str, _Proc] = {}
        self.epochs: dict[str, int] = {}
        self.free: dict[tuple[str, int, int], list[int]] = {}  # (worker, epoch, transport)
        self.quarantined: dict[tuple[str, int, int], int] = {}
        self.flights: dict[str, _Flight] = {}
        self.records: list[Record] = []
        self.rss: dict[str, list[tuple[float, int]]] = {}
        self.problems: list[str] = []
        self.fault_times: dict[int, float] = {}
        self.pending: list[tuple[float, str, Any]] = []  # (when, "restart" | "thaw", name)
        self.url = ""
        self.hosts: TwoHosts | None = None  # the link-cut pair's namespaces (netcut)
        self.lane_url = ""

    # --- processes ---------------------------------------------------------------------------

    def _lane(self, role: str, index: int) -> bool:
        return index == (self.s.prefills if role == "prefill" else self.s.decodes)

    def _spec(self, role: str, index: int) -> WorkerSpec:
        base = WorkerSpec(role=role, index=index, url=self.url, transports=self.s.transports,
                          geometry=self.s.geometry, session=self.session,
                          log_level=self.log_level)
        if not self._lane(role, index):
            return base
        h = self.hosts
        assert h is not None
        ns, ip = (h.prefill_ns, h.prefill_ip) if role == "prefill" else (h.decode_ns,
                                                                           h.decode_ip)
        return dataclasses.replace(base, url=self.lane_url, transports=("tcp",), netns=ns,
                                   host=ip, bootstrap_port=LANE_BOOTSTRAP_PORT
                                   if role == "prefill" else 0)

    def _start(self, role: str, index: int) -> None:
        name = f"{role}{index}"
        epoch = self.epochs.get(name, -1) + 1
        self.epochs[name] = epoch
        parent, child = self.ctx.Pipe()
        spec = self._spec(role, index)
        proc = self.ctx.Process(target=serve, args=(child, spec), name=f"kvh-soak-{name}",
                                daemon=True)
        proc.start()
        child.close()
        self.procs[name] = _Proc(role, index, epoch, proc, parent, time.monotonic(),
                                 proc.pid or 0)
        for name_t in spec.transports:
            t = self.s.transports.index(name_t)
            self.free[(name, epoch, t)] = list(range(self.s.geometry.blocks))
            self.quarantined[(name, epoch, t)] = 0

    def _workers(self) -> list[tuple[str, int]]:
        lane = 1 if self.hosts is not None else 0
        return ([("prefill", i) for i in range(self.s.prefills + lane)]
                + [("decode", i) for i in range(self.s.decodes + lane)])

    def _kill(self, p: _Proc, why: str) -> None:
        """``p`` is gone (killed here, or died): its requests' sides are lost with it."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
        p.proc.join(10)
        p.conn.close()
        self.procs.pop(p.name, None)
        for t in range(len(self.s.transports)):
            self.free.pop((p.name, p.epoch, t), None)
            self.quarantined.pop((p.name, p.epoch, t), None)
        for fl in list(self.flights.values()):
            r = fl.rec
            if fl.pblock[:2] == (p.name, p.epoch) and r.prefill is None:
                r.prefill_died = True
            if fl.dblock[:2] == (p.name, p.epoch) and r.decode is None:
                r.decode_died = True
            self._maybe_done(fl)
        self.say(f"  {p.name}: {why}")

    # --- requests ----------------------------------------------------------------------------

    def _ready(self, role: str, want: int) -> _Proc | None:
        count = self.s.prefills if role == "prefill" else self.s.decodes
        for k in range(count):
            p = self.procs.get(f"{role}{(want + k) % count}")
            if p is not None and p.ready:
                return p
        return None

    def _dispatch(self, i: int) -> bool:
        spec = request_spec(self.s, i)
        if spec.lane:
            pp, dp = (self.procs.get(f"prefill{spec.prefill}"),
                      self.procs.get(f"decode{spec.decode}"))
            if pp is None or dp is None or not (pp.ready and dp.ready):
                return False
        else:
            pp, dp = self._ready("prefill", spec.prefill), self._ready("decode", spec.decode)
        if pp is None or dp is None:
            return False
        t = self.s.transports.index(spec.transport)
        pf, df = self.free.get((pp.name, pp.epoch, t)), self.free.get((dp.name, dp.epoch, t))
        if not pf or not df:
            return False
        spec = dataclasses.replace(spec, prefill=pp.index, decode=dp.index)
        pb, db = pf.pop(0), df.pop(0)
        job = Job(spec=spec, prefill_block=pb, decode_block=db, limit=self.limit)
        rec = Record(spec=spec, dispatched=time.monotonic(), limit=self.limit)
        self.records.append(rec)
        self.flights[spec.rid] = _Flight(rec, (pp.name, pp.epoch, t, pb),
                                         (dp.name, dp.epoch, t, db))
        for p in (dp, pp):  # decode first: its indices are what prefill waits for
            with contextlib.suppress(OSError):  # it died: the receive loop notices
                p.conn.send(job)
        return True

    def _maybe_done(self, fl: _Flight) -> None:
        r = fl.rec
        if not r.done or self.flights.get(r.spec.rid) is not fl:
            return
        del self.flights[r.spec.rid]
        prefill_over = r.prefill_died or (r.prefill is not None and r.prefill.settled)
        decode_free = prefill_over or r.decode_died or (
            r.decode is not None and r.decode.status == "success")
        for block, ok in ((fl.pblock, prefill_over), (fl.dblock, decode_free)):
            key = block[:3]
            if key not in self.free:
                continue  # that process is gone: its blocks went with it
            if ok:
                self.free[key].append(block[3])
            else:  # a write may still land there: never reuse it
                self.quarantined[key] += 1

    def _receive(self, timeout: float) -> None:
        conns = {p.conn: p for p in self.procs.values()}
        for c in _readable(list(conns), timeout):
            p = conns[c]
            try:
                msg = c.recv()
            except (EOFError, OSError):
                if p.name in self.procs:
                    self.problems.append(f"{p.name} died unasked (exit {p.proc.exitcode})")
                    self._kill(p, "died unasked")
                    self.pending.append((time.monotonic() + 1.0, "restart", p.name))
                continue
            if isinstance(msg, Ready):
                p.ready = True
                self.say(f"  {p.name}: up (pid {msg.pid}, "
                         f"{time.monotonic() - p.started:.1f} s)")
            elif isinstance(msg, Failed):
                self.problems.append(f"{p.name} could not start: {msg.error}")
            elif isinstance(msg, Ended):
                fl = self.flights.get(msg.rid)
                if fl is None:
                    continue
                if msg.role == "prefill":
                    fl.rec.prefill = msg
                else:
                    fl.rec.decode = msg
                self._maybe_done(fl)

    # --- chaos -------------------------------------------------------------------------------

    def _fault(self, i: int, ev: ChaosEvent) -> None:
        if ev.fault is Fault.CUT:
            self._cut(i, ev)
            return
        p = self.procs.get(ev.target)
        if p is None or not p.ready or p.frozen:
            self.say(f"  skip {ev.fault.value} {ev.target}: not up")
            return
        count = self.s.prefills if ev.role == "prefill" else self.s.decodes
        peers = [q for q in self.procs.values()
                 if q.role == ev.role and q is not p and q.index < count]
        if len(peers) < count - 1 or not all(q.ready and not q.frozen for q in peers):
            # the plan allows for a restart in 5 s; a busy machine may take longer
            self.say(f"  skip {ev.fault.value} {ev.target}: it would leave no {ev.role} up")
            return
        self.fault_times[i] = time.monotonic()
        if ev.fault is Fault.KILL:
            self._kill(p, f"killed (restart in {ev.hold:g} s)")
            self.pending.append((time.monotonic() + ev.hold, "restart", ev.target))
        else:
            os.kill(p.pid, signal.SIGSTOP)
            p.frozen = True
            self.say(f"  {p.name}: frozen for {ev.hold:g} s")
            self.pending.append((time.monotonic() + ev.hold, "thaw", ev.target))

    def _cut(self, i: int, ev: ChaosEvent) -> None:
        pair = [self.procs.get(f"prefill{self.s.prefills}"),
                self.procs.get(f"decode{self.s.decodes}")]
        if self.hosts is None or not all(p is not None and p.ready for p in pair):
            self.say("  skip cut: the namespaced pair is not up")
            return
        self.fault_times[i] = time.monotonic()
        self.hosts.cut()
        self.say(f"  link between the namespaces cut for {ev.hold:g} s")
        self.pending.append((time.monotonic() + ev.hold, "link", ""))

    def _due(self, now: float, everything: bool = False) -> None:
        keep = []
        for when, what, name in self.pending:
            if when > now and not everything:
                keep.append((when, what, name))
            elif what == "link":
                if self.hosts is not None:
                    self.hosts.restore()
                    self.say("  link restored")
            elif what == "restart":
                role = name.rstrip("0123456789")
                self._start(role, int(name[len(role):]))
            else:
                p = self.procs.get(name)
                if p is not None:
                    os.kill(p.pid, signal.SIGCONT)
                    p.frozen = False
                    self.say(f"  {name}: thawed")
        self.pending = keep

    def _sample(self, now: float) -> None:
        for p in self.procs.values():
            if p.ready and not p.frozen:
                self.rss.setdefault(f"{p.name}.{p.epoch}", []).append((now, _rss(p.pid)))

    def _progress(self, t0: float) -> None:
        done = [r for r in self.records if r.done]
        ok = sum(1 for r in done if r.decode is not None and r.decode.status == "success")
        self.say(f"[{time.monotonic() - t0:6.1f} s] requests {len(self.records)} "
                 f"(done {len(done)}, decode success {ok}, in flight {len(self.flights)}), "
                 f"faults {len(self.fault_times)}")

    # --- the run -----------------------------------------------------------------------------

    def run(self) -> Report:
        t0 = time.monotonic()
        logger = logging.getLogger("kvhandoff")  # the bootstrap server's refusals
        level = logger.level
        logger.setLevel(self.log_level)
        try:
            return self._run_with_servers(t0)
        finally:
            logger.setLevel(level)

    def _run_with_servers(self, t0: float) -> Report:
        with BootstrapServer("127.0.0.1", 0) as boot, contextlib.ExitStack() as stack:
            self.url = boot.url
            if self.s.netcut:
                ok, why = netns.available()
                if ok:
                    self.hosts = stack.enter_context(netns.TwoHosts())
                    self.lane_url = f"http://{self.hosts.prefill_ip}:{LANE_BOOTSTRAP_PORT}"
                else:  # the plan's lane requests and cuts are skipped (not up)
                    self.say(f"link cuts skipped: {why}")
            try:
                return self._run(t0, boot)
            finally:
                for p in list(self.procs.values()):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGCONT)
                    p.conn.close()  # a worker still serving sees EOF and closes its agents
                    p.proc.join(5)
                    if p.proc.is_alive():
                        p.proc.kill()
                        p.proc.join(5)

    def _run(self, t0: float, boot: BootstrapServer) -> Report:
        s = self.s
        self.say(f"soak: {s.seconds:g} s, seed {s.seed}, transports {', '.join(s.transports)}, "
                 f"{s.prefills} prefill (TP {s.geometry.prefill_tp}) + {s.decodes} decode "
                 f"(TP {s.geometry.decode_tp}) workers, {s.geometry.shape}, "
                 f"{len(self.events)} faults planned")
        for role, index in self._workers():
            self._start(role, index)
        deadline = time.monotonic() + START_TIMEOUT
        while not all(p.ready for p in self.procs.values()) and time.monotonic() < deadline:
            self._receive(0.1)
            if self.problems:
                break
        if not all(p.ready for p in self.procs.values()) or self.problems:
            self.problems.append("workers did not all start")
            return self._report(t0, boot, [], [w for w, _ in self.procs.items()])
        start = time.monotonic()
        end = start + s.seconds
        nxt, ev_i, last_sample, last_print = 0, 0, 0.0, start
        while (now := time.monotonic()) < end:
            while ev_i < len(self.events) and start + self.events[ev_i].at <= now:
                self._fault(ev_i, self.events[ev_i])
                ev_i += 1
            self._due(now)
            while len(self.flights) < s.concurrency and self._dispatch(nxt):
                nxt += 1
            self._receive(0.02)
            if now - last_sample >= 1.0:
                self._sample(now)
                last_sample = now
            if now - last_print >= PROGRESS_EVERY:
                self._progress(start)
                last_print = now
        self.say("draining: no new requests; waiting for every request to end")
        self._due(time.monotonic(), everything=True)  # thaw and restart what is pending
        drain = time.monotonic() + 2 * self.limit + 30
        while (self.flights or not all(p.ready for p in self.procs.values())) \
                and time.monotonic() < drain:
            self._receive(0.05)
        self._sample(time.monotonic())
        self._progress(start)
        leaks, missing = self._leaks()
        return self._report(t0, boot, leaks, missing)

    def _leaks(self) -> tuple[list[Leaks], list[str]]:
        for p in self.procs.values():
            with contextlib.suppress(OSError):
                p.conn.send(LEAKS)
        leaks: list[Leaks] = []
        waiting = {p.conn: p for p in self.procs.values()}
        deadline = time.monotonic() + 60
        while waiting and time.monotonic() < deadline:
            for c in _readable(list(waiting), 0.5):
                p = waiting.pop(c)
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    continue
                if isinstance(msg, Leaks):
                    leaks.append(msg)
                else:
                    waiting[c] = p  # a late Ended: keep reading
        return leaks, sorted(p.name for p in waiting.values())

    def _report(self, t0: float, boot: BootstrapServer, leaks: list[Leaks],
                missing: list[str]) -> Report:
        got = {f"{lk.role}{lk.index}" for lk in leaks}
        missing = sorted(set(missing) | {n for n in self.procs if n not in got})
        total = free = quar = 0
        for key, blocks in self.free.items():
            total += self.s.geometry.blocks
            free += len(blocks)
            quar += self.quarantined.get(key, 0)
        in_flight = total - free - quar
        # the workers closed their agents: every registration must be gone too
        for _ in range(100):
            if boot.registry.health().ranks == 0:
                break
            time.sleep(0.05)
        extra = ([f"bootstrap server still holds {boot.registry.health().ranks} registrations"]
                 if boot.registry.health().ranks else [])
        summary = summarise(self.records, leaks, missing,
                            Blocks(total=total, free=free, quarantined=quar,
                                   in_flight=in_flight), self.rss, extra)
        det = detection(self.events, self.fault_times, self.records,
                        float(self.session["heartbeat_timeout"]))
        faults = [{**dataclasses.asdict(ev), "done": i in self.fault_times}
                  for i, ev in enumerate(self.events)]
        settings = {**dataclasses.asdict(self.s), "session": self.session,
                    "job_limit_s": self.limit}
        return Report(settings=settings, summary=summary, detection=det, faults=faults,
                      problems=self.problems, wall_s=time.monotonic() - t0)
