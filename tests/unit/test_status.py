"""The status table: every legal transition, every illegal one, terminal states, waiting,
and the reduction across ranks."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvhandoff.protocol import LocalProtocolError
from kvhandoff.session.request.status import (
    COMBINE_ORDER,
    TERMINAL,
    TRANSITIONS,
    Event,
    Latch,
    StateMachine,
    Status,
    combine,
)

# the shortest way to each state from a new machine
PATH: dict[Status, list[Event]] = {
    Status.BOOTSTRAPPING: [],
    Status.WAITING_FOR_INPUT: [Event.BOOTSTRAPPED],
    Status.TRANSFERRING: [Event.BOOTSTRAPPED, Event.CHUNK_DONE],
    Status.SUCCESS: [Event.BOOTSTRAPPED, Event.ALL_DONE],
    Status.FAILED: [Event.FAIL],
}


def machine_in(state: Status, **kw: object) -> StateMachine:
    sm = StateMachine(name="req-1", **kw)  # type: ignore[arg-type]
    for ev in PATH[state]:
        sm.fire(ev, reason="setup")
    assert sm.state is state
    return sm


@pytest.mark.parametrize(("rule", "target"), TRANSITIONS.items(),
                         ids=lambda v: v.value if isinstance(v, Status) else f"{v[0]}+{v[1]}")
def test_every_legal_transition(rule: tuple[Status, Event], target: Status) -> None:
    state, event = rule
    sm = machine_in(state)
    assert sm.fire(event, reason="why") is target
    assert sm.state is target


ILLEGAL = [(s, e) for s, e in itertools.product(Status, Event) if (s, e) not in TRANSITIONS]


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=lambda v: v.value)
def test_every_illegal_transition_raises_and_changes_nothing(state: Status, event: Event) -> None:
    sm = machine_in(state)
    before = (sm.state, sm.reason, sm.since)
    with pytest.raises(LocalProtocolError, match=f"event {event.value} is illegal in state "
                                                 f"{state.value}"):
        sm.fire(event)
    assert (sm.state, sm.reason, sm.since) == before


def test_the_table_shape() -> None:
    live = set(Status) - TERMINAL
    for s in live:  # every live state can fail and be aborted
        assert TRANSITIONS[(s, Event.FAIL)] is Status.FAILED
        assert TRANSITIONS[(s, Event.ABORT)] is Status.FAILED
    for (s, _), t in TRANSITIONS.items():  # nothing leaves a terminal state
        if s in TERMINAL:
            assert t is s
    assert not any(s is Status.SUCCESS for s, _ in TRANSITIONS)
    reached = {Status.BOOTSTRAPPING} | set(TRANSITIONS.values())
    assert reached == set(Status)
    assert set(COMBINE_ORDER) == set(Status)


def test_success_is_terminal() -> None:
    sm = machine_in(Status.SUCCESS)
    assert sm.terminal
    for ev in Event:
        with pytest.raises(LocalProtocolError):
            sm.fire(ev)
    assert not sm.fail("late peer loss")
    assert sm.state is Status.SUCCESS and sm.reason is None


def test_failed_is_terminal_and_keeps_the_first_reason() -> None:
    sm = machine_in(Status.TRANSFERRING)
    assert sm.fire(Event.FAIL, reason="peer lost: prefill-0 tp1") is Status.FAILED
    assert sm.fire(Event.ABORT, reason="aborted") is Status.FAILED
    assert not sm.fail("timeout")
    assert sm.reason == "peer lost: prefill-0 tp1"
    with pytest.raises(LocalProtocolError, match=r"illegal in state failed \(peer lost"):
        sm.fire(Event.CHUNK_DONE)


def test_default_reasons_and_fail_helper() -> None:
    assert machine_in(Status.BOOTSTRAPPING).fire(Event.ABORT) is Status.FAILED
    sm = StateMachine()
    sm.fire(Event.ABORT)
    assert sm.reason == "aborted"
    sm = StateMachine()
    sm.fire(Event.FAIL)
    assert sm.reason and "no reason" in sm.reason
    sm = machine_in(Status.WAITING_FOR_INPUT)
    assert sm.fail("aborted by decode", event=Event.ABORT)
    assert (sm.state, sm.reason) == (Status.FAILED, "aborted by decode")
    with pytest.raises(ValueError):
        StateMachine().fail("x", event=Event.CHUNK_DONE)


def test_reasons_are_only_recorded_on_failure() -> None:
    sm = StateMachine()
    sm.fire(Event.BOOTSTRAPPED, reason="ignored")
    assert sm.reason is None


def test_since_follows_the_clock_on_changes_only() -> None:
    now = [10.0]
    sm = StateMachine(clock=lambda: now[0])
    assert sm.since == 10.0
    now[0] = 11.0
    sm.fire(Event.BOOTSTRAPPED)
    assert sm.since == 11.0
    now[0] = 12.0
    sm.fire(Event.CHUNK_DONE)
    now[0] = 13.0
    sm.fire(Event.CHUNK_DONE)  # TRANSFERRING → TRANSFERRING is no change
    assert sm.since == 12.0


def test_wait_wakes_on_the_wanted_state() -> None:
    sm = StateMachine()

    def drive() -> None:
        time.sleep(0.02)
        sm.fire(Event.BOOTSTRAPPED)
        time.sleep(0.02)
        sm.fire(Event.ALL_DONE)

    t = threading.Thread(target=drive)
    t.start()
    assert sm.wait(Status.WAITING_FOR_INPUT, timeout=5) in (Status.WAITING_FOR_INPUT,
                                                             Status.SUCCESS)
    assert sm.wait({Status.SUCCESS}, timeout=5) is Status.SUCCESS
    t.join()


def test_wait_returns_on_failure_and_on_timeout() -> None:
    sm = StateMachine()
    assert sm.wait(Status.SUCCESS, timeout=0.01) is Status.BOOTSTRAPPING
    threading.Timer(0.02, sm.fail, args=("bootstrap timeout",)).start()
    assert sm.wait(Status.SUCCESS, timeout=5) is Status.FAILED
    assert sm.reason == "bootstrap timeout"


def test_racing_failures_have_exactly_one_winner() -> None:
    sm = machine_in(Status.TRANSFERRING)
    wins: list[bool] = []
    barrier = threading.Barrier(8)

    def go(i: int) -> None:
        barrier.wait()
        wins.append(sm.fail(f"reason {i}"))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wins.count(True) == 1
    assert sm.state is Status.FAILED and sm.reason and sm.reason.startswith("reason ")


def test_many_waiters_of_one_state_all_wake_once_it_is_reached() -> None:
    sm = StateMachine()
    got: list[Status] = []
    waiting = threading.Barrier(9)

    def wait() -> None:
        waiting.wait()
        got.append(sm.wait(Status.SUCCESS, timeout=10))

    threads = [threading.Thread(target=wait) for _ in range(8)]
    for t in threads:
        t.start()
    waiting.wait()
    sm.fire(Event.BOOTSTRAPPED)
    sm.fire(Event.ALL_DONE)
    for t in threads:
        t.join(10)
    assert got == [Status.SUCCESS] * 8
    assert sm._waiters == []  # every waiter took its entry away


# ---------------------------------------------------------------------------------------
# Latch


def test_a_latch_opens_once_and_stays_open() -> None:
    latch = Latch()
    assert not latch.is_set()
    assert latch.wait(0.01) is False
    assert latch.wait(-1) is False  # a negative timeout is no wait, not an error
    latch.set()
    latch.set()  # again: nothing changes
    assert latch.is_set()
    assert all(latch.wait(0) for _ in range(3))
    assert latch.wait() is True


def _race(latch: Latch, waiters: int, setters: int) -> list[bool]:
    """``waiters`` threads wait on ``latch`` while ``setters`` threads set it, all let go
    at once; what each wait returned."""
    start = threading.Barrier(waiters + setters)
    got: list[bool] = []

    def wait() -> None:
        start.wait()
        got.append(latch.wait(10))

    def open_it() -> None:
        start.wait()
        latch.set()

    threads = [threading.Thread(target=wait) for _ in range(waiters)]
    threads += [threading.Thread(target=open_it) for _ in range(setters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return got


def test_a_latch_lets_every_waiter_through_even_when_set_races_itself() -> None:
    for _ in range(20):
        latch = Latch()
        assert _race(latch, waiters=8, setters=4) == [True] * 8
        assert latch.wait(0)  # and it stays open


# ---------------------------------------------------------------------------------------
# combine


@pytest.mark.parametrize(("statuses", "expected"), [
    ([Status.SUCCESS, Status.SUCCESS], Status.SUCCESS),
    ([Status.SUCCESS, Status.TRANSFERRING], Status.TRANSFERRING),
    ([Status.SUCCESS, Status.FAILED, Status.TRANSFERRING], Status.FAILED),
    ([Status.WAITING_FOR_INPUT, Status.BOOTSTRAPPING], Status.BOOTSTRAPPING),
    ([Status.FAILED, Status.BOOTSTRAPPING], Status.FAILED),
    ([Status.TRANSFERRING], Status.TRANSFERRING),
])
def test_combine_examples(statuses: list[Status], expected: Status) -> None:
    assert combine(statuses) is expected
    assert combine(iter(statuses)) is expected


@given(st.lists(st.sampled_from(list(Status)), min_size=1))
def test_combine_is_the_minimum_in_the_reference_order(statuses: list[Status]) -> None:
    got = combine(statuses)
    assert got in statuses
    assert all(COMBINE_ORDER.index(got) <= COMBINE_ORDER.index(s) for s in statuses)


def test_combine_order_is_the_reference_kvpoll_order() -> None:
    assert COMBINE_ORDER == (Status.FAILED, Status.BOOTSTRAPPING, Status.WAITING_FOR_INPUT,
                             Status.TRANSFERRING, Status.SUCCESS)
    with pytest.raises(ValueError):
        combine([])
