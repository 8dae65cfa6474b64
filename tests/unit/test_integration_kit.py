"""The integration kit: its public face (pinned), what adapters may import, and its pure
pieces — memory placement, the outcome table, the aux pool, a handoff's figures and the
series they go to, hooks."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

import kvhandoff
import kvhandoff.integrations as kit
from kvhandoff.errors import LayoutError
from kvhandoff.lab.testing.timelines import ticking
from kvhandoff.session.request.aux import AuxState, check, stamp

ROOT = Path(kvhandoff.__file__).parent

FACE = [
    "CUDA_STAGED_ONLY", "HANDOFF_SERIES", "KVPOLL", "OUTCOMES", "SUCCESS", "Agent",
    "AuxPool", "AuxRows", "AuxSpec", "DecodeAgent", "Figures", "HandoffHook",
    "HandshakeError", "How", "LeaseExpired", "LocalProtocolError", "Outcome", "Placement",
    "PrefillAgent", "Receiver", "RequestKey", "Role", "Row", "Sender", "Series",
    "SessionConfig", "Status", "Transport", "as_decode", "as_prefill", "bootstrap_url",
    "coalesce_runs", "figures", "kvpoll", "load_hook", "measure", "open_rank",
    "open_transport", "outcome", "placement", "quiet", "record", "registry_app", "route_dp",
]

PUBLIC = {"kvhandoff.integrations", "kvhandoff.layout", "kvhandoff.state_types",
          "kvhandoff.indices", "kvhandoff.sharding", "kvhandoff.errors"}
"""What an adapter may import from kvhandoff besides its own package."""


def test_the_face_is_pinned() -> None:
    assert kit.__all__ == FACE
    for name in FACE:
        assert getattr(kit, name) is not None, name


@pytest.mark.parametrize("adapter", ["vllm", "sglang"])
def test_adapters_reach_only_public_faces(adapter: str) -> None:
    """An adapter translates its engine's API; everything else it takes from the kit's
    face or the model modules, never from a private module of the library."""
    own = f"kvhandoff.integrations.{adapter}"
    files = sorted((ROOT / "integrations" / adapter).glob("*.py"))
    assert files, f"no adapter package {own}"
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [])
            for name in names:
                if (name.startswith("kvhandoff") and name not in PUBLIC
                        and not (name == own or name.startswith(own + "."))):
                    bad.append(f"{path.name}: {name}")
    assert bad == []


# --- placement --------------------------------------------------------------------------


@pytest.mark.parametrize(("transport", "producer", "kw", "how", "own", "device"), [
    ("tcp", True, {}, kit.How.IN_PLACE, False, False),
    ("tcp", False, {}, kit.How.IN_PLACE, False, False),
    ("shm", True, {"mirror": True}, kit.How.IN_PLACE, False, False),
    # the same-host single copy pulls into any registered host memory: no mirror, either side
    ("cma", False, {"mirror": True, "relocate": True}, kit.How.IN_PLACE, False, False),
    ("cma", True, {"mirror": True}, kit.How.IN_PLACE, False, False),
    ("auto", False, {"mirror": True, "relocate": True}, kit.How.IN_PLACE, False, False),
    ("cma", False, {"cuda": True, "mirror": True}, kit.How.MIRROR, False, False),
    ("shm", False, {"mirror": True}, kit.How.MIRROR, True, False),
    ("shm", False, {"relocate": True}, kit.How.RELOCATE, True, False),
    ("tcp", True, {"cuda": True, "mirror": True}, kit.How.MIRROR, False, False),
    ("nixl", False, {"cuda": True, "gpu_direct": True}, kit.How.IN_PLACE, False, True),
    ("tcp", False, {"mirror": True, "force_mirror": True}, kit.How.MIRROR, False, False),
])
def test_placement_decides_where_memory_is_registered(
        transport: str, producer: bool, kw: dict[str, bool], how: kit.How, own: bool,
        device: bool) -> None:
    p = kit.placement(transport, producer=producer, **kw)
    assert (p.how, p.own_memory, p.device) == (how, own, device)
    assert p.transport_options() == ({"cuda": True} if device else {})


def test_placement_refuses_what_no_way_fits_naming_the_transport() -> None:
    with pytest.raises(LayoutError, match=r"SGLang cannot register .* transport 'shm' writes "
                                          r"only into memory from its allocate\(\)"):
        kit.placement("shm", producer=False, engine="SGLang")
    with pytest.raises(LayoutError, match="GPU memory, which transport 'memory' cannot move"):
        kit.placement("memory", producer=True, cuda=True)
    with pytest.raises(LayoutError, match="gpu_direct: transport 'tcp' moves host memory"):
        kit.placement("tcp", producer=True, cuda=True, gpu_direct=True, mirror=True)
    with pytest.raises(LayoutError, match=r"SGLang's KV cache is in GPU memory and transport "
                                          r"'tcp' moves host memory only \(SGLang keeps no"):
        kit.placement("tcp", producer=True, cuda=True, gpu_direct=True, engine="SGLang")


# --- outcomes ---------------------------------------------------------------------------


def test_the_outcome_table_covers_every_status_and_holds_what_is_not_quiet() -> None:
    assert set(kit.OUTCOMES) == set(itertools.product(kit.Status, (False, True)))
    for (status, quiet), row in kit.OUTCOMES.items():
        if status in (kit.Status.SUCCESS, kit.Status.FAILED) and quiet:
            continue
        # not over for the engine: keep the memory, and SGLang keeps polling
        assert row.outcome is kit.Outcome.PENDING and not row.vllm_prefill and not row.vllm_decode
        assert row.kvpoll != kit.KVPOLL["Failed"] and row.kvpoll != kit.KVPOLL["Success"]
    ok = kit.OUTCOMES[(kit.Status.SUCCESS, True)]
    failed = kit.OUTCOMES[(kit.Status.FAILED, True)]
    assert (ok.outcome, ok.kvpoll, ok.vllm_prefill, ok.vllm_decode) == (
        kit.Outcome.SUCCEEDED, 4, "finished_sending", "finished_recving")
    assert (failed.outcome, failed.kvpoll, failed.vllm_prefill, failed.vllm_decode) == (
        kit.Outcome.FAILED, 0, "finished_sending", "failed_recving")
    # SGLang's own numbering (sglang.srt.disaggregation.base.conn.KVPoll)
    assert kit.KVPOLL == {"Failed": 0, "Bootstrapping": 1, "WaitingForInput": 2,
                          "Transferring": 3, "Success": 4}


# --- aux pool ---------------------------------------------------------------------------


def test_aux_rows_are_leased_once_and_given_back_once() -> None:
    pool = kit.AuxPool(2, name="aux")
    assert pool.component.name == "aux" and pool.component.tensors[0].capacity == 2
    a, b = pool.take(), pool.take()
    assert {a, b} == {0, 1} and pool.take() is None and pool.in_use == 2
    assert a is not None and b is not None
    pool.give(a)
    with pytest.raises(ValueError, match=f"aux row {a} is not leased"):
        pool.give(a)
    with pytest.raises(ValueError, match="aux row 7 is not leased"):
        pool.give(7)
    row = pool.row(b)
    stamp(row, "r-1")
    assert check(row, "r-1")[0] is AuxState.OK
    pool.give(b)
    again = pool.take()
    assert again is not None
    assert check(pool.row(again), "r-1")[0] is AuxState.EMPTY  # a lease starts cleared


def test_aux_rows_live_in_the_memory_they_are_given() -> None:
    backing = np.zeros(4096, np.uint8)
    pool = kit.AuxPool(3, allocate=lambda n: backing[:n])
    assert pool.component.tensors[0].ptr == backing.ctypes.data
    with pytest.raises(ValueError, match="returned 1 bytes"):
        kit.AuxPool(3, allocate=lambda n: backing[:1])


# --- figures and series -----------------------------------------------------------------



def test_figures_are_measured_once_from_theticking() -> None:
    f = kit.measure("prefill", ticking("prefill"), nbytes=5, reason=None,
                    component_bytes={"kv": 3, "mamba": 4})
    assert f.success and f.nbytes == 7 and f.seconds == pytest.approx(0.006)
    assert set(f.phases) == {"wait_indices", "prepare", "transfer", "move", "settle"}
    assert f.transfer_seconds == pytest.approx(0.003) and f.phases["move"] == pytest.approx(
        0.001)
    bad = kit.measure("decode", ticking("decode"), nbytes=5, reason="PeerLost")
    assert (bad.success, bad.outcome, bad.seconds, dict(bad.phases)) == (
        False, "PeerLost", None, {})


def test_every_series_has_the_one_prefix_and_record_feeds_them() -> None:
    assert all(x.name.startswith("kvhandoff_") and ":" not in x.name
               for x in kit.HANDOFF_SERIES)
    r = CollectorRegistry()
    made = {x.name: (Counter(x.name, x.doc, list(x.labels), registry=r) if x.buckets is None
                     else Histogram(x.name, x.doc, list(x.labels), buckets=x.buckets,
                                    registry=r)) for x in kit.HANDOFF_SERIES}
    ok = kit.measure("decode", ticking("decode"), nbytes=0, reason=None,
                     component_bytes={"kv": 64})
    for f in (ok, kit.measure("decode", ticking("decode"), nbytes=0, reason="PeerLost")):
        kit.record(f, lambda x, values: made[x.name].labels(*values))
    value = r.get_sample_value
    assert value("kvhandoff_requests_total", {"role": "decode", "status": "success"}) == 1
    assert value("kvhandoff_failures_total", {"role": "decode", "reason": "PeerLost"}) == 1
    assert value("kvhandoff_component_bytes_total", {"role": "decode", "component": "kv"}) == 64
    assert value("kvhandoff_phase_seconds_count", {"role": "decode", "phase": "transfer"}) == 1


# --- hooks ------------------------------------------------------------------------------


class Hook:
    def __init__(self, config: dict[str, object]) -> None:
        self.config = config


def test_a_hook_is_loaded_from_its_name_and_given_its_config() -> None:
    hook = kit.load_hook(f"{__name__}:Hook", {"path": "x"})
    assert isinstance(hook, Hook) and hook.config == {"path": "x"}
    with pytest.raises(ValueError, match=r"is not 'package\.module:factory'"):
        kit.load_hook("no-colon", {})
    with pytest.raises(ValueError, match="cannot be loaded"):
        kit.load_hook(f"{__name__}:Nothing", {})


def test_the_kit_and_the_pure_adapter_halves_load_no_engine() -> None:
    """An engine's plugin imports the kit in every engine process: it must not pull in an
    engine, torch, or the HTTP server the registry needs only where one is hosted."""
    import subprocess
    import sys

    code = ("import sys; import kvhandoff.integrations, kvhandoff.integrations.sglang.layout, "
            "kvhandoff.integrations.sglang.requests, kvhandoff.integrations.sglang.plugin, "
            "kvhandoff.integrations.vllm.layout, kvhandoff.integrations.vllm.requests; "
            "print(sorted(m for m in ('torch', 'transformers', 'sglang', 'vllm', 'aiohttp') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
