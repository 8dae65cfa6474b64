"""End to end: prefill ranks and decode ranks in separate processes, a real bootstrap
server, real ZeroMQ control sockets, the tcp transport; every byte checked against the
independent oracle (and every byte the oracle does not expect to change, unchanged).

Each scenario runs a mix of requests at once: several KV chunks, an empty last chunk, a
decode prefix hit, a full prefix hit (no KV moves, state still does), string and integer
ids. After each run both processes close their agents and report no leaked ``kvh-*``
thread or file descriptor, and the bootstrap server holds no registration.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.handoff import RequestPlan, Scenario, Topology
from kvhandoff.lab.testing.params import transport_params
from kvhandoff.lab.testing.sides import RunResult, WorkerPair, run_scenario

_names = itertools.count()


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[BootstrapServer]:
    with BootstrapServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def worker_pair() -> Iterator[WorkerPair]:
    """A prefill and a decode worker process, spawned once for the module."""
    w = WorkerPair("kvh-e2e")
    yield w
    w.stop()


@pytest.fixture
def instance() -> str:
    """A fresh prefill instance name, so no run sees another's registrations."""
    return f"e2e-{next(_names)}"

SHAPES = ["qwen3_next", "gpt_oss", "deepseek_v32", "deepseek_v4"]
TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (8, 2)]


def topology(shape: str, tp: int, td: int, **kw: object) -> Topology:
    if shape == "deepseek_v4":  # a DeepSeek-V4 page holds whole C128 rows: 128 tokens
        base: dict[str, object] = {"prefill_page": 128, "decode_page": 128, "num_pages": 24}
    else:
        base = {"prefill_page": 4, "decode_page": 4, "num_pages": 96}
    base.update(kw)
    return Topology(shape=shape, prefill_tp=tp, decode_tp=td, **base)  # type: ignore[arg-type]


def mixed_requests(topo: Topology) -> tuple[RequestPlan, ...]:
    page = max(topo.prefill_page, topo.decode_page)
    if page >= 128:
        return (
            RequestPlan(rid=0, num_tokens=300, chunk_pages=1, block=0, seed=1),
            RequestPlan(rid="r-1", num_tokens=256, chunk_pages=1, empty_last=True, block=1,
                        seed=2),
            RequestPlan(rid=2, num_tokens=290, prefix_len=128, chunk_pages=2, block=2, seed=3),
        )
    return (
        RequestPlan(rid=0, num_tokens=21, chunk_pages=2, block=0, seed=1),
        RequestPlan(rid="r-1", num_tokens=16, chunk_pages=2, empty_last=True, block=1, seed=2),
        RequestPlan(rid=2, num_tokens=23, prefix_len=2 * page, chunk_pages=3, block=2, seed=3),
        RequestPlan(rid="full-hit", num_tokens=4 * page, prefix_len=4 * page, block=3, seed=4),
    )


def run(workers: WorkerPair, srv: BootstrapServer, scn: Scenario) -> RunResult:
    p, d = workers.get()
    res = run_scenario(scn, srv.url, p, d)
    check(res, srv, scn)
    return res


def check(res: RunResult, srv: BootstrapServer, scn: Scenario) -> None:
    assert not res.problems, "\n".join(res.problems)
    bad = [o for o in res.decode.outcomes + res.prefill.outcomes if o.status != "success"]
    assert not bad, bad
    n_decode = scn.topo.decode_tp * scn.topo.decode_pp
    assert len(res.decode.outcomes) == n_decode * len(scn.requests)
    for leaks in (res.prefill_leaks, res.decode_leaks):
        assert leaks == {"threads": [], "fds": 0}, leaks
    assert srv.registry.health().ranks == 0


def scenario(instance: str, topo: Topology, requests: tuple[RequestPlan, ...] | None = None,
             **kw: object) -> Scenario:
    return Scenario(topo=topo, requests=requests or mixed_requests(topo),
                    config={"instance": instance, **kw.pop("config", {})},  # type: ignore[dict-item]
                    **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("tp", "td"), TP_PAIRS, ids=[f"tp{a}to{b}" for a, b in TP_PAIRS])
def test_tp_pairs(worker_pair: WorkerPair, bootstrap: BootstrapServer, instance: str, shape: str,
                  tp: int, td: int) -> None:
    run(worker_pair, bootstrap, scenario(instance, topology(shape, tp, td)))


@pytest.mark.parametrize("shape", SHAPES)
def test_pp2_prefill_to_pp1_decode(worker_pair: WorkerPair, bootstrap: BootstrapServer,
                                   instance: str, shape: str) -> None:
    topo = topology(shape, 2, 1, prefill_pp=2)
    run(worker_pair, bootstrap, scenario(instance, topo))


def test_many_concurrent_requests(worker_pair: WorkerPair, bootstrap: BootstrapServer,
                                  instance: str) -> None:
    topo = topology("qwen3_next", 2, 1, num_pages=64 * 8 + 8, num_slots=66)
    reqs = tuple(RequestPlan(rid=f"c{i}", num_tokens=9 + i % 17, chunk_pages=1 + i % 3,
                             empty_last=i % 5 == 0, prefix_len=4 * (i % 2), block=i, seed=i)
                 for i in range(64))
    run(worker_pair, bootstrap, scenario(instance, topo, reqs))


def test_two_prefill_dp_groups(worker_pair: WorkerPair, bootstrap: BootstrapServer,
                               instance: str) -> None:
    topo = topology("gpt_oss", 2, 1, dp_size=2)
    reqs = tuple(RequestPlan(rid=i, num_tokens=17 + i, chunk_pages=2, block=i, seed=i,
                             dp_rank=None if i < 4 else i % 2) for i in range(6))
    run(worker_pair, bootstrap, scenario(instance, topo, reqs))


def test_page_sizes_differ(worker_pair: WorkerPair, bootstrap: BootstrapServer,
                           instance: str) -> None:
    """Prefill pages of 4 tokens, decode pages of 8: KV and SWA move by token rows."""
    topo = topology("gpt_oss", 2, 1, prefill_page=4, decode_page=8)
    run(worker_pair, bootstrap, scenario(instance, topo))


CHECKSUMMED = [topology("qwen3_next", 2, 1), topology("deepseek_v4", 2, 1, prefill_pp=2),
               topology("gpt_oss", 1, 2, prefill_page=4, decode_page=8)]


@pytest.mark.parametrize("topo", CHECKSUMMED, ids=["qwen3_next-tp2to1", "deepseek_v4-pp2",
                                                    "gpt_oss-repaged"])
def test_checksums(worker_pair: WorkerPair, bootstrap: BootstrapServer, instance: str,
                   topo: Topology) -> None:
    """Decode rebuilds each chunk's plan (rows re-paged, ring positions, PP stages) and
    finds the same digests prefill sent."""
    run(worker_pair, bootstrap, scenario(instance, topo, config={"checksum": True}))


ENGINES = ["shm", "cma", "auto", "mooncake", "nixl"]


def _engine_params() -> list[object]:
    """The other transports, and tcp with statuses over the control socket instead of
    in band (the path every transport without notices takes)."""
    return [*transport_params(ENGINES), pytest.param("tcp-control", id="tcp-control")]


def _on(transport: str) -> dict[str, object]:
    if transport == "tcp-control":
        return {"transport": "tcp", "config": {"in_band_status": False}}
    return {"transport": transport}


OTHER_CASES = [("qwen3_next", 2, 1, 1), ("deepseek_v4", 1, 2, 1), ("gpt_oss", 8, 2, 1),
               ("deepseek_v32", 2, 4, 1), ("qwen3_next", 2, 1, 2)]


@pytest.mark.parametrize("transport", _engine_params())
@pytest.mark.parametrize(("shape", "tp", "td", "pp"), OTHER_CASES,
                         ids=[f"{s}-tp{a}to{b}" + ("-pp2" if p > 1 else "")
                              for s, a, b, p in OTHER_CASES])
def test_other_transports(worker_pair: WorkerPair, bootstrap: BootstrapServer, instance: str,
                          transport: str, shape: str, tp: int, td: int, pp: int) -> None:
    """Every state type, GQA replication (8→2), TP fan-out (2→4), PP 2 → 1."""
    topo = topology(shape, tp, td, prefill_pp=pp)
    run(worker_pair, bootstrap, scenario(instance, topo, **_on(transport)))


@pytest.mark.parametrize("transport", _engine_params())
def test_many_concurrent_requests_on_other_transports(
        worker_pair: WorkerPair, bootstrap: BootstrapServer, instance: str,
        transport: str) -> None:
    topo = topology("qwen3_next", 2, 1, num_pages=32 * 8 + 8, num_slots=34)
    reqs = tuple(RequestPlan(rid=f"c{i}", num_tokens=9 + i % 17, chunk_pages=1 + i % 3,
                             empty_last=i % 5 == 0, prefix_len=4 * (i % 2), block=i, seed=i)
                 for i in range(32))
    run(worker_pair, bootstrap, scenario(instance, topo, reqs, **_on(transport)))
