"""Faults across processes: aborts from either side in every state, a side killed
mid-transfer, and a dead decode peer that must not poison the others.

Prefill (TP 2) and decode (TP 1) run in separate worker processes with a real bootstrap
server and tcp. Every run ends with each surviving side's requests in the right status
with the right reason, decode's destination pages released (and, after an abort while
writes were in flight, reused pages not overwritten), every byte outside the failed
requests' destinations unchanged, and no leaked thread or descriptor.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from kvhandoff.session.bootstrap import BootstrapServer
from kvhandoff.testing.handoff import RequestPlan, Scenario, Topology
from kvhandoff.testing.sides import Outcome, RunResult, Worker, WorkerPair, run_scenario

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
             reqs: tuple[RequestPlan, ...] | None = None, instance: str = "") -> Scenario:
    cfg = {"instance": instance or f"proc-{next(_names)}", "heartbeat_timeout": 1.5,
           "release_timeout": 3.0, **(config or {})}
    return Scenario(topo=TOPO, requests=reqs or requests(), config=cfg, faults=faults,
                    timeout=30.0)


def failed(outcomes: list[Outcome], *words: str) -> None:
    assert outcomes, "no outcomes"
    for o in outcomes:
        assert o.status == "failed", o
        assert o.reason and any(w in o.reason for w in words), o


ABORTS = [
    ("decode", "bootstrapping", {}, {"indices_timeout": 2.0}),
    ("decode", "waiting_for_input", {"prefill_delay": 1.0}, {}),
    ("decode", "transferring", {"chunk_delay": 0.15, "prefill_write_delay": 0.3,
                                "reuse_after_abort": True}, {}),
    ("prefill", "bootstrapping", {}, {}),
    ("prefill", "waiting_for_input", {"prefill_delay": 1.0}, {}),
    ("prefill", "transferring", {"chunk_delay": 0.15, "prefill_write_delay": 0.3}, {}),
]


@pytest.mark.parametrize(("side", "state", "knobs", "config"), ABORTS,
                         ids=[f"{a}-{b}" for a, b, _, _ in ABORTS])
def test_abort(workers: WorkerPair, side: str, state: str, knobs: dict[str, Any],
               config: dict[str, Any]) -> None:
    with BootstrapServer() as srv:
        p, d = workers.get()
        scn = scenario({f"{side}_abort": state, **knobs}, config)
        res = run_scenario(scn, srv.url, p, d)
        assert not res.problems, "\n".join(res.problems)
        failed(res.decode.outcomes, "abort")
        if (side, state) == ("decode", "bootstrapping"):  # decode never reached prefill
            failed(res.prefill.outcomes, "indices_timeout")
        else:
            failed(res.prefill.outcomes, "abort")
        for o in res.decode.outcomes:
            assert o.released and "timeout" not in o.release_reason, o
        assert res.prefill_leaks == NO_LEAKS and res.decode_leaks == NO_LEAKS
        assert srv.registry.health().ranks == 0


def test_decode_killed_mid_transfer(workers: WorkerPair) -> None:
    with BootstrapServer() as srv:
        p, d = workers.get()
        scn = scenario({"decode_exit": "transferring", "chunk_delay": 0.15})
        res = run_scenario(scn, srv.url, p, d)
        assert res.decode.problems == ["decode worker gave no report"]
        assert not res.prefill.problems, res.prefill.problems
        failed(res.prefill.outcomes, "silent", "lost", "closed", "reset", "EOF")
        assert all("decode" in (o.reason or "") for o in res.prefill.outcomes)
        assert res.prefill_leaks == NO_LEAKS


def test_prefill_killed_mid_transfer(workers: WorkerPair) -> None:
    with BootstrapServer() as srv:  # the dead ranks' registrations stay behind: own server
        p, d = workers.get()
        scn = scenario({"prefill_exit": "transferring", "chunk_delay": 0.15})
        res = run_scenario(scn, srv.url, p, d)
        assert res.prefill.problems == ["prefill worker gave no report"]
        assert not res.decode.problems, res.decode.problems
        failed(res.decode.outcomes, "silent")
        for o in res.decode.outcomes:
            assert o.released and "release_timeout" in o.release_reason, o
        assert res.decode_leaks == NO_LEAKS


def test_a_dead_decode_peer_does_not_poison_the_others(workers: WorkerPair) -> None:
    """Two decode deployments share one prefill; one dies mid-transfer. The other's
    requests all succeed, byte-exact, and prefill fails only the dead one's."""
    doomed, healthy = requests(3, first_block=0), requests(3, first_block=3)
    with BootstrapServer() as srv:
        p, d = workers.get()
        other = Worker("kvh-faults-decode-b")
        try:
            name = f"proc-{next(_names)}"
            both = scenario({"chunk_delay": 0.15}, reqs=doomed + healthy, instance=name)
            p.run("prefill", both, srv.url)
            d.run("decode", scenario({"decode_exit": "transferring"}, reqs=doomed,
                                     instance=name), srv.url)
            other.run("decode", scenario({}, reqs=healthy, instance=name), srv.url)
            good = other.result(90)
            pre = p.result(90)
            assert d.result(30) is None  # it died
            assert good is not None and pre is not None
            assert not good.problems and not pre.problems, good.problems + pre.problems
            assert good.by_status() == {"success": 3}
            by_rid = {o.rid: o for o in pre.outcomes if o.rank.endswith("tp0-pp0")}
            assert all(by_rid[rp.rid].status == "success" for rp in healthy)
            assert all(by_rid[rp.rid].status == "failed" for rp in doomed)
            assert other.close_side() == NO_LEAKS and p.close_side() == NO_LEAKS
        finally:
            other.stop()


def test_runs_after_faults_are_clean(workers: WorkerPair) -> None:
    """The same worker processes (restarted where killed) run a normal handoff."""
    with BootstrapServer() as srv:
        p, d = workers.get()
        res: RunResult = run_scenario(scenario({}), srv.url, p, d)
        assert not res.problems, res.problems
        assert res.decode.by_status() == {"success": 3}
        assert res.prefill_leaks == NO_LEAKS and res.decode_leaks == NO_LEAKS
