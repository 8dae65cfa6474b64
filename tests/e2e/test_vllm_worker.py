"""The connector's worker half without vLLM: two WorkerSides (prefill, decode) in one
process over the real session layer (bootstrap server, control sockets, tcp), on pages
laid out the way vLLM lays out a hybrid model's (attention + Mamba2 in one pool).

The staged pair does what the connector does for a GPU KV cache over tcp/shm: torch
"device" tensors, a host mirror registered in their place, blocks copied in and out
around the handoff. It runs on CPU tensors (forced with ``host_staging``) everywhere and
on CUDA tensors where a GPU is (``make gpu-check``). (NIXL's device-to-device path,
``gpu_direct``, needs two processes: tests/conformance/test_cuda_memory.py.)"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.integrations import AuxPool
from kvhandoff.integrations.vllm.block_copy import StagingPath
from kvhandoff.integrations.vllm.host_staging import HostStaging, kv_memory, tensor_info
from kvhandoff.integrations.vllm.layout import GroupInfo, MambaInfo, TensorInfo, build_layout
from kvhandoff.integrations.vllm.requests import RecvReq, SendReq, StepMeta
from kvhandoff.integrations.vllm.worker import WorkerSide
from kvhandoff.lab.testing.faulty import CountingTcp
from kvhandoff.lab.testing.vllm_dump import block_bytes
from kvhandoff.layout import Region
from kvhandoff.session.config import SessionConfig
from kvhandoff.transport.base import Transport
from kvhandoff.transport.registry import transport_class

BLOCKS, BS, HEADS, C = 8, 32, 2, 128  # C: K|V of one token, bf16 elements
PAGE = HEADS * BS * C * 2
MAMBA = MambaInfo(kind="mamba2", shapes=((128, 3), (2, 32, 32)), itemsizes=(2, 4),
                  conv_dim_first=True, n_groups=1)


GROUPS = [GroupInfo(0, "mamba", "MambaSpec", BS, ("model.layers.0.mixer",), mamba=MAMBA),
          GroupInfo(1, "full", "FullAttentionSpec", BS, ("model.layers.1.self_attn.attn",),
                    total_heads=HEADS)]
STATE_BYTES = 128 * 3 * 2 + 2 * 32 * 32 * 4  # MAMBA's conv + SSM: what a Mamba page moves


CUDA = torch.cuda.is_available()
NEEDS_CUDA = pytest.mark.skipif(not CUDA, reason="no CUDA device here (make gpu-check runs "
                                                 "these on a GPU)")


@dataclass
class Side:
    worker: WorkerSide
    pool: np.ndarray  # the KV memory as the side has it (a host copy for a GPU cache)
    device: torch.Tensor | None = None  # the "vLLM" tensors' storage, when torch holds it

    def memory(self) -> np.ndarray:
        """The KV memory's bytes now (read back from the GPU when it is there)."""
        return self.pool if self.device is None else self.device.cpu().numpy()


def _config(instance: str, transport: str = "tcp", heartbeat: float | None = None
            ) -> SessionConfig:
    beats = {} if heartbeat is None else {"heartbeat_interval": heartbeat,
                                          "heartbeat_timeout": 2 * heartbeat}
    return SessionConfig(instance=instance, transport=transport, bootstrap_timeout=10,
                         indices_timeout=10, release_timeout=5, transfer_timeout=10, **beats)


def _side(url: str, producer: bool, fill: bool, instance: str, *,
          transport: Transport | None = None, heartbeat: float | None = None) -> Side:
    pool = np.zeros(BLOCKS * PAGE, np.uint8)
    if fill:
        pool[:] = np.random.default_rng(7).integers(0, 256, pool.size, dtype=np.uint8)
    base = dict(ptr=pool.ctypes.data, base_ptr=pool.ctypes.data, base_nbytes=pool.nbytes)
    attn = TensorInfo(shape=(BLOCKS, HEADS, BS, C), strides=(HEADS * BS * C, BS * C, C, 1),
                      itemsize=2, dtype="bfloat16", **base)
    raw = TensorInfo(shape=(BLOCKS, 1, 1, PAGE), strides=(PAGE, PAGE, PAGE, 1), itemsize=1,
                     dtype="int8", **base)
    rows = AuxPool(4)
    aux = rows.component.tensors[0]
    layout = build_layout(GROUPS, {"model.layers.0.mixer": raw,
                                   "model.layers.1.self_attn.attn": attn},
                          tp_rank=0, tp_size=1, extra=(rows.component,),
                          extra_regions=(Region(ptr=aux.ptr, nbytes=aux.nbytes),),
                          identity=[("model", "test")])
    return Side(WorkerSide(layout, rows, producer=producer, bootstrap=url,
                           config=_config(instance, heartbeat=heartbeat), kv_name="g1.full",
                           transport=transport), pool)


def _staged_side(url: str, producer: bool, fill: bool, instance: str, transport: str,
                 device: str = "cpu", *, stage: bool = True,
                 path: StagingPath = StagingPath.BLOCKS) -> Side:
    """As the connector sets a worker up for vLLM's tensors on ``device``: a mirror of
    their shared storage registered instead (what it does for a GPU cache, and on CPU
    when ``host_staging`` forces it, ``stage``), or, on CPU without ``stage``, whatever
    the kit's placement decides for ``transport``. Aux rows come from the transport
    where it insists."""
    host = torch.zeros(BLOCKS * PAGE, dtype=torch.uint8)
    if fill:
        host[:] = torch.from_numpy(np.random.default_rng(7).integers(0, 256, host.numel(),
                                                                     dtype=np.uint8))
    dev = host.to(device)
    tensors = {"model.layers.0.mixer": dev.view(torch.int8).view(BLOCKS, 1, 1, PAGE),
               "model.layers.1.self_attn.attn": dev.view(torch.bfloat16).view(
                   BLOCKS, HEADS, BS, C)}
    mem = kv_memory(tensors, [g.layer_names for g in GROUPS], _config(instance, transport),
                    producer=producer, host_staging=stage and device == "cpu",
                    staging_path=path)
    rows = AuxPool(4, allocate=mem.allocate)
    aux = rows.component.tensors[0]
    layout = build_layout(GROUPS, {n: tensor_info(t) for n, t in mem.tensors.items()},
                          tp_rank=0, tp_size=1, extra=(rows.component,),
                          extra_regions=(Region(ptr=aux.ptr, nbytes=aux.nbytes),),
                          identity=[("model", "test")])
    worker = WorkerSide(layout, rows, producer=producer, bootstrap=url, config=mem.config,
                        kv_name="g1.full", staging=mem.staging, transport=mem.transport)
    return Side(worker, host.numpy(), dev)


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side, str]]:
    with BootstrapServer() as srv:
        name = f"vllm-worker-{time.monotonic_ns()}"
        p = _side(srv.url, True, True, name)
        d = _side(srv.url, False, False, name)
        try:
            yield p, d, srv.url
        finally:
            d.worker.close()
            p.worker.close()


@contextlib.contextmanager
def _sides(transport: str, device: str, *, stage: bool = True,
           path: StagingPath = StagingPath.BLOCKS) -> Iterator[tuple[Side, Side, str]]:
    with BootstrapServer() as srv:
        name = f"vllm-staged-{transport}-{device}-{time.monotonic_ns()}"
        p = _staged_side(srv.url, True, True, name, transport, device, stage=stage, path=path)
        try:
            d = _staged_side(srv.url, False, False, name, transport, device, stage=stage,
                             path=path)
        except BaseException:
            p.worker.close()
            raise
        try:
            yield p, d, srv.url
        finally:
            d.worker.close()
            p.worker.close()


NIXL = transport_class("nixl").usable()
NEEDS_NIXL = pytest.mark.skipif(not NIXL.ok, reason=f"nixl: {NIXL.reason}")


@pytest.fixture(params=[pytest.param((t, dev), id=f"{t}-{dev}", marks=(
    [NEEDS_CUDA] if dev == "cuda" else []) + ([NEEDS_NIXL] if t == "nixl" else []))
    for dev in ("cpu", "cuda") for t in ("tcp", "shm", "nixl")])
def staged(request: pytest.FixtureRequest) -> Iterator[tuple[Side, Side, str]]:
    transport, device = request.param
    with _sides(transport, device) as sides:
        yield sides


def _until(side: Side, want: str, which: int, timeout: float = 30.0) -> None:
    """Poll ``finished()`` (as vLLM's steps do) until ``want`` is reported in set
    ``which`` (0 sends, 1 receives, 2 failed receives; a failure is in 1 and 2 at once)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = side.worker.finished()
        if want in got[which]:
            assert which != 2 or want in got[1], "a failed receive must also be finished"
            return
        time.sleep(0.01)
    raise AssertionError(f"{want} not reported within {timeout} s")


def test_a_handoff_moves_every_group_and_reports_it(pair: tuple[Side, Side, str]) -> None:
    p, d, url = pair
    p.worker.start(StepMeta(sends=[SendReq("p-1", ((3,), (1, 2)), 40)]))
    d.worker.start(StepMeta(recvs=[RecvReq("d-1", "p-1", url, p.worker.agent.config.instance,
                                           ((6,), (4, 5)), 0, 40)]))
    _until(d, "d-1", 1)
    _until(p, "p-1", 0)
    for name, src, dst in (("g0.mamba", [3], [6]), ("g1.full", [1, 2], [4, 5])):
        assert np.array_equal(block_bytes(p.worker.layout, name, src),
                              block_bytes(d.worker.layout, name, dst))
    stats = d.worker.stats.take()
    assert stats["outcomes"] == [["decode", "success"]]
    assert {ph for _, ph, _ in stats["phase_seconds"]} == {"bootstrap", "transfer"}
    assert dict((g, n) for _, g, n in stats["group_bytes"]) == {
        "g0.mamba": sum(t.item_bytes for t in d.worker.layout.component("g0.mamba").tensors),
        "g1.full": 2 * PAGE}
    pstats = p.worker.stats.take()
    assert pstats["outcomes"] == [["prefill", "success"]]
    # phases from the requests' timelines: every event happened, in order (no negative span)
    assert {ph for _, ph, _ in pstats["phase_seconds"]} == {"wait_indices", "prepare",
                                                             "transfer", "move", "settle"}
    assert all(s >= 0 for *_, s in pstats["phase_seconds"] + stats["phase_seconds"])


def test_an_aborted_load_keeps_its_blocks_until_released(pair: tuple[Side, Side, str]) -> None:
    p, d, url = pair
    inst = p.worker.agent.config.instance
    d.worker.start(StepMeta(recvs=[RecvReq("d-2", "never-sent", url, inst, ((6,), (4,)), 0,
                                           20)]))
    assert d.worker.finished() == (set(), set(), set())  # waiting for prefill
    d.worker.start(StepMeta(aborts=["d-2"]))
    _until(d, "d-2", 0)  # a finished *send*: vLLM kept the aborted request's blocks for us
    assert d.worker.stats.take()["outcomes"] == [["decode", "RequestAborted"]]
    # an abort for a request already reported: vLLM freed it on that report, nothing more
    d.worker.start(StepMeta(aborts=["d-2"]))
    assert d.worker.finished() == (set(), set(), set())


def test_a_failed_load_reports_its_blocks(pair: tuple[Side, Side, str]) -> None:
    """Prefill offers 2 KV pages, decode asked for 3: the exact-length policy fails the
    request on both sides, and decode reports a finished *and* failed receive, so vLLM's
    load-failure policy applies."""
    p, d, url = pair
    inst = p.worker.agent.config.instance
    p.worker.start(StepMeta(sends=[SendReq("p-4", ((3,), (1, 2)), 64)]))
    d.worker.start(StepMeta(recvs=[RecvReq("d-4", "p-4", url, inst, ((6,), (4, 5, 7)), 0,
                                           96)]))
    _until(d, "d-4", 2)
    _until(p, "p-4", 0)
    assert d.worker.stats.take()["outcomes"][0][1] != "success"


def test_a_staged_handoff_lands_byte_exact_in_the_device_tensors(
        staged: tuple[Side, Side, str]) -> None:
    """Prefill copies its blocks device → mirror, the transport moves mirror → mirror,
    decode copies mirror → device before it reports the request: decode's device memory
    then holds prefill's attention pages and Mamba state at decode's block ids, and
    nothing else. With a GPU, every mirror is page-locked (no pageable fallback)."""
    _staged_handoff(*staged)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)])
@pytest.mark.parametrize(("transport", "path"), [
    ("tcp", StagingPath.PACKED), ("shm", StagingPath.PACKED), ("tcp", StagingPath.MAPPED)])
def test_a_packed_or_mapped_staged_handoff_lands_byte_exact_in_the_device_tensors(
        transport: str, path: StagingPath, device: str) -> None:
    """The same handoff on the other staging paths: ``packed`` (gathered on the device,
    one contiguous copy per layer, placed in the mirror; the reverse on decode) and
    ``mapped`` (the device writes and reads the mirror itself; tcp's mirrors are
    torch's, which it needs)."""
    with _sides(transport, device, path=path) as (p, d, url):
        for side in (p, d):
            assert isinstance(side.worker.staging, HostStaging)
            assert side.worker.staging.path is path
        _staged_handoff(p, d, url)


def _staged_handoff(p: Side, d: Side, url: str) -> None:
    for side in (p, d):
        assert isinstance(side.worker.staging, HostStaging) and side.device is not None
        if side.device.is_cuda:
            assert all(m.is_pinned() for m in side.worker.staging.mirrors.values())
    before = p.memory().copy()
    p.worker.start(StepMeta(sends=[SendReq("p-s", ((3,), (1, 2)), 40)]))
    d.worker.start(StepMeta(recvs=[RecvReq("d-s", "p-s", url, p.worker.agent.config.instance,
                                           ((6,), (4, 5)), 0, 40)]))
    _until(d, "d-s", 1)
    _until(p, "p-s", 0)
    _assert_landed(p, d, before)


@pytest.mark.parametrize("transport", ["cma", "auto"])
def test_a_same_host_handoff_moves_vllms_own_tensors_with_no_mirror(transport: str) -> None:
    """On the same-host single-copy path (cma, and auto, which picks cma between two
    processes of one host) vLLM's CPU tensors are registered in place: no staging, no
    memory from the transport; the regions each worker's transport holds are vLLM's
    own storage and the aux rows, nothing else; and the bytes land in decode's tensors
    themselves, each moved once (prefill's tensor → decode's tensor)."""
    assert transport_class("cma").usable().ok, transport_class("cma").usable().reason
    with _sides(transport, "cpu", stage=False) as (p, d, url):
        for side in (p, d):
            w = side.worker
            assert w.staging is None and side.device is not None
            storage = side.device.untyped_storage()
            lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
            kv = [t for c in w.layout.components if c.name != "aux" for t in c.tensors]
            assert all(lo <= t.ptr < hi for t in kv)
            aux = w.layout.component("aux").tensors[0]
            held = {(r.ptr, r.nbytes) for r in w.agent.transport.local.regions}
            assert held == {(storage.data_ptr(), storage.nbytes()), (aux.ptr, aux.nbytes)}
        before = p.memory().copy()
        p.worker.start(StepMeta(sends=[SendReq("p-c", ((3,), (1, 2)), 40)]))
        d.worker.start(StepMeta(recvs=[RecvReq("d-c", "p-c", url,
                                               p.worker.agent.config.instance,
                                               ((6,), (4, 5)), 0, 40)]))
        _until(d, "d-c", 1)
        _until(p, "p-c", 0)
        _assert_landed(p, d, before)


def _assert_landed(p: Side, d: Side, before: np.ndarray) -> None:
    """Decode holds prefill's blocks 1, 2 (attention) and 3 (Mamba) at its 4, 5 and 6,
    and nothing else; prefill's memory is unchanged; both report success."""
    want = np.zeros_like(before)
    want[4 * PAGE:6 * PAGE] = before[1 * PAGE:3 * PAGE]  # attention pages
    want[6 * PAGE:6 * PAGE + STATE_BYTES] = before[3 * PAGE:3 * PAGE + STATE_BYTES]  # conv, SSM
    assert np.array_equal(d.memory(), want)
    assert np.array_equal(p.memory(), before)
    assert d.worker.stats.take()["outcomes"] == [["decode", "success"]]
    assert p.worker.stats.take()["outcomes"] == [["prefill", "success"]]


def test_a_staging_copy_that_fails_fails_the_load(staged: tuple[Side, Side, str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The bytes arrived but could not reach vLLM's blocks: decode reports a failed
    receive (vLLM's load-failure policy applies), never a success."""
    p, d, url = staged

    def broken(blocks: object) -> None:
        raise RuntimeError("device copy failed")

    monkeypatch.setattr(d.worker.staging, "to_device", broken)
    p.worker.start(StepMeta(sends=[SendReq("p-f", ((3,), (1, 2)), 40)]))
    d.worker.start(StepMeta(recvs=[RecvReq("d-f", "p-f", url, p.worker.agent.config.instance,
                                           ((6,), (4, 5)), 0, 40)]))
    _until(d, "d-f", 2)
    assert d.worker.stats.take()["outcomes"] == [["decode", "StagingError"]]
    assert not d.memory().any()


def test_a_send_with_a_block_outside_the_cache_fails_alone(
        staged: tuple[Side, Side, str]) -> None:
    """Staging refuses the block id before copying; the send fails, the worker lives."""
    p, _, _ = staged
    p.worker.start(StepMeta(sends=[SendReq("p-x", ((BLOCKS,), (1,)), 20)]))
    _until(p, "p-x", 0)
    assert p.worker.stats.take()["outcomes"][0][1] != "success"


def test_closing_a_worker_closes_its_staging_after_its_transport() -> None:
    """The worker owns the staging it was given: its mirrors are unregistered once the
    transport that wrote into them is closed (shm's decode mirror lives in shm's own
    memory)."""
    with _sides("shm", "cpu") as (p, d, _):
        for side in (p, d):
            w = side.worker
            assert w.staging is not None
            order: list[str] = []
            agent_close, staging_close = w.agent.close, w.staging.close
            w.agent.close = lambda a=agent_close, o=order: (o.append("agent"), a())[1]
            w.staging.close = lambda c=staging_close, o=order: (o.append("staging"), c())[1]
            w.close()
            assert order == ["agent", "staging"]


def test_a_steps_sends_whose_indices_are_in_go_out_as_one_write() -> None:
    """Decode's indices for three requests reach prefill before its step starts them
    (vLLM's usual order when decode is idle), in one message (decode's step packs
    them): the step's three writes are decided on the step thread and go out as one
    submit whose notice carries the three statuses."""
    t = CountingTcp()
    with BootstrapServer() as srv:
        name = f"vllm-batched-{time.monotonic_ns()}"
        # heartbeats every minute: the only messages prefill gets are Hello and the indices
        p = _side(srv.url, True, True, name, transport=t, heartbeat=60.0)
        try:
            d = _side(srv.url, False, False, name, heartbeat=60.0)  # handshakes now
        except BaseException:
            p.worker.close()
            raise
        try:
            heard = p.worker.agent.stats["received"]
            assert p.worker.agent.stats["early_inits"] == 0
            blocks = [((1 + i,), (4 + i,)) for i in range(3)]  # (Mamba, attention) each
            d.worker.start(StepMeta(recvs=[
                RecvReq(f"d-{i}", f"p-{i}", srv.url, name, b, 0, 20)
                for i, b in enumerate(blocks)]))
            deadline = time.monotonic() + 30
            while p.worker.agent.stats["early_inits"] < 3:  # the three TransferInits
                assert time.monotonic() < deadline, "decode's indices never reached prefill"
                time.sleep(0.005)
            assert p.worker.agent.stats["received"] < heard + 3  # packed: fewer messages
            p.worker.start(StepMeta(sends=[SendReq(f"p-{i}", b, 20)
                                           for i, b in enumerate(blocks)]))
            for side, which, ids in ((d, 1, {"d-0", "d-1", "d-2"}), (p, 0, {"p-0", "p-1", "p-2"})):
                got: set[str] = set()
                while not ids <= got:  # finished() reports each request once
                    assert time.monotonic() < deadline, f"finished {got}, want {ids}"
                    got |= side.worker.finished()[which]
                    time.sleep(0.005)
            assert t.notices == [3], t.notices
            for src_dst in blocks:
                for name_, ids in zip(("g0.mamba", "g1.full"), src_dst, strict=True):
                    assert np.array_equal(block_bytes(p.worker.layout, name_, list(ids)),
                                          block_bytes(d.worker.layout, name_, list(ids)))
            assert [o for _, o in d.worker.stats.take()["outcomes"]] == ["success"] * 3
        finally:
            d.worker.close()
            p.worker.close()
