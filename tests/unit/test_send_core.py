"""The prefill request core, driven event by event: no socket, no thread, no clock.

A tiny stand-in shell answers the core's questions at once (``PlanChunk`` → ``planned``,
``Write`` → ``submitted``) and keeps every effect; writes end only when a test says so."""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvhandoff.session
from kvhandoff.errors import RemoteOutOfBounds
from kvhandoff.lab import shapes
from kvhandoff.layout import Layout
from kvhandoff.observe import timeline as tl
from kvhandoff.protocol import AbortAck, IndexListMsg, Outcome, RankId, TransferInit, TransferStatus
from kvhandoff.session import SessionConfig, Status
from kvhandoff.session.errors import (
    AgentClosed,
    LeaseExpired,
    PeerLost,
    RequestAborted,
    RequestTimeout,
    TransferFailed,
)
from kvhandoff.session.request.core import Fail, Fire, Mark, Post
from kvhandoff.session.request.send_core import (
    PlanChunk,
    SendCore,
    Settle,
    StampGuard,
    Write,
    WriteFailed,
    failed_answer,
)
from kvhandoff.session.request.status import Event, StateMachine
from kvhandoff.transport.errors import TransportError

PAGE = 4
LAYOUT = shapes.layout_for(shapes.tiny(shapes.get("qwen3_next")), tp_rank=0, tp_size=1,
                           page_size=PAGE, num_pages=16, num_slots=2, alloc=lambda n: 0)
ME = RankId(instance="prefill", tp_rank=0, tp_size=1)


@dataclass(frozen=True)
class Facts:
    layout: Layout = LAYOUT
    rank_id: RankId = ME
    config: SessionConfig = field(default_factory=lambda: SessionConfig(indices_timeout=5.0))
    kv_name: str | None = "kv"
    aux_name: str | None = "aux"
    kv_repageable: bool = True


def decode(tp_rank: int = 0, tp_size: int = 1, instance: str = "decode") -> RankId:
    return RankId(instance=instance, tp_rank=tp_rank, tp_size=tp_size)


def ep(tp_rank: int = 0) -> str:
    return f"tcp://decode-{tp_rank}"


def init_msg(rank: RankId, pages: int = 2, *, prefix: int = 0,
             checksum: bool = False) -> TransferInit:
    return TransferInit(request_id=7, rank=rank, decode_prefix_len=prefix,
                        expect_checksum=checksum, indices={
                            "kv": IndexListMsg.of(list(range(10, 10 + pages))),
                            "mamba": IndexListMsg.of([1]), "aux": IndexListMsg.of([3])})


@dataclass
class Chunk:
    pages: np.ndarray


class Shell:
    """Answers PlanChunk and Write at once; keeps every effect and every open write."""

    def __init__(self, core: SendCore, *, nbytes: int = 64) -> None:
        self.core = core
        self.nbytes = nbytes
        self.seen: list[object] = []
        self.open: list[Write] = []  # submitted, not yet ended
        self.refuse: str | None = None  # "plan" / "submit": the next one fails
        self.chunks: list[Chunk] = []  # what the engine handed over
        self.sm = StateMachine(name="mirror")  # the shell's machine, fed by the effects

    def do(self, effects: Iterable[object]) -> list[object]:
        start = len(self.seen)
        todo = deque(effects)
        while todo:
            e = todo.popleft()
            self.seen.append(e)
            more: list[object] = []
            if isinstance(e, PlanChunk) and self.refuse == "plan":
                self.refuse, more = None, self.core.plan_failed("injected")
            elif isinstance(e, PlanChunk):
                more = self.core.planned(self.nbytes, None, None, ("plan", e.chunk))
            elif isinstance(e, Write) and self.refuse == "submit":
                self.refuse, more = None, self.core.submit_refused("injected")
            elif isinstance(e, Write):
                self.open.append(e)
                more = self.core.submitted()
            elif isinstance(e, Fire):
                self.sm.fire(e.event)
            elif isinstance(e, Fail):
                assert self.sm.fail(str(e.error), event=e.event)
            todo.extendleft(reversed(more))
        assert self.sm.state is self.core.status
        return self.seen[start:]

    def end(self, write: Write, error: Exception | None = None, *, in_band: bool = False,
            timed_out: bool = False) -> list[object]:
        self.open.remove(write)
        return self.do(self.core.written(write.endpoint, write.status, in_band, error,
                                         timed_out))


def new(**facts: object) -> tuple[SendCore, Shell]:
    core = SendCore(request_id=7, facts=Facts(**facts), created=100.0)  # type: ignore[arg-type]
    return core, Shell(core)


def posts(effects: Iterable[object], kind: type | None = None) -> list[Post]:
    return [e for e in effects if isinstance(e, Post) and (kind is None or isinstance(e.msg, kind))]


def statuses(effects: Iterable[object]) -> list[TransferStatus]:
    return [p.msg for p in posts(effects, TransferStatus)]  # type: ignore[misc]


def ready(pages: int = 2, ranks: int = 1, *, dst_pages: int | None = None, prefix: int = 0,
          checksum: bool = False) -> tuple[SendCore, Shell]:
    """A core with ``ranks`` decode ranks' indices in and ``init(pages)`` called."""
    core, sh = new()
    for r in range(ranks):
        msg = init_msg(decode(r, ranks), pages if dst_pages is None else dst_pages,
                       prefix=prefix, checksum=checksum)
        sh.do(core.indices(ep(r), decode(r, ranks), LAYOUT, msg))
    sh.do(core.init(pages, 5, None))
    return core, sh


LAST_STATE = {"mamba": (np.array([0]), 0)}
NOW = 100.0  # when a test's chunks are handed over: the core's creation time


def send(core: SendCore, sh: Shell, pages: list[int], last: bool = False) -> list[object]:
    return sh.do(core.send(np.array(pages, dtype=np.int64), LAST_STATE if last else None, last,
                           now=NOW))


# --- the happy paths -------------------------------------------------------------------


def test_a_request_bootstraps_sends_and_settles() -> None:
    core, sh = ready()
    assert core.status is Status.WAITING_FOR_INPUT and core.decode_prefix_len == 0
    out = send(core, sh, [0, 1], last=True)
    assert isinstance(out[0], StampGuard) and out[0].row == 5
    plan = next(e for e in out if isinstance(e, PlanChunk))
    assert plan.endpoint == ep(0) and plan.chunk == 0 and set(plan.request) == {
        "kv", "mamba", "aux"}
    (write,) = sh.open
    assert write.payload == ("plan", 0) and write.status.last and write.status.nbytes == 64
    assert core.peer_endpoints() == {ep(0)} and not core.settled
    out = sh.end(write)
    (st_,) = statuses(out)
    assert st_.outcome is Outcome.SUCCESS and st_.last and st_.chunk == 0
    assert [e for e in out if isinstance(e, Fire | Mark | Settle)] == [
        Fire(Event.CHUNK_DONE), Mark(tl.MOVED), Mark(tl.WRITTEN), Fire(Event.ALL_DONE),
        Mark(tl.SETTLED), Settle()]
    assert core.status is Status.SUCCESS and core.settled and core.nbytes == 64
    assert not posts(out, AbortAck) and core.peer_endpoints() == set()


def test_chunks_before_the_indices_queue_and_go_out_in_order() -> None:
    core, sh = new()
    sh.do(core.init(2, 5, None))
    assert send(core, sh, [0]) == []  # queued: no decode rank yet
    send(core, sh, [1], last=True)
    out = sh.do(core.indices(ep(), decode(), LAYOUT, init_msg(decode())))
    assert out[0] == Fire(Event.BOOTSTRAPPED)
    assert [e.chunk for e in out if isinstance(e, PlanChunk)] == [0, 1]


def test_the_last_status_waits_for_every_earlier_chunk() -> None:
    core, sh = ready(pages=2)
    send(core, sh, [0])
    send(core, sh, [1], last=True)
    first, last = sh.open
    assert statuses(sh.end(last)) == []  # held: chunk 0 is still in flight
    out = sh.end(first)
    assert [(s.chunk, s.last) for s in statuses(out)] == [(0, False), (1, True)]
    assert core.status is Status.SUCCESS


def test_statuses_that_travel_in_band_are_not_posted_again() -> None:
    core, sh = ready(pages=2)
    send(core, sh, [0])
    send(core, sh, [1], last=True)
    for w in list(sh.open):
        assert statuses(sh.end(w, in_band=True)) == []
    assert core.status is Status.SUCCESS


def test_an_empty_plan_counts_as_written_at_once() -> None:
    core, sh = ready(pages=0)
    sh.nbytes = 0
    out = send(core, sh, [], last=True)
    assert not any(isinstance(e, Write) for e in out)
    assert statuses(out)[0].last and core.status is Status.SUCCESS and core.settled


def test_each_decode_rank_gets_each_chunk_in_order() -> None:
    core, sh = ready(pages=2, ranks=2)
    send(core, sh, [0, 1], last=True)
    assert [w.endpoint for w in sh.open] == [ep(0), ep(1)]
    sh.end(sh.open[0])
    assert core.status is Status.TRANSFERRING  # one rank still to go
    sh.end(sh.open[0])
    assert core.status is Status.SUCCESS


def test_prefix_pages_are_dropped_here() -> None:
    core, sh = ready(pages=2, dst_pages=1, prefix=PAGE)  # decode holds page 0 already
    out = send(core, sh, [0, 1], last=True)  # the engine hands pages from token 0
    (plan,) = [e for e in out if isinstance(e, PlanChunk)]
    kv = plan.request["kv"]
    assert kv is not None and list(kv.src) == [1] and list(kv.dst) == [10]


# --- failures: in every state, first one wins -------------------------------------------


def test_an_abort_while_bootstrapping_tells_nobody() -> None:
    core, sh = new()
    out = sh.do(core.abort("test"))
    assert isinstance(out[0], Fail) and isinstance(out[0].error, RequestAborted)
    assert out[0].event is Event.ABORT and posts(out) == [] and out[-1] == Settle()
    assert core.status is Status.FAILED and core.settled


def test_an_abort_while_waiting_tells_and_releases_every_decode_rank() -> None:
    core, sh = ready(ranks=2)
    out = sh.do(core.abort("test"))
    failed = statuses(out)
    assert [s.outcome for s in failed] == [Outcome.FAILED] * 2 and failed[0].chunk == 0
    assert [p.endpoint for p in posts(out, AbortAck)] == [ep(0), ep(1)]
    assert core.settled and sh.do(core.abort("again")) == []


def test_an_abort_with_a_write_in_flight_acks_only_once_it_ended() -> None:
    core, sh = ready()
    send(core, sh, [0, 1], last=True)
    out = sh.do(core.abort("test"))
    assert statuses(out)[0].outcome is Outcome.FAILED and not posts(out, AbortAck)
    assert not core.settled and core.peer_endpoints() == {ep()}
    out = sh.end(sh.open[0])  # it completed after all: no success status goes out
    assert statuses(out) == [] and [p.endpoint for p in posts(out, AbortAck)] == [ep()]
    assert core.status is Status.FAILED and core.settled


def _in_state(state: Status) -> tuple[SendCore, Shell]:
    """A core in ``state``, with a write in flight when TRANSFERRING."""
    if state is Status.BOOTSTRAPPING:
        return new()
    core, sh = ready(pages=2)
    if state is not Status.WAITING_FOR_INPUT:
        send(core, sh, [0])
        send(core, sh, [1], last=True)
        sh.end(sh.open[0])
    if state is Status.SUCCESS:
        sh.end(sh.open[0])
    elif state is Status.FAILED:
        sh.do(core.abort("first"))
    assert core.status is state
    return core, sh


@pytest.mark.parametrize("state", list(Status))
def test_an_abort_in_every_state(state: Status) -> None:
    core, sh = _in_state(state)
    error = core.error
    out = sh.do(core.abort("test"))
    if state in (Status.SUCCESS, Status.FAILED):  # final: nothing changes
        assert out == [] and core.status is state and core.error is error
        return
    assert isinstance(core.error, RequestAborted) and core.status is Status.FAILED
    told = {p.endpoint for p in posts(out, TransferStatus)}
    assert told == set(core.targets)  # every decode rank hears FAILED, once
    assert all(s.outcome is Outcome.FAILED for s in statuses(out))
    # the ack waits for the write in flight (TRANSFERRING); else it goes at once
    assert core.settled is (state is not Status.TRANSFERRING)
    assert bool(posts(out, AbortAck)) is (core.settled and bool(core.targets))
    if sh.open:
        out = sh.end(sh.open[0])
        assert statuses(out) == [] and core.settled and posts(out, AbortAck)


def test_a_write_that_timed_out_is_never_acked() -> None:
    core, sh = ready()
    send(core, sh, [0, 1], last=True)
    out = sh.end(sh.open[0], TransportError("cancelled"), timed_out=True)
    assert isinstance(core.error, TransferFailed) and not posts(out, AbortAck)
    assert core.settled and core.unsafe_endpoints() == {ep()}
    assert sh.do(core.decode_aborted(ep(), "d", "late")) == []  # still no ack


def test_a_success_stays_a_success() -> None:
    core, sh = ready()
    send(core, sh, [0, 1], last=True)
    sh.end(sh.open[0])
    for effects in (core.abort("late"), core.peer_lost(ep(), "gone"), core.agent_closed(),
                    core.tick(1e9)):
        assert sh.do(effects) == []
    assert core.status is Status.SUCCESS and core.error is None


def test_a_failed_write_fails_the_request_and_watches_the_rank() -> None:
    core, sh = ready()
    send(core, sh, [0, 1], last=True)
    out = sh.end(sh.open[0], PeerLost("connection reset"))
    assert out[0] == WriteFailed(ep()) and isinstance(core.error, PeerLost)
    assert "chunk 0 to decode" in str(core.error)
    core, sh = ready()
    send(core, sh, [0, 1], last=True)
    sh.end(sh.open[0], RemoteOutOfBounds("refused"))
    assert core.events["refused_write"] == 1 and isinstance(core.error, TransferFailed)


def test_a_planning_error_stops_the_other_ranks() -> None:
    core, sh = ready(ranks=2)
    out = core.send(np.array([0, 1]), LAST_STATE, True, now=NOW)
    plan = next(e for e in out if isinstance(e, PlanChunk))
    out = sh.do(core.plan_failed("bad layout"))
    assert not any(isinstance(e, PlanChunk) for e in out)
    assert str(core.error).endswith(f"chunk {plan.chunk} for decode {decode(0, 2)}: bad layout")
    assert core.settled


def test_a_refused_submit_fails_and_settles() -> None:
    core, sh = ready(ranks=2)
    out = core.send(np.array([0, 1]), LAST_STATE, True, now=NOW)
    out = core.planned(64, None, None, "p")
    assert isinstance(out[-1], Write)
    out = sh.do(core.submit_refused("no route"))
    assert "submit refused: no route" in str(core.error) and core.settled
    assert [p.endpoint for p in posts(out, AbortAck)] == [ep(0), ep(1)]


def test_a_batched_write_refused_after_submitted_fails_and_settles() -> None:
    """The shell answered ``submitted`` (the write waited in a batch), then the batch's
    submit was refused: as a refused submit, naming the batch."""
    core, sh = ready(ranks=2)
    send(core, sh, [0, 1], last=True)
    first, second = sh.open
    assert not core.settled
    out = sh.do(core.refused(first.endpoint, first.status, "peer closed", shared=3))
    assert core.status is Status.FAILED and not core.settled  # the other write is in flight
    assert "submit refused: peer closed" in str(core.error)
    assert "with 3 other chunk(s)" in str(core.error)
    assert not posts(out, AbortAck)
    out = sh.end(second)
    assert core.settled and [p.endpoint for p in posts(out, AbortAck)] == [ep(0), ep(1)]


def test_a_failed_batched_write_names_the_batch() -> None:
    core, sh = ready()
    send(core, sh, [0, 1], last=True)
    (w,) = sh.open
    sh.open.remove(w)
    sh.do(core.written(w.endpoint, w.status, False, TransportError("reset"), False, 5))
    assert isinstance(core.error, TransferFailed) and core.settled
    assert "failed: reset (one batched write with 5 other chunk(s)" in str(core.error)


def test_a_chunk_past_the_announced_pages_fails() -> None:
    core, sh = ready(pages=2)
    send(core, sh, [0, 1, 2])
    assert "more than the 2 Sender.init announced" in str(core.error)


def test_late_indices_are_answered_failed_and_acked() -> None:
    core, sh = new()
    sh.do(core.abort("early"))
    out = sh.do(core.indices(ep(), decode(), LAYOUT, init_msg(decode())))
    (s,) = statuses(out)
    assert s.outcome is Outcome.FAILED and "early" in s.reason
    assert [p.endpoint for p in posts(out, AbortAck)] == [ep()]


def test_late_indices_get_the_answer_the_desk_gives_for_a_failed_request() -> None:
    """A Sender that already failed and the desk's tombstone (no Sender any more) answer
    late indices alike: one shared builder, FAILED status then AbortAck."""
    core, sh = new()
    sh.do(core.abort("early"))
    out = sh.do(core.indices(ep(), decode(), LAYOUT, init_msg(decode())))
    want = failed_answer(core.request_id, core.rank, core.reason or "", ack=True)
    assert [(p.endpoint, p.msg) for p in out if isinstance(p, Post)] == \
        [(ep(), m) for m in want]
    assert [type(m) for m in want] == [TransferStatus, AbortAck]
    assert [type(m) for m in failed_answer(1, core.rank, "x", ack=False)] == [TransferStatus]


def test_indices_twice_from_one_rank_are_ignored() -> None:
    core, sh = new()
    sh.do(core.indices(ep(), decode(), LAYOUT, init_msg(decode())))
    assert sh.do(core.indices("elsewhere", decode(), LAYOUT, init_msg(decode()))) == []
    assert list(core.targets) == [ep()]


@pytest.mark.parametrize(("second", "why"), [
    (decode(1, 2, "other"), "indices from two decode deployments"),
    (decode(0, 1), "indices from two decode deployments"),
])
def test_indices_from_another_deployment_fail(second: RankId, why: str) -> None:
    core, sh = new()
    sh.do(core.indices(ep(0), decode(0, 2), LAYOUT, init_msg(decode(0, 2))))
    sh.do(core.indices(ep(1), second, LAYOUT, init_msg(second)))
    assert why in str(core.error)


def test_ranks_that_disagree_on_the_prefix_fail_at_bootstrap() -> None:
    core, sh = new()
    sh.do(core.indices(ep(0), decode(0, 2), LAYOUT, init_msg(decode(0, 2), prefix=0)))
    sh.do(core.indices(ep(1), decode(1, 2), LAYOUT, init_msg(decode(1, 2), prefix=PAGE)))
    sh.do(core.init(2, 5, None))
    assert "disagree on the prefix length: [0, 4]" in str(core.error)


def test_page_counts_that_disagree_fail_at_bootstrap() -> None:
    core, sh = new()
    sh.do(core.indices(ep(), decode(), LAYOUT, init_msg(decode(), pages=3)))
    sh.do(core.init(2, 5, None))
    assert "decode allocated 3" in str(core.error) and core.status is Status.FAILED


def test_waiting_too_long_for_indices_times_out() -> None:
    core, sh = new()
    assert sh.do(core.tick(104.0)) == []
    sh.do(core.tick(106.0))
    assert isinstance(core.error, RequestTimeout)
    assert "got 0 of ? decode ranks' TransferInits; init() was never called" in str(core.error)


def test_a_finished_request_no_decode_claims_is_freed_after_the_lease() -> None:
    """Prefill handed over its last chunk at 100 (its work is done); no decode sent
    indices: at 100 + lease it fails with LeaseExpired, counted, and settles (the engine
    frees its memory) long before indices_timeout."""
    core, sh = new(config=SessionConfig(indices_timeout=300.0, lease=2.0))
    sh.do(core.init(2, 5, None))
    send(core, sh, [0, 1], last=True)
    assert not core.tick_due(102.0) and sh.do(core.tick(102.0)) == []
    assert core.tick_due(102.5)
    out = sh.do(core.tick(102.5))
    assert isinstance(core.error, LeaseExpired) and core.settled
    assert any(isinstance(e, Settle) for e in out)
    assert "no decode claimed it within the 2 s lease (got 0 of ? decode ranks'" \
        in str(core.error)
    assert core.events["lease_expired"] == 1
    assert sh.do(core.tick(110.0)) == [] and core.events["lease_expired"] == 1  # once


def test_the_lease_fails_a_partly_claimed_request_and_tells_the_rank_that_claimed() -> None:
    core, sh = new(config=SessionConfig(indices_timeout=300.0, lease=2.0))
    sh.do(core.indices(ep(0), decode(0, 2), LAYOUT, init_msg(decode(0, 2))))
    sh.do(core.init(2, 5, None))
    send(core, sh, [0, 1], last=True)
    out = sh.do(core.tick(103.0))
    assert isinstance(core.error, LeaseExpired) and "got 1 of 2 decode ranks'" in str(core.error)
    told = posts(out)
    assert [p.endpoint for p in told] == [ep(0), ep(0)]  # FAILED, then AbortAck
    assert isinstance(told[0].msg, TransferStatus) and told[0].msg.outcome is Outcome.FAILED
    assert isinstance(told[1].msg, AbortAck)


def test_the_lease_runs_only_once_prefill_is_done_and_decode_has_not_claimed() -> None:
    # still computing (no last chunk): only indices_timeout applies
    core, sh = new(config=SessionConfig(indices_timeout=300.0, lease=2.0))
    sh.do(core.init(2, 5, None))
    send(core, sh, [0])
    assert not core.tick_due(250.0) and core.error is None
    # claimed in time: the lease is over, the request goes on
    core, sh = new(config=SessionConfig(indices_timeout=300.0, lease=2.0))
    sh.do(core.init(2, 5, None))
    send(core, sh, [0, 1], last=True)
    sh.do(core.indices(ep(), decode(), LAYOUT, init_msg(decode())))
    assert core.status is Status.WAITING_FOR_INPUT
    assert not core.tick_due(1e6) and sh.do(core.tick(1e6)) == [] and core.error is None


def test_a_tick_knows_without_the_lock_whether_anything_is_due() -> None:
    core, sh = new()
    assert not core.tick_due(104.0) and core.tick_due(106.0)
    core, sh = ready()
    assert not core.tick_due(1e9)  # past bootstrapping: no timer of its own
    assert sh.do(core.tick(1e9)) == []


def test_a_lost_decode_rank_fails_the_request_only_if_it_matters() -> None:
    core, sh = ready()
    assert sh.do(core.peer_lost("tcp://someone-else", "gone")) == []
    sh.do(core.peer_lost(ep(), "heartbeat"))
    assert isinstance(core.error, PeerLost) and "heartbeat" in str(core.error)


def test_a_rank_asked_to_handshake_again_is_watched_until_it_resends() -> None:
    core, sh = new()
    sh.do(core.init_deferred(ep()))
    assert core.peer_endpoints() == {ep()}
    sh.do(core.indices(ep(), decode(), LAYOUT, init_msg(decode())))
    assert core.peer_endpoints() == {ep()}  # a target now, not awaited
    core, sh = new()
    sh.do(core.init_deferred(ep()))
    sh.do(core.peer_lost(ep(), "died"))
    assert "asked to handshake again and resend its indices: died" in str(core.error)


def test_an_abort_from_a_rank_never_written_is_acked_at_once() -> None:
    core, sh = ready()
    out = sh.do(core.decode_aborted("tcp://stranger", "d9", "bye"))
    assert [p.endpoint for p in posts(out, AbortAck)] == [ep(), "tcp://stranger"]


@pytest.mark.parametrize("event", ["closed", "refused", "before", "dropped"])
def test_the_rank_can_fail_a_request(event: str) -> None:
    core, sh = new()
    sh.do({"closed": core.agent_closed, "refused": lambda: core.init_refused("unreachable"),
           "before": lambda: core.failed_before(RequestAborted("aborted earlier")),
           "dropped": lambda: core.dropped_before(decode(), "gone")}[event]())
    assert core.status is Status.FAILED and core.settled
    assert isinstance(core.error, AgentClosed if event == "closed" else
                      RequestAborted if event == "before" else PeerLost)


def test_misuse_is_refused() -> None:
    core, sh = new()
    with pytest.raises(RuntimeError, match="before init"):
        core.send(np.array([0]), None, False, now=NOW)
    sh.do(core.init(1, 5, None))
    with pytest.raises(RuntimeError, match="called twice"):
        core.init(1, 5, None)
    sh.do(core.send(np.array([0]), LAST_STATE, True, now=NOW))
    with pytest.raises(RuntimeError, match="after the last chunk"):
        core.send(np.array([0]), None, False, now=NOW)
    with pytest.raises(RuntimeError, match="no question"):
        core.submitted()


# --- any order of events -----------------------------------------------------------------

_LIKELY = ["indices0", "indices1", "init", "chunk", "last", "ok", "ok_in_band"]
_RARE = ["error", "timeout", "abort", "decode_abort", "lost", "tick", "refuse_plan",
         "refuse_submit", "overrun"]
# every event a success needs, in any order, among any others
EVENTS = st.lists(st.sampled_from(_LIKELY * 3 + _RARE), max_size=20).flatmap(
    lambda extra: st.permutations(_LIKELY + extra))


def _step(core: SendCore, sh: Shell, name: str, i: int) -> None:
    rank = decode(int(name[-1]) if name.startswith("indices") else 0, 2)
    if name.startswith("indices"):
        sh.do(core.indices(ep(rank.tp_rank), rank, LAYOUT, init_msg(rank, 3)))
    elif name == "init" and core.num_pages is None:
        sh.do(core.init(3, 5, None))
    elif name in ("chunk", "last", "overrun") and core.num_pages is not None \
            and not core.last_given:
        sent = sum(len(c.pages) for c in sh.chunks)
        n = {"chunk": min(1, 2 - sent), "last": 3 - sent, "overrun": 4}[name]
        pages = np.arange(max(n, 0), dtype=np.int64)
        sh.chunks.append(Chunk(pages))
        sh.do(core.send(pages, LAST_STATE if name == "last" else None, name == "last",
                        now=NOW))
    elif name in ("ok", "ok_in_band", "error", "timeout") and sh.open:
        err = None if name.startswith("ok") else TransportError("x")
        sh.end(sh.open[i % len(sh.open)], err, in_band=name == "ok_in_band",
               timed_out=name == "timeout")
    elif name in ("refuse_plan", "refuse_submit"):
        sh.refuse = name.removeprefix("refuse_")
    else:
        sh.do({"abort": lambda: core.abort("x"), "tick": lambda: core.tick(200.0),
               "decode_abort": lambda: core.decode_aborted(ep(0), "d", "x"),
               "lost": lambda: core.peer_lost(ep(1), "x")}.get(name, lambda: [])())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(EVENTS, st.booleans())
def test_any_event_order_keeps_the_promises(names: list[str], drain: bool) -> None:
    core = SendCore(request_id=7, facts=Facts(), created=100.0)  # type: ignore[arg-type]
    sh = Shell(core)
    fails = 0
    if drain:  # then every write still open completes
        names = names + ["ok"] * 8
    for i, name in enumerate(names):
        before = len(sh.seen)
        was_terminal, was = core.terminal, core.status
        _step(core, sh, name, i)
        for now in (100.0 + i, 1e9):  # the shell skips a tick only when nothing is due
            assert core.tick_due(now) or core.tick(now) == []
        new = sh.seen[before:]
        fails += sum(isinstance(e, Fail) for e in new)
        if was_terminal:  # a final status never changes; nothing new is written
            assert core.status is was
            assert not any(isinstance(e, PlanChunk | Write | Fire | Fail) for e in new)
            assert all(s.outcome is Outcome.FAILED for s in statuses(new))
    event(f"ends {core.status.value}")
    assert fails <= 1 and (fails == 1) == (core.status is Status.FAILED)
    assert sum(isinstance(e, Settle) for e in sh.seen) == int(core.settled) <= 1
    if core.terminal and not sh.open:
        assert core.settled  # nothing in flight: the request is over here
    if core.status is Status.SUCCESS:
        writes = [e for e in sh.seen if isinstance(e, Write)]
        assert not sh.open and core.last_given
        assert core.nbytes == sum(w.status.nbytes for w in writes)  # every write landed
        for t in core.targets.values():
            assert t.finished and t.done == t.submitted
    if core.status is Status.FAILED and core.settled and not core.poisoned:
        acked = {p.endpoint for p in posts(sh.seen, AbortAck)}
        assert acked >= set(core.targets)


# --- the cores stay pure ----------------------------------------------------------------------

_IO = ("socket", "threading", "time", "zmq", "selectors", "asyncio", "subprocess",
       "concurrent", "kvhandoff.transport", "kvhandoff.session.request.host",
       "kvhandoff.session.rank", "kvhandoff.session.control",
       "kvhandoff.session.request.sender", "kvhandoff.session.request.receiver")


@pytest.mark.parametrize("module", ["core", "send_core", "recv_core", "chunks"])
def test_a_core_imports_no_io_module_itself(module: str) -> None:
    """A core's own imports: no socket, thread, clock, transport or agent-side module (the
    shells and the modules they use do that)."""
    path = Path(kvhandoff.session.__file__).parent / "request" / f"{module}.py"
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    bad = sorted(n for n in names if any(n == b or n.startswith(b + ".") for b in _IO))
    assert bad == [], f"{module} imports {bad}"
