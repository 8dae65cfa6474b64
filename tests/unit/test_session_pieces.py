"""The session layer's pure pieces: KV chunk slicing, aux rows, heartbeat bookkeeping,
the config, plan-order checksums, DP routing and the decode-rank mirror of the rank map."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvhandoff.lab import shapes
from kvhandoff.layout import Component, Layout, TensorSpec
from kvhandoff.plan import execute, plan
from kvhandoff.plan.execute import HostMemory
from kvhandoff.session import SessionConfig, route_dp
from kvhandoff.session.peers.mapping import bootstrap_peers, decode_candidates
from kvhandoff.session.rank.liveness.book import BUSY_FACTOR, Liveness
from kvhandoff.session.request import aux as auxmod
from kvhandoff.session.request.checksum import plan_digests
from kvhandoff.session.request.chunks import KvCursor
from kvhandoff.session.request.views import TensorViews
from kvhandoff.state_types import StateType


def cursor(dst: list[int], *, ps: int = 4, pd: int = 4, prefix: int = 0, pages: int,
           tokens: int | None = None, fr0: int = 0) -> KvCursor:
    return KvCursor(component="kv", dst_items=np.array(dst, np.int64), dst_first_row=fr0,
                    src_page=ps, dst_page=pd, prefix_len=prefix, num_pages=pages,
                    num_tokens=tokens, repageable=True)


def test_page_path_drops_the_prefix_and_slices_decode_pages() -> None:
    c = cursor([50, 51, 52, 53], prefix=8, pages=6)  # prefill pages 0..5, first 2 in prefix
    assert c.problem() is None
    a = c.next(np.array([10, 11, 12]), last=False)
    assert a.src.tolist() == [12] and a.dst.tolist() == [50]
    b = c.next(np.array([13, 14, 15]), last=True)
    assert b.src.tolist() == [13, 14, 15] and b.dst.tolist() == [51, 52, 53]


def test_full_prefix_hit_moves_no_kv() -> None:
    c = cursor([], prefix=16, pages=4)
    assert c.problem() is None
    idx = c.next(np.array([1, 2, 3, 4]), last=True)
    assert len(idx.src) == len(idx.dst) == 0


def test_page_counts_that_disagree_are_named_up_front() -> None:
    c = cursor([1, 2, 3], pages=5)
    assert "prefill sends 5 pages" in (c.problem() or "") and "decode allocated 3" in (
        c.problem() or "")
    c = cursor([1, 2], pages=2)
    c.next(np.array([7]), last=False)
    with pytest.raises(ValueError, match=r"the 2 Sender\.init announced"):
        c.next(np.array([8, 9]), last=True)


def test_row_path_repages_by_tokens() -> None:
    # prefill pages of 4, decode pages of 8, 21 tokens, decode holds the first 8
    c = cursor([100, 101], ps=4, pd=8, prefix=8, pages=6, tokens=21)
    assert c.problem() is None
    a = c.next(np.array([0, 0, 7, 8]), last=False)  # tokens 0..16; 8..16 move
    assert a.src.tolist() == [7, 8] and a.src_first_row == 0
    assert a.dst.tolist() == [100] and a.dst_first_row == 0 and a.num_rows == 8
    b = c.next(np.array([9, 10]), last=True)  # tokens 16..21
    assert b.src.tolist() == [9, 10] and b.dst.tolist() == [101]
    assert b.dst_first_row == 0 and b.num_rows == 5


def test_row_path_needs_the_token_count() -> None:
    assert "num_tokens" in (cursor([1], ps=4, pd=8, pages=2).problem() or "")
    bad = KvCursor(component="kv", dst_items=np.array([1]), dst_first_row=0, src_page=4,
                   dst_page=8, prefix_len=0, num_pages=2, num_tokens=8, repageable=False)
    assert "same page size" in (bad.problem() or "")


def test_aux_rows_round_trip_and_guard() -> None:
    spec = auxmod.AuxSpec(top_logprobs=3, hidden_bytes=5)
    buf, comp = spec.allocate(4)
    assert comp.tensors[0].item_bytes == spec.row_bytes and spec.row_bytes % 8 == 0
    row = buf[spec.row_bytes:2 * spec.row_bytes]
    spec.pack(row, first_token=42, first_logprob=-1.5, top_ids=[1, 2], top_logprobs=[-0.1, -0.2],
              hidden=b"abcde")
    assert auxmod.check(row, "r")[0] is auxmod.AuxState.EMPTY
    auxmod.stamp(row, "r")
    assert auxmod.check(row, "r")[0] is auxmod.AuxState.OK
    assert auxmod.check(row, "s")[0] is auxmod.AuxState.OTHER
    rec = spec.unpack(row)
    assert (rec.first_token, rec.top_ids, rec.hidden) == (42, (1, 2), b"abcde")
    assert rec.top_logprobs == pytest.approx((-0.1, -0.2))
    row[20] ^= 1
    assert auxmod.check(row, "r")[0] is auxmod.AuxState.CORRUPT
    auxmod.clear(row)
    assert auxmod.check(row, "r")[0] is auxmod.AuxState.EMPTY
    assert auxmod.request_guard(5) != auxmod.request_guard("5")


def test_row_views_of_padded_items_skip_the_padding() -> None:
    """``TensorViews.row`` of a padded tensor is item ``i``'s bytes at ``i * stride``."""
    buf = np.arange(3 * 16 + 8, dtype=np.uint8)  # 3 items of 8 B, 16 B apart; last unpadded
    ptr = int(buf.ctypes.data)
    t = TensorSpec(name="conv", layer_id=0, ptr=ptr, nbytes=2 * 16 + 8, item_bytes=8,
                   stride=16)
    lay = Layout(page_size=1, components=(
        Component(type=StateType.MAMBA, name="mamba", tensors=(t,)),))
    views = TensorViews(lay)
    assert t.capacity == 3
    for i in range(3):
        row = views.row(t, i)
        assert row is not None
        np.testing.assert_array_equal(row, buf[16 * i:16 * i + 8])
    assert views.row(t, 3) is None


def _down(endpoint: str) -> bool:
    return False


def _up(endpoint: str) -> bool:
    return True


def test_liveness_pings_and_declares_silent_peers_with_a_dead_link_lost() -> None:
    lv = Liveness(interval=1.0, timeout=3.0)
    ping, lost, busy = lv.tick({"a"}, 10.0, _down)
    assert ping == ["a"] and not lost and not busy
    assert lv.tick({"a"}, 10.5, _down) == ([], [], [])
    lv.heard("a", 12.0)
    assert lv.tick({"a"}, 14.9, _down)[1] == []
    ping, lost, busy = lv.tick({"a"}, 15.5, _down)
    assert [(s.endpoint, s.link_up) for s in lost] == [("a", False)] and not busy
    assert lv.tick({"a"}, 15.6, _down)[1] == []  # watching restarts from now


def test_a_silent_peer_whose_link_answers_is_busy_not_lost() -> None:
    """Silence alone is not death: a peer whose libzmq still answers the link's
    heartbeats is busy (reported once), until the link drops or the backstop."""
    lv = Liveness(interval=1.0, timeout=3.0)
    lv.tick({"a", "b"}, 10.0, _up)
    _, lost, busy = lv.tick({"a", "b"}, 14.0, _up)
    assert not lost and sorted(s.endpoint for s in busy) == ["a", "b"]
    _, lost, busy = lv.tick({"a", "b"}, 20.0, _up)
    assert not lost and not busy  # still busy: said once
    _, lost, _ = lv.tick({"a", "b"}, 21.0, lambda ep: ep != "a")  # a's link drops
    assert [s.endpoint for s in lost] == ["a"]
    lv.heard("b", 22.0)  # b answers at last: a new silence is a new episode
    _, lost, busy = lv.tick({"b"}, 26.0, _up)
    assert not lost and [s.endpoint for s in busy] == ["b"]
    _, lost, _ = lv.tick({"b"}, 22.0 + lv.busy_limit + 0.1, _up)  # the backstop
    assert [(s.endpoint, s.link_up) for s in lost] == [("b", True)]
    assert lv.busy_limit == BUSY_FACTOR * 3.0


def test_config_reads_env_with_one_prefix() -> None:
    cfg = SessionConfig.from_env({"KVHANDOFF_TRANSFER_TIMEOUT": "7.5",
                                  "KVHANDOFF_CHECKSUM": "yes",
                                  "KVHANDOFF_TRANSPORT_OPTIONS": '{"connections": 4}',
                                  "OTHER": "x"}, instance="p1")
    assert cfg.transfer_timeout == 7.5 and cfg.checksum and cfg.instance == "p1"
    assert cfg.transport_options == {"connections": 4}
    with pytest.raises(ValueError, match="KVHANDOFF_WORKERS"):
        SessionConfig.from_env({"KVHANDOFF_WORKERS": "many"})
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        SessionConfig(heartbeat_interval=2.0, heartbeat_timeout=1.0)


def test_checksums_agree_in_plan_order_and_catch_a_flipped_byte() -> None:
    model = shapes.tiny(shapes.get("qwen3_next"))
    bufs: list[np.ndarray] = []

    def alloc(n: int) -> int:
        bufs.append(np.random.default_rng(len(bufs)).integers(0, 256, n, dtype=np.uint8))
        return int(bufs[-1].ctypes.data)

    src = shapes.layout_for(model, tp_rank=0, tp_size=2, page_size=4, num_pages=16,
                            num_slots=4, alloc=alloc)
    n_src = len(bufs)
    dst = shapes.layout_for(model, tp_rank=0, tp_size=1, page_size=4, num_pages=16,
                            num_slots=4, alloc=alloc)
    p = plan(src, dst, shapes.request_for(model, src, dst, 19, seed=2))
    execute(p, HostMemory(bufs[:n_src]), HostMemory(bufs[n_src:]))
    sent = plan_digests(p, "src", TensorViews(src))
    got = plan_digests(p, "dst", TensorViews(dst))
    assert sent == got and set(sent) == {"kv", "mamba", "aux"}
    e = next(e for e in p.entries if e.component == "mamba")
    bufs[n_src:][[int(b.ctypes.data) for b in bufs[n_src:]].index(e.dst_ptr)][
        int(e.dst_idx[0]) * e.dst_unit + int(e.pieces[0, 1])] ^= 1
    bad = plan_digests(p, "dst", TensorViews(dst))
    assert bad["mamba"] != sent["mamba"] and bad["kv"] == sent["kv"]


def test_route_dp_is_stable() -> None:
    assert route_dp(7, 4) == 3
    assert route_dp("abc", 3) == route_dp("abc", 3)
    assert {route_dp(f"r{i}", 4) for i in range(64)} == {0, 1, 2, 3}


@pytest.mark.parametrize(("tp", "td", "pp", "pd"),
                         [(a, b, c, d) for a, b in itertools.product([1, 2, 4, 8], repeat=2)
                          for c, d in [(1, 1), (2, 1), (2, 2)]])
def test_decode_candidates_mirror_bootstrap_peers(tp: int, td: int, pp: int, pd: int) -> None:
    for p, s in itertools.product(range(tp), range(pp)):
        mine = set(decode_candidates(src_tp_rank=p, src_tp_size=tp, src_pp_rank=s,
                                     src_pp_size=pp, dst_tp_size=td, dst_pp_size=pd))
        ref = {(d, e) for d in range(td) for e in range(pd)
               if (0, p, s) in bootstrap_peers(src_tp_size=tp, src_pp_size=pp, dst_tp_rank=d,
                                               dst_tp_size=td, dst_pp_rank=e, dst_pp_size=pd)}
        assert mine == ref and mine
