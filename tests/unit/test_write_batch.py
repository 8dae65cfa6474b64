"""Prefill's batched writes (:mod:`kvhandoff.session.control.write_batch`) and the plan merge
behind them (:mod:`kvhandoff.plan.merge`): no socket, no thread, no clock.

A fake transport records each submit; the batcher's ``track`` is a list the test reads,
so a test decides when (and how) each batch's write ends."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvhandoff.lab import shapes
from kvhandoff.plan import Plan, TensorPlan, plan
from kvhandoff.plan import merge as merge_module
from kvhandoff.plan.merge import merge
from kvhandoff.plan.model import part_entries
from kvhandoff.protocol import Outcome, RankId, TransferStatus, decode_notice
from kvhandoff.session.control.completion import Callback
from kvhandoff.session.control.write_batch import BatchedWrite, Fanout, WriteBatcher, fit, groups
from kvhandoff.session.peers.decode_ranks import DecodePeer
from kvhandoff.session.rank.notices import in_band_all
from kvhandoff.transport.base import MAX_NOTICE, Capabilities, Handle
from kvhandoff.transport.errors import PeerLost, TransportClosed, TransportError

ME = RankId(instance="prefill")
LAYOUT = shapes.layout_for(shapes.tiny(shapes.get("llama")), tp_rank=0, tp_size=1,
                           page_size=4, num_pages=8, num_slots=2, alloc=lambda n: 0)
PIECE = np.array([[0, 0, 64, 1, 64, 64]], dtype=np.int64)


def entry(tensor: str, src: list[int], dst: list[int], *, pieces: np.ndarray = PIECE,
          layer: int = 0) -> TensorPlan:
    return TensorPlan(component="kv", tensor=tensor, layer_id=layer, src_ptr=1 << 20,
                      dst_ptr=1 << 30, src_unit=64, dst_unit=64,
                      src_idx=np.array(src, dtype=np.int64),
                      dst_idx=np.array(dst, dtype=np.int64), pieces=pieces)


def moved(p: Plan) -> list[tuple[int, int, int]]:
    seg = p.flatten()
    return sorted(zip(seg.src.tolist(), seg.dst.tolist(), seg.length.tolist(), strict=True))


def status(rid: int, chunk: int = 0, *, last: bool = True, nbytes: int = 64,
           reason_len: int = 0) -> TransferStatus:
    checksums = {f"c{i}": i for i in range(reason_len)} or None
    return TransferStatus(request_id=rid, rank=ME, chunk=chunk, last=last,
                          outcome=Outcome.SUCCESS, nbytes=nbytes, checksums=checksums)


# --- merge ------------------------------------------------------------------------------


def test_merge_moves_exactly_the_bytes_of_the_plans_with_one_entry_per_tensor_pair() -> None:
    a = Plan(entries=(entry("k", [1], [5]), entry("v", [1], [5])))
    b = Plan(entries=(entry("k", [2, 3], [6, 7]), entry("v", [2, 3], [6, 7])))
    c = Plan(entries=(entry("k", [4], [0], pieces=np.array([[0, 0, 32, 1, 32, 32]])),))
    m = merge([a, b, c])
    assert moved(m) == sorted(moved(a) + moved(b) + moved(c))
    assert [(e.tensor, e.src_idx.tolist(), e.dst_idx.tolist()) for e in m.entries] == [
        ("k", [1, 2, 3], [5, 6, 7]), ("v", [1, 2, 3], [5, 6, 7]), ("k", [4], [0])]
    assert m.nbytes == a.nbytes + b.nbytes + c.nbytes
    assert a.entries[0].src_idx.tolist() == [1]  # the inputs are unchanged


def entries_of(p: Plan) -> list[tuple[object, ...]]:
    return [(e.tensor, e.layer_id, e.pieces.tolist(), e.src_idx.tolist(), e.dst_idx.tolist())
            for e in p.entries]


def test_merge_of_plans_alike_entry_by_entry_matches_the_general_grouping() -> None:
    """The aligned path (every plan the same entries in the same order) gives what the
    general grouping gives: same entries, same order, same bytes; one index array shared
    by several entries is concatenated once and shared again."""
    plans = []
    for i in range(5):
        idx = np.array([i, 10 + i], dtype=np.int64)  # shared by k and v, as the planner does
        plans.append(Plan(entries=(
            TensorPlan(component="kv", tensor="k", layer_id=0, src_ptr=1 << 20,
                       dst_ptr=1 << 30, src_unit=64, dst_unit=64, src_idx=idx, dst_idx=idx,
                       pieces=PIECE),
            TensorPlan(component="kv", tensor="v", layer_id=0, src_ptr=1 << 21,
                       dst_ptr=1 << 31, src_unit=64, dst_unit=64, src_idx=idx, dst_idx=idx,
                       pieces=PIECE),
            entry("s", [i] if i != 3 else [], [i] if i != 3 else []))))  # 3 moves no state
    fast = merge(plans)
    general = Plan(entries=tuple(merge_module._grouped(plans, {})))
    assert merge_module._aligned(plans, {}) is not None
    assert entries_of(fast) == entries_of(general)
    assert moved(fast) == sorted(x for p in plans for x in moved(p))
    assert fast.entries[0].src_idx is fast.entries[1].src_idx  # concatenated once
    assert fast.nbytes == sum(p.nbytes for p in plans)


def test_merge_falls_back_to_grouping_when_plans_are_not_alike_entry_by_entry() -> None:
    a = Plan(entries=(entry("k", [1], [5]), entry("v", [1], [5])))
    b = Plan(entries=(entry("v", [2], [6]), entry("k", [2], [6])))  # the other order
    c = Plan(entries=(entry("k", [], []), entry("v", [3], [7])))  # first plan moves nothing
    twice = Plan(entries=(entry("k", [1], [5]), entry("k", [2], [6])))  # one pair twice
    for plans in ([a, b], [c, a], [twice, twice]):
        assert merge_module._aligned(plans, {}) is None
        assert moved(merge(plans)) == sorted(x for p in plans for x in moved(p))
    assert entries_of(merge([a, b])) == [("k", 0, PIECE.tolist(), [1, 2], [5, 6]),
                                         ("v", 0, PIECE.tolist(), [1, 2], [5, 6])]


HYBRID = shapes.tiny(shapes.get("qwen3_next"))


def hybrid_plans(n: int, *, state_from: int = 0, no_kv: tuple[int, ...] = ()) -> list[Plan]:
    """The planner's plans of ``n`` like requests of a hybrid model (KV pages, a Mamba
    slot, an aux row), each in its own pages and slot; those before ``state_from`` move
    no state, those in ``no_kv`` no KV page (empty lists)."""
    lay = shapes.layout_for(HYBRID, tp_rank=0, tp_size=1, page_size=4, num_pages=64,
                            num_slots=16, alloc=lambda n: 1 << 20)
    out = []
    for i in range(n):
        req = shapes.request_for(HYBRID, lay, lay, 6, contiguous=True, src_slot=i + 1,
                                 dst_slot=n - i)
        req["kv"] = type(req["kv"])(req["kv"].src + 2 * i, req["kv"].dst + 4 * i)
        if i in no_kv:  # the component is named but moves nothing
            req["kv"] = type(req["kv"])(np.zeros(0, np.int64), np.zeros(0, np.int64))
        if i < state_from:
            req = {k: (None if k not in ("kv", "aux") else v) for k, v in req.items()}
        out.append(plan(lay, lay, req))
    return out


def test_merge_of_the_planners_like_plans_joins_their_parts() -> None:
    """Plans of like requests are made of the planner's same unit tables: merged group by
    group without comparing fields, they give what the general grouping gives, each
    component's index arrays concatenated once and shared by its tensors, and the
    merged plan's entries are made only when read."""
    plans = hybrid_plans(6)
    assert all(p._parts is not None and "entries" not in vars(p) for p in plans)
    parts = merge_module._by_parts(plans, {})
    assert parts is not None
    general = merge_module._grouped(plans, {})
    assert entries_of(Plan(entries=tuple(part_entries(parts)))) == entries_of(
        Plan(entries=tuple(general)))
    m = merge(plans)
    assert "entries" not in vars(m) and m.nbytes == sum(p.nbytes for p in plans)
    assert moved(m) == sorted(x for p in plans for x in moved(p))
    assert m.nbytes == sum(e.nbytes for e in m.entries)  # the same count, entry by entry
    by_comp: dict[str, set[int]] = {}
    for e in m.entries:
        by_comp.setdefault(e.component, set()).add(id(e.src_idx))
    assert len(by_comp) > 2 and all(len(ids) == 1 for ids in by_comp.values())


def test_merge_by_parts_joins_plans_whose_component_moves_nothing_in_some() -> None:
    """A group empty in one plan and not in another: the same tables, so the parts are
    joined, and the empty group adds nothing; the general grouping agrees."""
    plans = hybrid_plans(4, no_kv=(0, 2))
    assert not any(e.component == "kv" for e in plans[0].entries)
    parts = merge_module._by_parts(plans, {})
    assert parts is not None
    general = merge_module._grouped(plans, {})
    assert sorted(entries_of(Plan(entries=tuple(part_entries(parts))))) == sorted(
        entries_of(Plan(entries=tuple(general))))
    m = merge(plans)
    assert moved(m) == sorted(x for p in plans for x in moved(p))
    assert m.nbytes == sum(p.nbytes for p in plans) == sum(e.nbytes for e in m.entries)


def test_merge_takes_the_parts_only_when_every_plan_has_the_same_tables() -> None:
    """A plan that moves fewer components, or one that is not the planner's (a replaced
    copy drops the parts): the field-by-field paths decide, and the bytes are the same."""
    like = hybrid_plans(3)
    fewer = hybrid_plans(3, state_from=2)  # the first two move only KV and aux
    copied = dataclasses.replace(like[1])
    assert copied._parts is None and copied == like[1]
    for plans in ([*like, fewer[0]], [like[0], copied, like[2]]):
        assert merge_module._by_parts(plans, {}) is None
        assert moved(merge(plans)) == sorted(x for p in plans for x in moved(p))


def test_merge_of_one_plan_is_that_plan_and_of_none_or_two_rank_pairs_an_error() -> None:
    a = Plan(entries=(entry("k", [1], [5]),))
    assert merge([a]) is a
    with pytest.raises(ValueError, match="at least one"):
        merge([])
    with pytest.raises(ValueError, match="one pair of ranks"):
        merge([a, Plan(entries=a.entries, dst_tp_rank=1)])


# --- grouping and notices (pure) ---------------------------------------------------------


@dataclass
class Ends:
    """What each write's request was told: ``written`` and ``refused`` calls, in order."""

    calls: list[tuple[Any, ...]] = field(default_factory=list)
    decline: int = 0  # decline this many non-blocking calls

    def written(self, rid: int) -> Any:
        def call(handle: Handle, in_band: bool, error: TransportError | None,
                 timed_out: bool, blocking: bool, shared: int) -> bool:
            assert isinstance(handle, Handle)
            if not blocking and self.decline:
                self.decline -= 1
                return False
            self.calls.append(("written", rid, in_band, error, timed_out, shared))
            return True
        return call

    def refused(self, rid: int) -> Any:
        def call(why: str, shared: int) -> None:
            self.calls.append(("refused", rid, why, shared))
        return call


def peer(name: str, *, notices: bool = True) -> DecodePeer:
    return DecodePeer(endpoint=f"tcp://{name}", rank=RankId(instance="decode"), layout=LAYOUT,
                      transport_peer=name, writes=True, notices=notices)  # type: ignore[arg-type]


def write(p: DecodePeer, rid: int, ends: Ends, *, chunk: int = 0, units: int = 1,
          reason_len: int = 0) -> BatchedWrite:
    plan = Plan(entries=(entry("k", list(range(units)), list(range(units))),))
    return BatchedWrite(p, plan, status(rid, chunk, reason_len=reason_len),
                        ends.written(rid), ends.refused(rid))


def test_groups_are_per_decode_rank_in_order_bounded_in_bytes_and_one_chunk_per_request(
        ) -> None:
    a, b, ends = peer("a"), peer("b"), Ends()
    ws = [write(a, 1, ends), write(b, 2, ends), write(a, 3, ends), write(a, 4, ends, units=4),
          write(a, 5, ends), write(a, 5, ends, chunk=1), write(b, 6, ends)]
    got = [[(w.peer.endpoint, w.status.request_id, w.status.chunk) for w in g]
           for g in groups(ws, max_bytes=4 * 64)]
    assert got == [
        [("tcp://a", 1, 0), ("tcp://a", 3, 0), ("tcp://a", 5, 0)],
        [("tcp://a", 4, 0)],  # its 4 units do not fit with the first batch
        [("tcp://a", 5, 1)],  # request 5's second chunk: a batch after its first, with room
        [("tcp://b", 2, 0), ("tcp://b", 6, 0)],
    ]
    chunks = [write(a, r, ends, chunk=c) for r in (1, 2) for c in range(3)]
    assert [[(w.status.request_id, w.status.chunk) for w in g] for g in groups(chunks)] == [
        [(1, 0), (2, 0)], [(1, 1), (2, 1)], [(1, 2), (2, 2)]]


def test_a_batch_whose_notice_is_too_big_is_halved_until_each_part_fits() -> None:
    a, ends = peer("a"), Ends()
    ws = [write(a, i, ends) for i in range(5)]
    # a notice holds at most 2 statuses here; a lone status that does not fit gets None
    got = fit(ws, lambda sts: b"n" if len(sts) <= 2 else None)
    assert [([w.status.request_id for w in part], data) for part, data in got] == [
        ([0, 1], b"n"), ([2], b"n"), ([3, 4], b"n")]
    assert fit(ws[:1], lambda sts: None) == [(ws[:1], None)]


def test_one_notice_carries_every_status_of_a_batch_in_order() -> None:
    t = FakeTransport()
    sts = [status(1), status(2, chunk=3), status(9)]
    data = in_band_all(sts, to="tcp://d", sender="tcp://p", transport=t,  # type: ignore[arg-type]
                       accepted=True)
    assert data is not None
    n = decode_notice(data)
    assert n.statuses == tuple(sts) and (n.to, n.sender) == ("tcp://d", "tcp://p")
    one = in_band_all(sts[:1], to="tcp://d", sender="tcp://p", transport=t,  # type: ignore[arg-type]
                      accepted=True)
    assert one is not None and b"more" not in one  # a single status: the bytes of old
    assert in_band_all(sts, to="d", sender="p", transport=t,  # type: ignore[arg-type]
                       accepted=False) is None
    big = [status(i, reason_len=MAX_NOTICE // 8) for i in range(2)]
    assert in_band_all(big, to="d", sender="p", transport=t,  # type: ignore[arg-type]
                       accepted=True) is None


def test_a_fanout_tells_each_request_once_and_asks_a_declining_one_again() -> None:
    a, ends = peer("a"), Ends(decline=1)
    ws = [write(a, 1, ends), write(a, 2, ends), write(a, 3, ends)]
    fan: Callback = Fanout(ws, in_band=True)
    err = PeerLost("gone")
    h = Handle.completed()
    assert fan(h, err, False, False) is False  # request 1 declined (its lock was busy)
    assert [c[1] for c in ends.calls] == [2, 3]
    assert fan(h, err, False, True) is True
    assert ends.calls == [("written", r, True, err, False, 2) for r in (2, 3, 1)]


# --- the batcher, with a fake transport ---------------------------------------------------


class FakeTransport:
    capabilities = Capabilities(notices=True)

    def __init__(self) -> None:
        self.submits: list[tuple[Any, Plan, bytes | None]] = []
        self.refuse: Exception | None = None

    def submit(self, peer: Any, plan: Plan, *, notice: bytes | None = None) -> Handle:
        if self.refuse is not None:
            raise self.refuse
        self.submits.append((peer, plan, notice))
        return Handle.completed(nbytes=plan.nbytes)


class Rig:
    def __init__(self) -> None:
        self.transport = FakeTransport()
        self.tracked: list[tuple[Handle, Callback]] = []
        self.io = True  # "the caller is the control I/O thread"
        self.batcher = WriteBatcher(
            transport=self.transport, track=lambda h, cb: self.tracked.append((h, cb)),  # type: ignore[arg-type]
            notice=lambda p, sts: in_band_all(sts, to=p.endpoint, sender="tcp://p",
                                              transport=self.transport,  # type: ignore[arg-type]
                                              accepted=p.notices),
            on_io_thread=lambda: self.io)


def test_a_burst_goes_out_as_one_submit_per_decode_rank_with_one_notice() -> None:
    rig, ends = Rig(), Ends()
    a, b = peer("a"), peer("b", notices=False)
    for w in (write(a, 1, ends), write(b, 2, ends), write(a, 3, ends, units=2)):
        assert rig.batcher.defer(w)
    assert rig.transport.submits == []  # nothing before the end of the burst
    rig.batcher.flush()
    (pa, plan_a, notice_a), (pb, _, notice_b) = rig.transport.submits
    assert (pa, pb) == ("a", "b") and notice_b is None  # b takes no notices
    assert plan_a.nbytes == 3 * 64 and len(plan_a.entries) == 1  # merged
    assert notice_a is not None
    assert [s.request_id for s in decode_notice(notice_a).statuses] == [1, 3]
    for h, cb in rig.tracked:
        assert cb(h, None, False, False)
    assert sorted(ends.calls) == [("written", 1, True, None, False, 1),
                                  ("written", 2, False, None, False, 0),
                                  ("written", 3, True, None, False, 1)]
    rig.batcher.flush()
    assert len(rig.transport.submits) == 2  # flushed once


def test_a_burst_of_one_is_the_write_itself() -> None:
    rig, ends = Rig(), Ends()
    w = write(peer("a"), 1, ends)
    assert rig.batcher.defer(w)
    rig.batcher.flush()
    ((_, plan, notice),) = rig.transport.submits
    assert plan is w.plan and notice is not None and decode_notice(notice).statuses == (
        w.status,)


def test_off_the_io_thread_writes_are_not_deferred_unless_held() -> None:
    rig, ends = Rig(), Ends()
    rig.io = False
    a = peer("a")
    assert not rig.batcher.defer(write(a, 1, ends))
    with rig.batcher.held():
        with rig.batcher.held():  # nested: the outermost exit submits
            assert rig.batcher.defer(write(a, 2, ends))
        assert rig.batcher.defer(write(a, 3, ends))
        assert rig.transport.submits == []
    ((_, plan, _),) = rig.transport.submits
    assert plan.nbytes == 2 * 64
    assert not rig.batcher.defer(write(a, 4, ends))  # outside again


def test_held_writes_wait_for_their_threads_exit_whatever_the_io_thread_flushes() -> None:
    rig, ends = Rig(), Ends()
    a = peer("a")
    io_deferred: list[bool] = []

    def io_burst() -> None:  # the I/O thread: defers 3, then ends its burst
        io_deferred.append(rig.batcher.defer(write(a, 3, ends)))
        rig.batcher.flush()  # its own write only

    with rig.batcher.held():  # this thread holds 1 and 2
        assert rig.batcher.defer(write(a, 1, ends))
        io = threading.Thread(target=io_burst)
        io.start()
        io.join()
        assert io_deferred == [True]
        assert rig.batcher.defer(write(a, 2, ends))
        assert [[s.request_id for s in decode_notice(n).statuses]  # type: ignore[arg-type]
                for _, _, n in rig.transport.submits] == [[3]]
    assert [[s.request_id for s in decode_notice(n).statuses]  # type: ignore[arg-type]
            for _, _, n in rig.transport.submits] == [[3], [1, 2]]


def test_close_refuses_the_writes_a_thread_still_holds() -> None:
    rig, ends = Rig(), Ends()
    with rig.batcher.held():
        assert rig.batcher.defer(write(peer("a"), 1, ends))
        rig.batcher.close()
        assert ends.calls == [("refused", 1, "the agent closed before the write was "
                               "submitted", 0)]
        assert not rig.batcher.defer(write(peer("a"), 2, ends))
    assert rig.transport.submits == []


def test_a_refused_batch_refuses_exactly_its_writes_naming_why() -> None:
    rig, ends = Rig(), Ends()
    a, b = peer("a"), peer("b")
    for w in (write(a, 1, ends), write(a, 2, ends)):
        rig.batcher.defer(w)
    rig.transport.refuse = TransportClosed("peer a closed by its owner")
    rig.batcher.flush()
    assert ends.calls == [("refused", 1, "peer a closed by its owner", 1),
                          ("refused", 2, "peer a closed by its owner", 1)]
    rig.transport.refuse = None
    rig.batcher.defer(write(b, 3, ends))
    rig.batcher.flush()
    assert [p for p, _, _ in rig.transport.submits] == ["b"]


def test_closing_refuses_what_waits_and_batches_no_more() -> None:
    rig, ends = Rig(), Ends()
    rig.batcher.defer(write(peer("a"), 1, ends))
    rig.batcher.close()
    assert ends.calls == [("refused", 1, "the agent closed before the write was submitted", 0)]
    assert not rig.batcher.defer(write(peer("a"), 2, ends))
    rig.batcher.flush()
    assert rig.transport.submits == []
