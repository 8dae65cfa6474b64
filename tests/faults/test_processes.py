"""Faults across processes: aborts from either side in every state, a side killed
mid-transfer, and a dead decode peer that must not poison the others.

Prefill (TP 2) and decode (TP 1) run in separate worker processes with a real bootstrap
server, over tcp and (a subset, to bound the run time) every other transport usable
here. Every run ends with each surviving side's requests in the right status with the
right reason (the fault noticed, not waited out: no other timeout named), decode's
destination pages released (and, after an abort while writes may be in flight, reused
pages not overwritten), every byte outside the failed requests' destinations unchanged,
no live request left on a surviving agent (nor, on prefill, a dead decode rank), and no
leaked thread or descriptor. Each abort is
checked to have found its request in the state it names (the harness holds the request
there; see :mod:`kvhandoff.lab.testing.sides`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.handoff import RequestPlan, Scenario, Topology
from kvhandoff.lab.testing.params import transport_params
from kvhandoff.lab.testing.sides import (
    PATIENCE,
    Outcome,
    RunResult,
    SideReport,
    Worker,
    WorkerPair,
    run_scenario,
)
from kvhandoff.session.config import TIMEOUT_FIELDS

_names = itertools.count()
TOPO = Topology(shape="qwen3_next", prefill_tp=2, decode_tp=1, num_pages=128, num_slots=10)
NO_LEAKS = {"threads": [], "fds": 0}


@pytest.fixture(scope="module")
def workers() -> Iterator[WorkerPair]:
    w = WorkerPair("kvh-faults")
    yield w
    w.stop()


def requests(n: int = 3, tokens: int = 40, first_block: int = 0) -> tuple[RequestPlan, ...]:
    return tuple(RequestPlan(rid=f"q{first_block + i}", num_tokens=tokens, chunk_pages=1,
                             block=first_block + i, seed=i) for i in range(n))


def scenario(faults: dict[str, Any], config: dict[str, Any] | None = None,
             reqs: tuple[RequestPlan, ...] | None = None, instance: str = "",
             transport: str = "tcp") -> Scenario:
    # every timer the fault should not trip waits PATIENCE: a loaded machine's slowness
    # must never pass for a fault (the heartbeat tells busy from dead by itself)
    cfg = {"instance": instance or f"proc-{next(_names)}", "heartbeat_timeout": 1.5,
           "release_timeout": PATIENCE, **(config or {})}
    return Scenario(topo=TOPO, requests=reqs or requests(), config=cfg, faults=faults,
                    timeout=PATIENCE, transport=transport)


def failed(outcomes: list[Outcome], *words: str) -> None:
    assert outcomes, "no outcomes"
    for o in outcomes:
        assert o.status == "failed", o
        assert o.reason and any(w in o.reason for w in words), o


def noticed(outcomes: list[Outcome], *timeouts: str) -> None:
    """Every failure came from noticing the fault, not from waiting it out: no reason
    names a session timeout but ``timeouts`` (``heartbeat_timeout`` when none is
    named). Load-independent, unlike a bound on the seconds it took: a slow machine
    makes a request slower, never its reason different (and each driver's wait is
    bounded by the scenario's timeout, so a fault nobody notices still fails the run)."""
    allowed = set(timeouts or ("heartbeat_timeout",))
    for o in outcomes:
        named = {t for t in TIMEOUT_FIELDS if t in (o.reason or "")}
        assert named <= allowed, f"waited out ({', '.join(sorted(named))}), not noticed: {o}"


def no_live(report: SideReport, decode_peers: int | None = None) -> None:
    """A surviving side's agents hold no request (and, on prefill, ``decode_peers``
    accepted decode ranks) when its drivers are done."""
    assert report.stats, "no stats"
    for name, st in report.stats.items():
        assert st["live_requests"] == 0, (name, st)
        if decode_peers is not None:
            assert st["decode_peers"] == decode_peers, (name, st)


def dead_peer_dropped(report: SideReport, alive: int) -> None:
    """Prefill's agents hold only the ``alive`` decode ranks: the dead one was dropped,
    whether prefill learnt of its death from the heartbeat or from failed writes (then
    the rank is probed until declared lost, or dropped at once when its transport peer
    gave up)."""
    peers = {name: st["decode_peers"] for name, st in report.stats.items()}
    assert all(n == alive for n in peers.values()), \
        f"decode peers per prefill rank {peers}, want {alive}"


ENGINES = ["shm", "cma", "mooncake", "nixl"]
# tcp, then the other transports (as in tests/e2e), each skipped where it cannot run
TRANSPORTS = [pytest.param("tcp", id="tcp"), *transport_params(ENGINES)]


# The write delay that keeps prefill's writes in flight at an abort is a tcp wrapper
# (kvhandoff.lab.testing.faulty.DelayedTcp): the delayed stale-write checks run on tcp only.
# The other transports run one abort state per side, transferring (the state with writes
# under way; their marker check has no delay to widen the window), to bound the time.
IN_FLIGHT = {"chunk_delay": 0.15, "prefill_write_delay": 0.3, "reuse_after_abort": True}
ABORTS = [
    ("decode", "bootstrapping", {}, {"indices_timeout": 2.0}),
    ("decode", "waiting_for_input", {}, {}),
    ("decode", "transferring", IN_FLIGHT, {}),
    ("prefill", "bootstrapping", {"decode_init_delay": 1.0}, {}),
    ("prefill", "waiting_for_input", {}, {}),
    ("prefill", "transferring", IN_FLIGHT, {}),
]
ENGINE_ABORTS = [(side, "transferring", {"chunk_delay": 0.15, "reuse_after_abort": True}, {})
                 for side in ("decode", "prefill")]
ABORT_PARAMS = [pytest.param("tcp", *a, id=f"{a[0]}-{a[1]}") for a in ABORTS] + [
    pytest.param(t.values[0], *a, id=f"{t.id}-{a[0]}-{a[1]}", marks=t.marks)
    for t in TRANSPORTS[1:] for a in ENGINE_ABORTS]


@pytest.mark.parametrize(("transport", "side", "state", "knobs", "config"), ABORT_PARAMS)
def test_abort(workers: WorkerPair, transport: str, side: str, state: str,
               knobs: dict[str, Any], config: dict[str, Any]) -> None:
    with BootstrapServer() as srv:
        p, d = workers.get()
        scn = scenario({f"{side}_abort": state, **knobs}, config, transport=transport)
        res = run_scenario(scn, srv.url, p, d)
        assert not res.problems, "\n".join(res.problems)
        failed(res.decode.outcomes, "abort")
        if (side, state) == ("decode", "bootstrapping"):  # decode never reached prefill
            failed(res.prefill.outcomes, "indices_timeout")
            noticed(res.prefill.outcomes, "indices_timeout")
        else:
            failed(res.prefill.outcomes, "abort")
            noticed(res.prefill.outcomes)
        noticed(res.decode.outcomes)
        # the abort found the request in the named state: on every rank, or (prefill
        # TP 2) on the rank that aborted first, the other's already failed by decode
        aborting = res.decode if side == "decode" else res.prefill
        assert all(o.aborted_in in (state, "failed") for o in aborting.outcomes), \
            aborting.outcomes
        for rp in scn.requests:
            assert any(o.aborted_in == state for o in aborting.outcomes if o.rid == rp.rid), \
                aborting.outcomes
        for o in res.decode.outcomes:
            assert o.released and "timeout" not in o.release_reason, o
        no_live(res.decode)
        # decode is alive and stays accepted (after an abort in bootstrapping its
        # handshake may not have happened yet when prefill's drivers were done)
        no_live(res.prefill, decode_peers=None if state == "bootstrapping" else 1)
        assert res.prefill_leaks == NO_LEAKS and res.decode_leaks == NO_LEAKS
        assert srv.registry.health().ranks == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_decode_killed_mid_transfer(workers: WorkerPair, transport: str) -> None:
    with BootstrapServer() as srv:
        p, d = workers.get()
        scn = scenario({"decode_exit": "transferring", "chunk_delay": 0.15},
                       transport=transport)
        res = run_scenario(scn, srv.url, p, d)
        assert res.decode.problems == ["decode worker gave no report"]
        assert not res.prefill.problems, res.prefill.problems
        failed(res.prefill.outcomes, "silent", "lost", "closed", "reset", "EOF", "Disconnect")
        assert all("decode" in (o.reason or "") for o in res.prefill.outcomes)
        noticed(res.prefill.outcomes)
        no_live(res.prefill)
        assert res.prefill_leaks == NO_LEAKS
        assert srv.registry.health().ranks == 0  # prefill survived: it deregistered
        dead_peer_dropped(res.prefill, alive=0)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefill_killed_mid_transfer(workers: WorkerPair, transport: str) -> None:
    with BootstrapServer() as srv:  # the dead ranks' registrations stay behind: own server
        p, d = workers.get()
        scn = scenario({"prefill_exit": "transferring", "chunk_delay": 0.15},
                       {"release_timeout": 3.0}, transport=transport)
        res = run_scenario(scn, srv.url, p, d)
        assert res.prefill.problems == ["prefill worker gave no report"]
        assert not res.decode.problems, res.decode.problems
        failed(res.decode.outcomes, "silent")
        for o in res.decode.outcomes:
            assert o.released and "release_timeout" in o.release_reason, o
        noticed(res.decode.outcomes, "heartbeat_timeout", "release_timeout")
        no_live(res.decode)
        assert res.decode_leaks == NO_LEAKS


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dead_decode_peer_does_not_poison_the_others(workers: WorkerPair,
                                                        transport: str) -> None:
    """Two decode deployments share one prefill; one dies mid-transfer. The other's
    requests all succeed, byte-exact, and prefill fails only the dead one's.

    Prefill withholds the doomed requests' later chunks, so they cannot complete before
    their decode dies, however slowly the machine runs it: prefill's SUCCESS promises the
    transport acknowledged every byte in decode's memory, so a request that finished
    before the death would rightly say success."""
    doomed, healthy = requests(3, first_block=0), requests(3, first_block=3)
    with BootstrapServer() as srv:
        p, d = workers.get()
        other = Worker("kvh-faults-decode-b")
        try:
            name = f"proc-{next(_names)}"
            both = scenario({"chunk_delay": 0.15,
                             "prefill_withhold": [rp.rid for rp in doomed]},
                            reqs=doomed + healthy, instance=name, transport=transport)
            p.run("prefill", both, srv.url)
            d.run("decode", scenario({"decode_exit": "transferring"}, reqs=doomed,
                                     instance=name, transport=transport), srv.url)
            other.run("decode", scenario({}, reqs=healthy, instance=name,
                                         transport=transport), srv.url)
            good = other.result(PATIENCE + 60)
            pre = p.result(PATIENCE + 60)
            dead = d.result(PATIENCE)
            # close both sides before any assert, so a failure here leaves no agent
            # behind for the next test's leak report
            leaks = other.close_side(), p.close_side()
            assert dead is None  # it died
            assert good is not None and pre is not None
            assert not good.problems and not pre.problems, good.problems + pre.problems
            assert good.by_status() == {"success": 3}
            by_rid = {o.rid: o for o in pre.outcomes if o.rank.endswith("tp0-pp0")}
            assert all(by_rid[rp.rid].status == "success" for rp in healthy)
            assert all(by_rid[rp.rid].status == "failed" for rp in doomed)
            noticed([o for o in pre.outcomes if o.rid in {rp.rid for rp in doomed}])
            no_live(good)
            no_live(pre)
            assert leaks == (NO_LEAKS, NO_LEAKS)
            assert srv.registry.health().ranks == 0
            dead_peer_dropped(pre, alive=1)  # the healthy decode rank only
        finally:
            other.stop()


def test_runs_after_faults_are_clean(workers: WorkerPair) -> None:
    """The same worker processes (restarted where killed) run a normal handoff."""
    with BootstrapServer() as srv:
        p, d = workers.get()
        res: RunResult = run_scenario(scenario({}), srv.url, p, d)
        assert not res.problems, res.problems
        assert res.decode.by_status() == {"success": 3}
        no_live(res.decode)
        no_live(res.prefill, decode_peers=1)
        assert res.prefill_leaks == NO_LEAKS and res.decode_leaks == NO_LEAKS
