"""The vLLM connector's pure halves, without vLLM: layouts from what vLLM registers,
block picking, and the scheduler's decisions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvhandoff.binding import RequestKey
from kvhandoff.integrations.vllm.layout import (
    GroupInfo,
    TensorInfo,
    VllmLayoutError,
    build_layout,
    layer_index,
)
from kvhandoff.integrations.vllm.requests import GroupRule, backoff, pick, prompt_digest
from kvhandoff.integrations.vllm.scheduler import SchedulerConfig, SchedulerSide
from kvhandoff.lab.testing.oracle import expected_writes
from kvhandoff.layout import Layout
from kvhandoff.plan import Indices, plan
from kvhandoff.session.peers.compat import handshake_report
from kvhandoff.state_types import StateType

BLOCKS, BS, HEAD, KV_HEADS = 16, 32, 64, 4


def _attn(buf: np.ndarray, heads: int) -> TensorInfo:
    """A bf16 ``[B, H, N, C]`` head-major view (C = K|V of one token) over ``buf``."""
    c = 2 * HEAD
    return TensorInfo(ptr=buf.ctypes.data, shape=(BLOCKS, heads, BS, c),
                      strides=(heads * BS * c, BS * c, c, 1), itemsize=2, dtype="bfloat16",
                      base_ptr=buf.ctypes.data, base_nbytes=buf.nbytes)


def _hybrid(tp_rank: int = 0, tp_size: int = 1, *, model: str = "m") -> tuple[Layout, list[Any]]:
    heads = KV_HEADS // tp_size
    page = heads * BS * 2 * HEAD * 2
    pool = np.zeros(BLOCKS * page, np.uint8)  # the attention and mamba layers overlay it
    mamba = TensorInfo(ptr=pool.ctypes.data, shape=(BLOCKS, 1, 1, page // 2),
                       strides=(page, page // 2, page // 2, 1), itemsize=1, dtype="int8",
                       base_ptr=pool.ctypes.data, base_nbytes=pool.nbytes)
    groups = [GroupInfo(0, "mamba", "MambaSpec", BS, ("model.layers.0.linear_attn",)),
              GroupInfo(1, "full", "FullAttentionSpec", BS, ("model.layers.1.self_attn.attn",),
                        total_heads=KV_HEADS)]
    tensors = {"model.layers.0.linear_attn": mamba,
               "model.layers.1.self_attn.attn": _attn(pool, heads)}
    if tp_size > 1:
        groups, tensors = groups[1:], {k: v for k, v in tensors.items() if "self_attn" in k}
    layout = build_layout(groups, tensors, tp_rank=tp_rank, tp_size=tp_size,
                          identity=[("model", model)])
    return layout, [pool]


def test_layer_names_map_to_model_layers() -> None:
    assert layer_index("model.layers.12.self_attn.attn") == 12
    assert layer_index("layers.0.linear_attn") == 0
    assert layer_index("lm_head") == -1


def test_groups_become_components_over_one_shared_pool() -> None:
    layout, _keep = _hybrid()
    kinds = {c.name: c.type for c in layout.components}
    assert kinds == {"g0.mamba": StateType.MAMBA, "g1.full": StateType.KV}
    assert len(layout.regions) == 1  # both groups alias one allocation
    attn = layout.component("g1.full").tensors[0]
    assert attn.shard is not None and attn.shard.groups == (KV_HEADS,)
    assert attn.item_bytes == KV_HEADS * BS * 2 * HEAD * 2


def test_heterogeneous_tp_slices_attention_by_head_byte_exact() -> None:
    """Prefill TP 1 → decode TP 2 over the layouts vLLM would register, checked against
    the naive oracle byte by byte."""
    src, _k1 = _hybrid(0, 1)
    src = Layout(page_size=BS, components=(src.component("g1.full"),), regions=src.regions)
    for rank in range(2):
        dst, _k2 = _hybrid(rank, 2)
        request = {"g1.full": Indices([3, 5], [7, 2])}
        segs = plan(src, dst, request).flatten()
        got = {d + i: (0, s + i) for s, d, n in zip(segs.src.tolist(), segs.dst.tolist(),
                                                    segs.length.tolist(), strict=True)
               for i in range(n)}
        want = expected_writes([src], dst, request).as_dict()
        assert got == want and len(want) == 2 * KV_HEADS // 2 * BS * 2 * HEAD * 2


def test_mamba_under_tp_is_refused_at_start_up_naming_the_group() -> None:
    pool = np.zeros(BLOCKS * 4096, np.uint8)
    t = TensorInfo(ptr=pool.ctypes.data, shape=(BLOCKS, 1, 1, 4096), strides=(4096, 4096, 4096, 1),
                   itemsize=1, dtype="int8", base_ptr=pool.ctypes.data, base_nbytes=pool.nbytes)
    g = GroupInfo(0, "mamba", "MambaSpec", BS, ("layers.0.mixer",))
    with pytest.raises(VllmLayoutError, match=r"group 0 \(MambaSpec\).*TP 1"):
        build_layout([g], {"layers.0.mixer": t}, tp_rank=0, tp_size=2)


def test_two_full_attention_groups_and_unknown_specs_are_refused() -> None:
    g = [GroupInfo(0, "full", "FullAttentionSpec", BS, ()),
         GroupInfo(1, "full", "FullAttentionSpec", BS, ())]
    with pytest.raises(VllmLayoutError, match="2 full-attention"):
        build_layout(g, {}, tp_rank=0, tp_size=1)
    with pytest.raises(VllmLayoutError, match="CrossAttentionSpec"):
        build_layout([GroupInfo(0, "CrossAttentionSpec", "CrossAttentionSpec", BS, ())], {},
                     tp_rank=0, tp_size=1)


def test_handshake_names_identity_fields_that_differ() -> None:
    a, _k1 = _hybrid(model="llama")
    b, _k2 = _hybrid(model="qwen")
    problems = handshake_report(a, b, prefill_transport="tcp", decode_transport="tcp",
                                protocol_version=3)
    assert any("model: prefill has 'llama', decode has 'qwen'" in p for p in problems)


def test_block_picking_by_token_range() -> None:
    full, swa = GroupRule("full", 4), GroupRule("sliding", 4, window=6)
    mamba = GroupRule("mamba", 4, spec_blocks=2)
    blocks = [10, 11, 12, 13, 14]
    assert pick(full, blocks, start=0, end=9) == [10, 11, 12]
    assert pick(full, blocks, start=4, end=9) == [11, 12]
    assert pick(swa, blocks, start=0, end=17) == [12, 13, 14]
    assert pick(mamba, [0, 0, 7, 8, 9], start=0, end=9) == [7]  # two scratch blocks dropped
    assert pick(mamba, [7], start=0, end=9) == [7]
    with pytest.raises(ValueError, match=r"need blocks 0\.\.3"):
        pick(full, blocks[:2], start=0, end=13)
    assert backoff(has_mamba=True) == 1 and backoff(has_mamba=False) == 0
    assert prompt_digest([1, 2, 3], 2) == prompt_digest([1, 2, 4], 2) != prompt_digest([1, 2], 1)


@dataclass
class _Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    status: str = "FINISHED_LENGTH_CAPPED"
    num_computed_tokens: int = 0
    max_tokens: int = 16
    _all_token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = -1

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)


@dataclass
class _Blocks:
    ids: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


def _sched(producer: bool) -> SchedulerSide:
    return SchedulerSide(SchedulerConfig(
        producer=producer, bootstrap="http://127.0.0.1:1", instance="default",
        rules=(GroupRule("mamba", 4), GroupRule("full", 4)), transfer_groups=(0, 1), backoff=1))


def test_a_prefill_request_hands_its_state_to_a_decode_request() -> None:
    prompt = list(range(100, 110))
    p, d = _sched(True), _sched(False)
    req = _Req("p-1", list(prompt), {"do_remote_decode": True}, _all_token_ids=list(prompt))
    p.on_new_request(req)
    assert req.prompt_token_ids == prompt[:-1] == req._all_token_ids  # backoff 1
    assert req.num_prompt_tokens == 9 and req.max_tokens == 1
    req.num_computed_tokens = 9
    delay, params = p.request_finished(req, ([0, 5], [1, 2, 3]))
    assert delay and params is not None and params["kvh_num_tokens"] == 9
    sends = p.build_meta().sends
    assert sends[0].blocks == ((5,), (1, 2, 3)) and p.pending_push
    dreq = _Req("d-1", list(prompt), dict(params))
    assert d.get_num_new_matched_tokens(dreq, 0) == (9, True)
    d.update_state_after_alloc(dreq, _Blocks(([8], [4, 6, 7])), 9)
    recv = d.build_meta().recvs[0]
    assert (recv.remote_id, recv.blocks, recv.num_tokens) == ("p-1", ((8,), (4, 6, 7)), 9)
    # the request's key: made by prefill, carried by the params, the same on both sides
    assert recv.key == sends[0].key == params["kvh_key"] and RequestKey.from_hex(recv.key)
    assert dreq.kv_transfer_params is not None
    assert dreq.kv_transfer_params["do_remote_prefill"] is False
    p.update_finished({"p-1"}, None)
    assert not p.pending_push


@pytest.mark.parametrize("change", ["prompt", "bootstrap", "tokens", "id", "no_key", "bad_key"])
def test_decode_refuses_state_that_is_not_for_its_tokens(change: str) -> None:
    prompt = list(range(10))
    params: dict[str, Any] = {
        "do_remote_prefill": True, "kvh_request_id": "p-1",
        "kvh_bootstrap": "http://127.0.0.1:1", "kvh_num_tokens": 9,
        "kvh_prompt": prompt_digest(prompt, 9), "kvh_key": RequestKey.new().hex()}
    if change == "prompt":
        prompt[3] = 99
    elif change == "bootstrap":
        params["kvh_bootstrap"] = "http://10.9.9.9:1"
    elif change == "tokens":
        params["kvh_num_tokens"] = 10  # leaves no token for decode's own step
    elif change == "no_key":  # it could not claim the KV: computed here, not tried
        del params["kvh_key"]
    elif change == "bad_key":
        params["kvh_key"] = "not hex"
    else:
        params["kvh_request_id"] = 5
    req = _Req("d-1", prompt, params)
    assert _sched(False).get_num_new_matched_tokens(req, 0) == (0, False)
    assert params["do_remote_prefill"] is False  # computed locally, never loaded


def _loading(status: str) -> tuple[SchedulerSide, _Req]:
    """A decode scheduler whose request (ending with ``status``) is loading blocks."""
    d = _sched(False)
    prompt = list(range(10))
    params = {"do_remote_prefill": True, "kvh_request_id": "p-1",
              "kvh_bootstrap": "http://127.0.0.1:1", "kvh_num_tokens": 9,
              "kvh_prompt": prompt_digest(prompt, 9), "kvh_key": RequestKey.new().hex()}
    req = _Req("d-1", prompt, params, status=status)
    d.get_num_new_matched_tokens(req, 0)
    d.update_state_after_alloc(req, _Blocks(([8], [4, 6, 7])), 9)
    d.build_meta()
    return d, req


def test_a_decode_request_aborted_mid_receive_keeps_its_blocks() -> None:
    d, req = _loading("FINISHED_ABORTED")
    assert d.request_finished(req, ([8], [4, 6, 7])) == (True, None)
    assert d.build_meta().aborts == ["d-1"]


def test_a_decode_request_failed_by_vllm_for_its_load_is_freed_at_once() -> None:
    """vLLM's fail policy ends the request in the step the worker reported its failed
    (and released) receive: the blocks are free, and no abort follows."""
    d, req = _loading("FINISHED_ERROR")
    assert d.request_finished(req, ([8], [4, 6, 7])) == (False, None)
    assert d.build_meta().aborts == []


def test_prefill_requests_that_did_not_finish_normally_send_nothing() -> None:
    p = _sched(True)
    req = _Req("p-1", [1, 2, 3], {"do_remote_decode": True}, status="FINISHED_ABORTED")
    assert p.request_finished(req, ([1], [2])) == (False, None)
    assert p.build_meta().sends == []


# --- recurrent state under heterogeneous TP, against vLLM's own per-rank sharding --------

K1 = 3  # conv kernel - 1
SLOTS = 3


@dataclass(frozen=True)
class _Model:
    """A recurrent layer's global dims, as a model config states them."""

    kind: str
    conv: tuple[int, ...]  # global conv channels per sub-block (x, B, C) / (q, k, v) / (x,)
    group: int  # mamba2: channels per B/C group (the SSM state size)
    n_groups: int
    ssm: tuple[int, ...]  # the global SSM / temporal state shape, dim 0 sharded

    def rank_channels(self, tp: int, r: int) -> list[int]:
        """The global conv channels rank r holds, in its page order — vLLM's sharding:
        each sub-block split evenly; Mamba2's B/C groups extended and replicated when
        TP exceeds them (MambaStateShapeCalculator.extra_groups_for_head_shards)."""
        out, base = [], 0
        for i, size in enumerate(self.conv):
            if self.kind == "mamba2" and i and self.n_groups % tp:
                g = r // (tp // self.n_groups)  # this rank's (replicated) group
                out += range(base + g * self.group, base + (g + 1) * self.group)
            else:
                n = size // tp
                out += range(base + r * n, base + (r + 1) * n)
            base += size
        return out

    def info(self, tp: int, dim_first: bool) -> Any:
        from kvhandoff.integrations.vllm.layout import MambaInfo

        local = len(self.rank_channels(tp, 0))
        conv = (local, K1) if dim_first else (K1, local)
        ssm = (self.ssm[0] // tp, *self.ssm[1:])
        return MambaInfo(kind=self.kind, shapes=(conv, ssm), itemsizes=(4, 4),
                         conv_dim_first=dim_first, n_groups=self.n_groups)


MODELS = {  # Mamba2: x = heads x head_dim, B = C = n_groups x state; GDN: q = k = k_heads x 16
    "mamba2-1group": _Model("mamba2", (256, 64, 64), 64, 1, (8, 32, 64)),
    "mamba2-4groups": _Model("mamba2", (256, 256, 256), 64, 4, (8, 32, 64)),
    "gdn-unequal": _Model("gdn", (64, 64, 256), 0, 0, (8, 32, 16)),  # k: 4 x 16, v: 8 x 32
    "mamba1": _Model("mamba1", (128,), 0, 0, (128, 16)),
}


def _pages(m: _Model, tp: int, r: int, dim_first: bool, fill: bool, pad: int
           ) -> tuple[Layout, np.ndarray]:
    """One rank's Mamba pages as vLLM lays them out ([conv | ssm | pad] per slot), filled
    with the global coordinates of every value (prefill) or zeros (decode)."""
    info = m.info(tp, dim_first)
    chans = m.rank_channels(tp, r)
    conv = np.array([[c * 16 + k for k in range(K1)] for c in chans], np.int32)
    conv = conv if dim_first else conv.T.copy()
    heads = m.ssm[0] // tp
    per_head = math.prod(m.ssm[1:])
    ssm = np.array([[(r * heads + h) * 100000 + j for j in range(per_head)]
                    for h in range(heads)], np.int32)
    page = conv.nbytes + ssm.nbytes + pad
    buf = np.zeros(SLOTS * page, np.uint8)
    if fill:
        for s in range(SLOTS):
            body = np.concatenate([conv.view(np.uint8).ravel(), ssm.view(np.uint8).ravel()])
            buf[s * page:s * page + len(body)] = body + s  # each slot differs
    t = TensorInfo(ptr=buf.ctypes.data, shape=(SLOTS, 1, 1, page), strides=(page, page, page, 1),
                   itemsize=1, dtype="int8", base_ptr=buf.ctypes.data, base_nbytes=buf.nbytes)
    g = GroupInfo(0, "mamba", "MambaSpec", BS, ("model.layers.0.mixer",), mamba=info)
    return build_layout([g], {"model.layers.0.mixer": t}, tp_rank=r, tp_size=tp), buf


def _run(src: Layout, dst: Layout, slot_p: int, slot_d: int) -> None:
    import ctypes

    segs = plan(src, dst, {"g0.mamba": Indices([slot_p], [slot_d])}).flatten()
    for s, d, n in zip(segs.src.tolist(), segs.dst.tolist(), segs.length.tolist(), strict=True):
        ctypes.memmove(d, s, n)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("dim_first", [True, False], ids=["DS", "SD"])
@pytest.mark.parametrize(("ptp", "dtp"), [(1, 2), (2, 1), (2, 4), (4, 2), (1, 1)])
def test_recurrent_state_lands_where_vllm_keeps_it(name: str, dim_first: bool, ptp: int,
                                                    dtp: int) -> None:
    """Prefill TP ``ptp`` → decode TP ``dtp``: every decode rank's page ends up exactly as
    vLLM at TP ``dtp`` would have computed it (its own channel and head shares, in its
    order), padding and other slots untouched."""
    m = MODELS[name]
    srcs = [_pages(m, ptp, r, dim_first, True, pad=40 * (r + 1)) for r in range(ptp)]
    for r in range(dtp):
        dst, dbuf = _pages(m, dtp, r, dim_first, False, pad=24)
        _want_layout, want = _pages(m, dtp, r, dim_first, True, pad=24)
        for src, _buf in srcs:
            _run(src, dst, 1, 2)
        page = len(dbuf) // SLOTS
        got = dbuf.reshape(SLOTS, page)
        expect = want.reshape(SLOTS, page)[1].copy()
        expect[-24:] = 0  # padding is never written
        assert np.array_equal(got[2], expect)
        assert not got[0].any() and not got[1].any()
