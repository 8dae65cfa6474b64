"""The decode request core, driven event by event: no socket, no thread, no clock.

A tiny stand-in shell reads a fake aux guard for ``CheckGuard`` and keeps every effect;
checksum checks (``Verify``) and re-handshakes end only when a test says so."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvhandoff.layout import Layout
from kvhandoff.observe import timeline as tl
from kvhandoff.plan import Indices
from kvhandoff.protocol import (
    Abort,
    IndexListMsg,
    Outcome,
    PlannedIndicesMsg,
    RankId,
    TransferInit,
    TransferStatus,
)
from kvhandoff.session import SessionConfig, Status
from kvhandoff.session.errors import (
    AgentClosed,
    AuxMismatch,
    ChecksumMismatch,
    PeerLost,
    RequestAborted,
    RequestRejected,
    RequestTimeout,
    TransferFailed,
)
from kvhandoff.session.request.aux import AuxState
from kvhandoff.session.request.core import Fail, Fire, Mark, Post
from kvhandoff.session.request.recv_core import (
    MAX_REHANDSHAKES,
    CheckGuard,
    ClearGuard,
    RecvCore,
    Rehandshake,
    Release,
    Verify,
)
from kvhandoff.session.request.status import Event, StateMachine

ME = RankId(instance="decode")
CONFIG = SessionConfig(bootstrap_timeout=10.0, waiting_timeout=20.0, transfer_timeout=30.0,
                       release_timeout=40.0)
T0 = 100.0


@dataclass(frozen=True)
class Facts:
    rank_id: RankId = ME
    config: SessionConfig = CONFIG


@dataclass(frozen=True)
class Rank:
    endpoint: str
    rank: RankId
    layout: Layout | None = None


def prefill(i: int) -> Rank:
    return Rank(f"tcp://prefill-{i}", RankId(instance="prefill", tp_rank=i, tp_size=2))


GROUP = (prefill(0), prefill(1))


def init_msg(checksum: bool = False) -> TransferInit:
    return TransferInit(request_id=7, rank=ME, expect_checksum=checksum,
                        indices={"kv": IndexListMsg.of([1, 2]), "aux": IndexListMsg.of([3])})


def status(chunk: int = 0, last: bool = True, outcome: Outcome = Outcome.SUCCESS,
           *, rank: int = 0, sums: dict[str, int] | None = None) -> TransferStatus:
    idx = None if sums is None else {"kv": PlannedIndicesMsg.of(Indices([0], [1]))}
    return TransferStatus(request_id=7, rank=prefill(rank).rank, chunk=chunk, last=last,
                          outcome=outcome, nbytes=10, checksums=sums, indices=idx,
                          reason="boom" if outcome is Outcome.FAILED else "")


@dataclass
class Shell:
    """Reads ``guard`` for every CheckGuard; keeps every effect and the open checks."""

    core: RecvCore
    guard: AuxState = AuxState.OK
    now: float = T0
    seen: list[object] = field(default_factory=list)
    checks: list[Verify] = field(default_factory=list)
    reads: list[AuxState] = field(default_factory=list)  # each guard read, in order
    sm: StateMachine = field(default_factory=lambda: StateMachine(name="mirror"))

    def do(self, effects: Iterable[object]) -> list[object]:
        start = len(self.seen)
        todo = deque(effects)
        while todo:
            e = todo.popleft()
            self.seen.append(e)
            more: list[object] = []
            if isinstance(e, CheckGuard):
                self.reads.append(self.guard)
                more = self.core.guard(self.guard, "detail", self.now)
            elif isinstance(e, Verify):
                self.checks.append(e)
            elif isinstance(e, Fire):
                self.sm.fire(e.event)
            elif isinstance(e, Fail):
                assert self.sm.fail(str(e.error), event=e.event)
            todo.extendleft(reversed(more))
        assert self.sm.state is self.core.status
        return self.seen[start:]


def new() -> tuple[RecvCore, Shell]:
    core = RecvCore(request_id=7, facts=Facts(), created=T0)  # type: ignore[arg-type]
    return core, Shell(core)


def asked(checksum: bool = False, ranks: tuple[Rank, ...] = GROUP) -> tuple[RecvCore, Shell]:
    """Indices sent to every rank of the group: WAITING_FOR_INPUT."""
    core, sh = new()
    sh.do(core.init(init_msg(checksum), 3, T0, ranks))
    assert core.status is Status.WAITING_FOR_INPUT
    return core, sh


def posts(effects: Iterable[object], kind: type | None = None) -> list[Post]:
    return [e for e in effects if isinstance(e, Post) and (kind is None or isinstance(e.msg, kind))]


def releases(effects: Iterable[object]) -> list[str]:
    return [e.reason for e in effects if isinstance(e, Release)]


# --- the happy paths -------------------------------------------------------------------


def test_indices_go_out_once_init_and_the_group_are_both_there() -> None:
    core, sh = new()
    assert sh.do(core.group_ready(GROUP, T0)) == []  # no indices yet
    out = sh.do(core.init(init_msg(), 3, T0 + 1, None))
    assert out[0] == ClearGuard() and out[1] == Mark(tl.ASKED)
    assert [p.endpoint for p in posts(out, TransferInit)] == [r.endpoint for r in GROUP]
    assert out[-1] == Fire(Event.BOOTSTRAPPED) and core.peer_endpoints() == {
        r.endpoint for r in GROUP}
    core, sh = new()
    sh.do(core.init(init_msg(), None, T0, None))
    out = sh.do(core.group_ready(GROUP, T0))
    assert len(posts(out, TransferInit)) == 2 and not any(isinstance(e, ClearGuard) for e in out)


def test_success_needs_every_rank_and_the_guard() -> None:
    core, sh = asked()
    out = sh.do(core.chunk_status(GROUP[0].endpoint, status(), T0))
    assert out == [Fire(Event.CHUNK_DONE)]  # one rank of two
    out = sh.do(core.chunk_status(GROUP[1].endpoint, status(rank=1), T0))
    assert out[0] == CheckGuard() and out[1:] == [
        Mark(tl.LANDED), Fire(Event.ALL_DONE), Release("the request succeeded")]
    assert core.status is Status.SUCCESS and core.released and core.nbytes == 20
    assert core.peer_endpoints() == set()


def test_statuses_in_band_may_overtake_one_another() -> None:
    core, sh = asked(ranks=GROUP[:1])
    sh.do(core.chunk_status(GROUP[0].endpoint, status(chunk=1, last=True), T0))
    assert core.status is Status.TRANSFERRING and not core.writers[GROUP[0].endpoint].done
    sh.do(core.chunk_status(GROUP[0].endpoint, status(chunk=0, last=False), T0))
    assert core.status is Status.SUCCESS


def test_an_empty_guard_is_waited_for_then_fails() -> None:
    core, sh = asked(ranks=GROUP[:1])
    sh.guard = AuxState.EMPTY
    sh.do(core.chunk_status(GROUP[0].endpoint, status(), T0))
    assert core.status is Status.TRANSFERRING
    assert sh.do(core.poll()) == [CheckGuard()]
    sh.now = T0 + 31
    sh.do(core.tick(sh.now, False))
    assert isinstance(core.error, AuxMismatch) and "never showed the request's guard" in str(
        core.error)


def test_a_wrong_guard_fails_at_once() -> None:
    core, sh = asked(ranks=GROUP[:1])
    sh.guard = AuxState.OTHER
    sh.do(core.chunk_status(GROUP[0].endpoint, status(), T0))
    assert isinstance(core.error, AuxMismatch) and "aux row 3" in str(core.error)


def test_the_guard_is_read_once_the_engine_polls_and_it_landed() -> None:
    core, sh = asked(ranks=GROUP[:1])
    sh.guard = AuxState.EMPTY
    sh.do(core.chunk_status(GROUP[0].endpoint, status(), T0))
    sh.guard = AuxState.OK
    sh.do(core.poll())
    assert core.status is Status.SUCCESS and sh.do(core.poll()) == []


# --- checksums ------------------------------------------------------------------------------


def test_every_chunk_is_verified_before_success() -> None:
    core, sh = asked(checksum=True, ranks=GROUP[:1])
    out = sh.do(core.chunk_status(GROUP[0].endpoint, status(sums={"kv": 5}), T0))
    (check,) = [e for e in out if isinstance(e, Verify)]
    assert check.endpoint == GROUP[0].endpoint and core.status is Status.TRANSFERRING
    sh.do(core.verified(check.endpoint, check.msg, {"kv": 5}, None, T0))
    assert core.status is Status.SUCCESS


@pytest.mark.parametrize(("got", "cannot", "why"), [
    ({"kv": 6}, None, "component 'kv': decode bytes crc32 0x00000006, prefill sent 0x00000005"),
    (None, "no layout", "cannot check: no layout"),
])
def test_a_checksum_mismatch_fails(got: dict[str, int] | None, cannot: str | None,
                                   why: str) -> None:
    core, sh = asked(checksum=True, ranks=GROUP[:1])
    sh.do(core.chunk_status(GROUP[0].endpoint, status(sums={"kv": 5}), T0))
    sh.do(core.verified(GROUP[0].endpoint, sh.checks[0].msg, got, cannot, T0))
    assert isinstance(core.error, ChecksumMismatch) and why in str(core.error)
    assert core.events["checksum_mismatch"] == 1


def test_a_chunk_without_checksums_fails_when_they_were_asked_for() -> None:
    core, sh = asked(checksum=True)
    sh.do(core.chunk_status(GROUP[0].endpoint, status(), T0))
    assert "checksums were asked for" in str(core.error)


# --- failures: in every state, first one wins -------------------------------------------------


def test_an_abort_while_bootstrapping_releases_at_once() -> None:
    core, sh = new()
    out = sh.do(core.abort("test", T0))
    assert isinstance(out[0], Fail) and out[0].event is Event.ABORT and posts(out) == []
    assert releases(out) == ["no prefill rank was sent the indices"]
    assert sh.do(core.init(init_msg(), 3, T0, GROUP)) == []  # too late: nothing goes out


def test_an_abort_while_waiting_stops_every_rank_and_waits_for_their_acks() -> None:
    core, sh = asked()
    out = sh.do(core.abort("test", T0))
    assert [p.endpoint for p in posts(out, Abort)] == [r.endpoint for r in GROUP]
    assert releases(out) == [] and not core.released
    assert sh.do(core.abort_ack(GROUP[0].endpoint)) == []
    out = sh.do(core.abort_ack(GROUP[1].endpoint))
    assert releases(out) == ["every prefill rank confirmed no write in flight"]


def test_a_rank_done_before_the_failure_needs_no_ack() -> None:
    core, sh = asked()
    sh.do(core.chunk_status(GROUP[0].endpoint, status(), T0))
    out = sh.do(core.chunk_status(GROUP[1].endpoint, status(outcome=Outcome.FAILED, rank=1), T0))
    assert isinstance(core.error, TransferFailed) and "failed (chunk 0): boom" in str(core.error)
    assert [p.endpoint for p in posts(out, Abort)] == [GROUP[1].endpoint]
    assert releases(sh.do(core.abort_ack(GROUP[1].endpoint)))


def _in_state(state: Status) -> tuple[RecvCore, Shell]:
    """A core in ``state``; when TRANSFERRING, rank 0 is done and rank 1 is not."""
    if state is Status.BOOTSTRAPPING:
        return new()
    core, sh = asked()
    if state is not Status.WAITING_FOR_INPUT:
        sh.do(core.chunk_status(GROUP[0].endpoint, status(), T0))
    if state is Status.SUCCESS:
        sh.do(core.chunk_status(GROUP[1].endpoint, status(rank=1), T0))
    elif state is Status.FAILED:
        sh.do(core.abort("first", T0))
    assert core.status is state
    return core, sh


@pytest.mark.parametrize("state", list(Status))
def test_an_abort_in_every_state(state: Status) -> None:
    core, sh = _in_state(state)
    error = core.error
    out = sh.do(core.abort("test", T0))
    if state in (Status.SUCCESS, Status.FAILED):  # final: nothing changes
        assert out == [] and core.status is state and core.error is error
        return
    assert isinstance(core.error, RequestAborted) and core.status is Status.FAILED
    stopped = [p.endpoint for p in posts(out, Abort)]
    assert stopped == [e for e, w in core.writers.items() if not w.done]  # not the done one
    if stopped:
        assert not core.released
        for e in stopped:
            sh.do(core.abort_ack(e))
    assert core.released and core.peer_endpoints() == set()


def test_silent_ranks_are_given_up_on_after_release_timeout() -> None:
    core, sh = asked()
    sh.do(core.abort("test", T0))
    assert sh.do(core.tick(T0 + 40, False)) == []
    (why,) = releases(sh.do(core.tick(T0 + 41, False)))
    assert why.startswith("release_timeout (40 s) passed without an AbortAck from")


def test_a_success_stays_a_success() -> None:
    core, sh = asked(ranks=GROUP[:1])
    sh.do(core.chunk_status(GROUP[0].endpoint, status(), T0))
    for effects in (core.abort("late", T0), core.peer_lost(GROUP[0].endpoint, "x", T0),
                    core.chunk_status(GROUP[0].endpoint, status(), T0),
                    core.tick(T0 + 1e6, False), core.agent_closed(T0)):
        assert sh.do(effects) == []
    assert core.status is Status.SUCCESS


@pytest.mark.parametrize(("statuses", "why"), [
    ([status(0, last=False), status(0, last=False)], "reported chunk 0 twice"),
    ([status(0), status(1)], "reported a last chunk twice (0, then 1)"),
    ([status(1, last=False), status(0)], "reported chunk 1 after its last chunk 0"),
])
def test_duplicate_or_late_statuses_fail(statuses: list[TransferStatus], why: str) -> None:
    core, sh = asked()
    for s in statuses:
        sh.do(core.chunk_status(GROUP[0].endpoint, s, T0))
    assert isinstance(core.error, TransferFailed) and why in str(core.error)


def test_statuses_from_strangers_or_after_the_end_are_ignored() -> None:
    core, sh = asked()
    assert sh.do(core.chunk_status("tcp://stranger", status(), T0)) == []
    sh.do(core.abort("test", T0))
    assert sh.do(core.chunk_status(GROUP[0].endpoint, status(), T0)) == []


def test_timeouts_in_each_state() -> None:
    core, sh = new()
    assert sh.do(core.tick(T0 + 11, True)) == []  # grace while the group connects
    sh.do(core.tick(T0 + 11, False))
    assert isinstance(core.error, RequestTimeout) and "init() was never called" in str(core.error)
    core, sh = asked()
    sh.do(core.tick(T0 + 21, False))
    assert "no chunk from prefill within waiting_timeout (20 s)" in str(core.error)
    core, sh = asked()
    sh.do(core.chunk_status(GROUP[0].endpoint, status(), T0 + 5))
    assert sh.do(core.tick(T0 + 35, False)) == []
    sh.do(core.tick(T0 + 36, False))
    assert f"still waiting for {GROUP[1].rank}" in str(core.error)


def test_a_tick_knows_without_the_lock_whether_anything_is_due() -> None:
    core, sh = new()
    assert not core.tick_due(T0 + 9) and core.tick_due(T0 + 11)
    core, sh = asked()
    assert not core.tick_due(T0 + 19) and core.tick_due(T0 + 21)
    sh.do(core.chunk_status(GROUP[0].endpoint, status(), T0 + 5))
    assert not core.tick_due(T0 + 34) and core.tick_due(T0 + 36)
    sh.do(core.chunk_status(GROUP[1].endpoint, status(rank=1), T0 + 6))
    assert core.status is Status.SUCCESS and not core.tick_due(T0 + 1e6)


def test_a_lost_or_refusing_prefill_rank_fails_the_request() -> None:
    core, sh = asked()
    assert sh.do(core.peer_lost("tcp://stranger", "gone", T0)) == []
    sh.do(core.peer_lost(GROUP[0].endpoint, "heartbeat", T0))
    assert isinstance(core.error, PeerLost)
    core, sh = asked()
    out = sh.do(core.rejected(GROUP[0].endpoint, "layout", T0))
    assert isinstance(core.error, RequestRejected)
    assert [p.endpoint for p in posts(out, Abort)] == [GROUP[1].endpoint]  # it never wrote


def test_a_closing_agent_fails_and_releases() -> None:
    core, sh = asked()
    out = sh.do(core.agent_closed(T0))
    assert isinstance(core.error, AgentClosed)
    assert releases(out) == ["the agent closed; no write can be waited for any more"]


def test_a_prefill_abort_or_a_failed_group_fails() -> None:
    core, sh = asked()
    sh.do(core.prefill_aborted("p0", "engine", T0))
    assert isinstance(core.error, RequestAborted) and "aborted by prefill p0" in str(core.error)
    core, sh = new()
    sh.do(core.group_failed(TransferFailed("lookup failed"), T0))
    assert str(core.error) == "lookup failed" and core.released


# --- re-handshake ---------------------------------------------------------------------------


def test_a_rank_that_forgot_us_is_handshaken_again_and_sent_the_indices() -> None:
    core, sh = asked()
    ep = GROUP[1].endpoint
    assert sh.do(core.unknown_peer(ep, "unknown decode peer", T0)) == [Rehandshake()]
    assert core.events["rehandshake"] == 1
    fresh = (GROUP[0], Rank(ep, RankId(instance="prefill", tp_rank=1, tp_size=2, dp_rank=0)))
    out = sh.do(core.regroup(fresh, T0 + 1))
    assert posts(out) == [Post(ep, init_msg())] and core.status is Status.WAITING_FOR_INPUT


def test_re_handshakes_are_bounded() -> None:
    core, sh = asked()
    ep = GROUP[0].endpoint
    for _ in range(MAX_REHANDSHAKES):
        assert sh.do(core.unknown_peer(ep, "unknown", T0)) == [Rehandshake()]
        sh.do(core.regroup(GROUP, T0))
    sh.do(core.unknown_peer(ep, "unknown", T0))
    assert isinstance(core.error, RequestRejected)
    assert f"(after {MAX_REHANDSHAKES} new handshake(s))" in str(core.error)


def test_a_rank_that_already_wrote_is_not_handshaken_again() -> None:
    core, sh = asked()
    sh.do(core.chunk_status(GROUP[0].endpoint, status(0, last=False), T0))
    sh.do(core.unknown_peer(GROUP[0].endpoint, "unknown", T0))
    assert isinstance(core.error, RequestRejected) and core.events["rehandshake"] == 0


def test_a_new_handshake_with_other_ranks_or_none_fails() -> None:
    core, sh = asked()
    sh.do(core.unknown_peer(GROUP[0].endpoint, "unknown", T0))
    sh.do(core.regroup(GROUP[:1], T0))
    assert "after a new handshake the prefill group is" in str(core.error)
    core, sh = asked()
    sh.do(core.unknown_peer(GROUP[0].endpoint, "unknown", T0))
    sh.do(core.regroup_failed(TransferFailed("handshake refused"), T0))
    assert str(core.error) == "handshake refused"


def test_misuse_is_refused() -> None:
    core, _ = asked()
    with pytest.raises(RuntimeError, match="called twice"):
        core.init(init_msg(), 3, T0, GROUP)


# --- any order of events -----------------------------------------------------------------------

_LIKELY = ["init", "group", "s0_0", "s0_1", "s1_0", "s1_1", "verify_ok", "guard_ok", "poll"]
_RARE = ["abort", "ack0", "ack1", "failed1", "dup", "unknown1", "regroup", "lost0",
         "tick", "verify_bad", "guard_empty", "guard_bad", "late_tick"]
EVENTS = st.lists(st.sampled_from(_LIKELY * 3 + _RARE), max_size=20).flatmap(
    lambda extra: st.permutations(_LIKELY + extra))


def _step(core: RecvCore, sh: Shell, name: str, now: float, checksum: bool = True) -> None:
    if name.startswith("guard_"):
        sh.guard = {"ok": AuxState.OK, "empty": AuxState.EMPTY}.get(name[6:], AuxState.CORRUPT)
        return
    if name.startswith("verify_"):
        if not sh.checks:
            return
        v = sh.checks.pop(0)
        sums = dict(v.msg.checksums or {})
        got = sums if name == "verify_ok" else {k: x + 1 for k, x in sums.items()}
        sh.do(core.verified(v.endpoint, v.msg, got, None, now))
        return
    if name.startswith("s") and name[1].isdigit():  # s<rank>_<chunk>: chunk 1 is the last
        rank, chunk = int(name[1]), int(name[3])
        sh.do(core.chunk_status(GROUP[rank].endpoint, status(chunk, chunk == 1, rank=rank,
                                                              sums={"kv": 9}), now))
        return
    sh.do({
        "init": lambda: [] if core.init_msg else core.init(init_msg(checksum), 3, now, None),
        "group": lambda: core.group_ready(GROUP, now), "poll": core.poll,
        "abort": lambda: core.abort("x", now), "ack0": lambda: core.abort_ack(GROUP[0].endpoint),
        "ack1": lambda: core.abort_ack(GROUP[1].endpoint),
        "failed1": lambda: core.chunk_status(GROUP[1].endpoint, status(
            outcome=Outcome.FAILED, rank=1), now),
        "dup": lambda: core.chunk_status(GROUP[0].endpoint, status(0, False, sums={}), now),
        "unknown1": lambda: core.unknown_peer(GROUP[1].endpoint, "x", now),
        "regroup": lambda: core.regroup(GROUP, now),
        "lost0": lambda: core.peer_lost(GROUP[0].endpoint, "x", now),
        "tick": lambda: core.tick(now, False), "late_tick": lambda: core.tick(now + 1e3, False),
    }[name]())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(EVENTS, st.booleans(), st.booleans())
def test_any_event_order_keeps_the_promises(names: list[str], checksum: bool,
                                            drain: bool) -> None:
    core, sh = new()
    fails = 0
    if drain:  # then every check still running passes and the engine polls
        names = [*names, *["verify_ok"] * 4, "poll"]
    for i, name in enumerate(names):
        before = len(sh.seen)
        was_terminal, was = core.terminal, core.status
        _step(core, sh, name, T0 + i, checksum)
        for dt in (0.5, 11.0, 21.0, 31.0, 1e4):  # the shell skips a tick only when idle
            now = T0 + i + dt
            assert core.tick_due(now) or (core.tick(now, True) == [] and
                                          core.tick(now, False) == [])
        new_ = sh.seen[before:]
        fails += sum(isinstance(e, Fail) for e in new_)
        if was_terminal:  # a final status never changes; no indices, no abort go out
            assert core.status is was and posts(new_) == []
            assert not any(isinstance(e, Fire | Fail | Verify | Rehandshake) for e in new_)
    event(f"ends {core.status.value}")
    assert fails <= 1 and (fails == 1) == (core.status is Status.FAILED)
    assert len(releases(sh.seen)) == int(core.released) <= 1
    if core.status is Status.SUCCESS:
        assert core.released and sh.reads[-1] is AuxState.OK
        assert all(w.done and not w.verifying for w in core.writers.values())
        assert len(core.writers) == len(GROUP)
    if core.released and core.status is Status.FAILED:
        assert core.peer_endpoints() == set()
