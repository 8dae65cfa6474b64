"""The connector's worker half without vLLM: two WorkerSides (prefill, decode) in one
process over the real session layer (bootstrap server, control sockets, tcp), on pages
laid out the way vLLM lays out a hybrid model's (attention + Mamba2 in one pool)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from kvhandoff.integrations.vllm.layout import GroupInfo, MambaInfo, TensorInfo, build_layout
from kvhandoff.integrations.vllm.requests import RecvReq, SendReq, StepMeta
from kvhandoff.integrations.vllm.worker import AuxRows, WorkerSide, block_bytes
from kvhandoff.layout import Region
from kvhandoff.session.bootstrap import BootstrapServer
from kvhandoff.session.config import SessionConfig

BLOCKS, BS, HEADS, C = 8, 32, 2, 128  # C: K|V of one token, bf16 elements
PAGE = HEADS * BS * C * 2
MAMBA = MambaInfo(kind="mamba2", shapes=((128, 3), (2, 32, 32)), itemsizes=(2, 4),
                  conv_dim_first=True, n_groups=1)


@dataclass
class Side:
    worker: WorkerSide
    pool: np.ndarray


def _side(url: str, producer: bool, fill: bool, instance: str) -> Side:
    pool = np.zeros(BLOCKS * PAGE, np.uint8)
    if fill:
        pool[:] = np.random.default_rng(7).integers(0, 256, pool.size, dtype=np.uint8)
    base = dict(ptr=pool.ctypes.data, base_ptr=pool.ctypes.data, base_nbytes=pool.nbytes)
    attn = TensorInfo(shape=(BLOCKS, HEADS, BS, C), strides=(HEADS * BS * C, BS * C, C, 1),
                      itemsize=2, dtype="bfloat16", **base)
    raw = TensorInfo(shape=(BLOCKS, 1, 1, PAGE), strides=(PAGE, PAGE, PAGE, 1), itemsize=1,
                     dtype="int8", **base)
    groups = [GroupInfo(0, "mamba", "MambaSpec", BS, ("model.layers.0.mixer",), mamba=MAMBA),
              GroupInfo(1, "full", "FullAttentionSpec", BS, ("model.layers.1.self_attn.attn",),
                        total_heads=HEADS)]
    rows = AuxRows(4)
    aux = rows.component.tensors[0]
    layout = build_layout(groups, {"model.layers.0.mixer": raw,
                                   "model.layers.1.self_attn.attn": attn},
                          tp_rank=0, tp_size=1, extra=(rows.component,),
                          extra_regions=(Region(ptr=aux.ptr, nbytes=aux.nbytes),),
                          identity=[("model", "test")])
    cfg = SessionConfig(instance=instance, bootstrap_timeout=10, indices_timeout=10,
                        release_timeout=5, transfer_timeout=10)
    return Side(WorkerSide(layout, rows, producer=producer, bootstrap=url, config=cfg,
                           kv_name="g1.full"), pool)


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
    assert {ph for _, ph, _ in stats["phase_seconds"]} == {"lookup", "transfer"}
    assert dict((g, n) for _, g, n in stats["group_bytes"]) == {
        "g0.mamba": sum(t.item_bytes for t in d.worker.layout.component("g0.mamba").tensors),
        "g1.full": 2 * PAGE}
    assert p.worker.stats.take()["outcomes"] == [["prefill", "success"]]


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
