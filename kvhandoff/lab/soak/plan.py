"""What a soak does and when, from a seed: pure (no clock, no processes).

:class:`Settings` is the run; :func:`request_spec` is request ``i`` (which prefill and
decode worker, transport, length, chunking, whether a side aborts it and after how long,
whether prefill flips a source byte once its first chunk was submitted);
:func:`chaos_schedule` is the list of process faults (kill then restart, freeze then
thaw) at offsets from the start. The same seed always gives the same soak, so a failing
run can be replayed; the shell (:mod:`kvhandoff.lab.soak.run`) only executes it.

Schedule rules: no fault in the first :data:`WARMUP` seconds nor in the last fifth of the
run (every request then ends with the processes whole, which the leak check needs); one
fault at a time per worker; never both workers of one role down (or frozen) at once, so
requests keep flowing. With ``netcut``, a further prefill/decode pair runs in two network
namespaces joined by a veth link; a share of the requests goes over it (tcp) and
:attr:`Fault.CUT` takes the link down for a while.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import numpy as np

from kvhandoff.lab.soak.pattern import Geometry

WARMUP = 3.0  # seconds before the first fault


class Fault(enum.StrEnum):
    KILL = "kill"  # SIGKILL, restarted after `hold` seconds
    FREEZE = "freeze"  # SIGSTOP, SIGCONT after `hold` seconds
    CUT = "cut"  # the link between the two network namespaces down, up after `hold` seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """One soak run."""

    seconds: float
    seed: int = 0
    transports: tuple[str, ...] = ("tcp", "shm")
    prefills: int = 2
    decodes: int = 2
    concurrency: int = 8  # requests in flight at once
    chaos_every: float = 8.0  # mean seconds between process faults
    abort_rate: float = 0.08  # share of requests one side aborts
    flip_rate: float = 0.08  # share of requests whose source byte prefill flips in flight
    max_freeze: float = 6.0  # longest SIGSTOP (above heartbeat_timeout: peers declare it lost)
    max_down: float = 3.0  # longest a killed worker stays down before its restart
    geometry: Geometry = field(default_factory=Geometry)
    netcut: bool = False  # a prefill/decode pair in two network namespaces, its link cut
    lane_share: float = 0.2  # with netcut: the share of requests over that pair (tcp)

    def __post_init__(self) -> None:
        if not self.seconds > 0 or not self.transports or min(self.prefills, self.decodes) < 1:
            raise ValueError("a soak needs seconds > 0, a transport and a worker of each role")
        if not 0 <= self.abort_rate <= 1 or not 0 <= self.flip_rate <= 1:
            raise ValueError("abort_rate and flip_rate are shares in 0..1")
        if self.netcut and "tcp" not in self.transports:
            raise ValueError("netcut runs its namespaced pair over tcp: include it")


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort:
    side: str  # "prefill" or "decode"
    after: float  # seconds after that side started the request


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestSpec:
    """Request ``index`` of the soak."""

    rid: str
    index: int
    prefill: int
    decode: int
    transport: str
    num_tokens: int
    chunk_pages: int  # pages per chunk (the last chunk also carries state and aux)
    abort: Abort | None = None
    flip: bool = False
    lane: bool = False  # over the namespaced pair (prefill/decode index = prefills/decodes)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChaosEvent:
    at: float  # seconds from the start
    fault: Fault
    role: str  # "prefill" or "decode"
    worker: int
    hold: float  # seconds down (kill) or frozen (freeze)

    @property
    def target(self) -> str:
        return f"{self.role}{self.worker}"


def request_spec(s: Settings, i: int) -> RequestSpec:
    """Request ``i``: the same for the same settings, whatever happened before."""
    rng = np.random.default_rng([s.seed, 1, i])
    geo = s.geometry
    tokens = int(rng.integers(1, geo.max_tokens + 1))
    pages = -(-tokens // geo.page_size)
    abort = None
    if rng.random() < s.abort_rate:
        abort = Abort(side=("prefill", "decode")[int(rng.integers(2))],
                      after=round(float(rng.uniform(0.0, 0.3)), 3))
    spec = RequestSpec(rid=f"soak-{s.seed}-{i}", index=i, prefill=int(rng.integers(s.prefills)),
                       decode=int(rng.integers(s.decodes)),
                       transport=s.transports[int(rng.integers(len(s.transports)))],
                       num_tokens=tokens, chunk_pages=int(rng.integers(1, pages + 1)),
                       abort=abort, flip=bool(rng.random() < s.flip_rate))
    if s.netcut and np.random.default_rng([s.seed, 4, i]).random() < s.lane_share:
        return dataclasses.replace(spec, prefill=s.prefills, decode=s.decodes, transport="tcp",
                                   lane=True)
    return spec


def chaos_schedule(s: Settings) -> tuple[ChaosEvent, ...]:
    """The process faults of the run, in time order (see the module docstring)."""
    rng = np.random.default_rng([s.seed, 2])
    stop = 0.8 * s.seconds
    busy: dict[tuple[str, int], float] = {}  # worker → when its last fault ends
    out: list[ChaosEvent] = []
    t = WARMUP
    for _ in range(100_000):  # bounded: each round advances t by at least a second
        t += max(1.0, float(rng.exponential(s.chaos_every)))
        if t >= stop:
            break
        fault = (Fault.KILL, Fault.FREEZE)[int(rng.integers(2))]
        role = ("prefill", "decode")[int(rng.integers(2))]
        count = s.prefills if role == "prefill" else s.decodes
        worker = int(rng.integers(count))
        top = s.max_down if fault is Fault.KILL else s.max_freeze
        hold = round(float(rng.uniform(0.5, top)), 2)
        peers_down = any(busy.get((role, w), 0.0) > t for w in range(count))
        if peers_down or t + hold >= stop:
            continue  # keep one worker of each role up; end every fault before the tail
        busy[(role, worker)] = t + hold + (5.0 if fault is Fault.KILL else 0.0)  # + restart
        out.append(ChaosEvent(at=round(t, 2), fault=fault, role=role, worker=worker,
                              hold=hold))
    if s.netcut:
        out += _cuts(s, stop)
    return tuple(sorted(out, key=lambda e: e.at))


def _cuts(s: Settings, stop: float) -> list[ChaosEvent]:
    """Link cuts of the namespaced pair (their own stream: the other faults stay the same
    with or without them), one at a time."""
    rng = np.random.default_rng([s.seed, 3])
    out: list[ChaosEvent] = []
    t = WARMUP
    for _ in range(100_000):
        t += max(1.0, float(rng.exponential(2 * s.chaos_every)))
        hold = round(float(rng.uniform(0.5, s.max_freeze)), 2)
        if t + hold >= stop:
            break
        out.append(ChaosEvent(at=round(t, 2), fault=Fault.CUT, role="link", worker=0,
                              hold=hold))
        t += hold
    return out
