"""A request's transfer status on one rank: one enum, one transition table, one machine.

The rules, all of them (``TRANSITIONS`` below is the only place they live)::

    BOOTSTRAPPING     --BOOTSTRAPPED-->  WAITING_FOR_INPUT
    WAITING_FOR_INPUT --CHUNK_DONE---->  TRANSFERRING
    TRANSFERRING      --CHUNK_DONE---->  TRANSFERRING
    WAITING_FOR_INPUT --ALL_DONE------>  SUCCESS        (a rank with nothing to move)
    TRANSFERRING      --ALL_DONE------>  SUCCESS
    any live state    --FAIL / ABORT-->  FAILED
    FAILED            --FAIL / ABORT-->  FAILED         (idempotent; the first reason stays)

SUCCESS and FAILED are terminal. What fires each event:

* ``BOOTSTRAPPED`` — the peers are handshaken and the request's index lists have been
  exchanged: decode sent its TransferInits, prefill received every one it expects.
* ``CHUNK_DONE`` — prefill: a chunk's writes completed; decode: a chunk's
  TransferStatus arrived.
* ``ALL_DONE`` — prefill: the last chunk completed (or it had nothing to write);
  decode: every expected prefill rank reported its last chunk and the aux row landed.
* ``FAIL`` — a timeout, a transport failure, a peer lost, a rejected handshake.
* ``ABORT`` — an Abort from the engine or the peer.

What a final status promises (prefill SUCCESS: the transport acknowledged every byte in
decode's registered memory, not that decode is still alive; decode SUCCESS: every rank's
last chunk, the checksums when asked for and the aux guard) is tabulated in the README's
"How it works".

Across ranks, statuses reduce with :func:`combine` (the minimum in the order
FAILED < BOOTSTRAPPING < WAITING_FOR_INPUT < TRANSFERRING < SUCCESS): one failed
rank fails the request, and it succeeds only when every rank has.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections.abc import Callable, Iterable

from kvhandoff.protocol import LocalProtocolError


class Status(enum.StrEnum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


class Event(enum.StrEnum):
    BOOTSTRAPPED = "bootstrapped"
    CHUNK_DONE = "chunk_done"
    ALL_DONE = "all_done"
    FAIL = "fail"
    ABORT = "abort"


TRANSITIONS: dict[tuple[Status, Event], Status] = {
    (Status.BOOTSTRAPPING, Event.BOOTSTRAPPED): Status.WAITING_FOR_INPUT,
    (Status.WAITING_FOR_INPUT, Event.CHUNK_DONE): Status.TRANSFERRING,
    (Status.TRANSFERRING, Event.CHUNK_DONE): Status.TRANSFERRING,
    (Status.WAITING_FOR_INPUT, Event.ALL_DONE): Status.SUCCESS,
    (Status.TRANSFERRING, Event.ALL_DONE): Status.SUCCESS,
    (Status.BOOTSTRAPPING, Event.FAIL): Status.FAILED,
    (Status.WAITING_FOR_INPUT, Event.FAIL): Status.FAILED,
    (Status.TRANSFERRING, Event.FAIL): Status.FAILED,
    (Status.FAILED, Event.FAIL): Status.FAILED,
    (Status.BOOTSTRAPPING, Event.ABORT): Status.FAILED,
    (Status.WAITING_FOR_INPUT, Event.ABORT): Status.FAILED,
    (Status.TRANSFERRING, Event.ABORT): Status.FAILED,
    (Status.FAILED, Event.ABORT): Status.FAILED,
}

TERMINAL: frozenset[Status] = frozenset({Status.SUCCESS, Status.FAILED})

COMBINE_ORDER: tuple[Status, ...] = (
    Status.FAILED, Status.BOOTSTRAPPING, Status.WAITING_FOR_INPUT, Status.TRANSFERRING,
    Status.SUCCESS,
)
"""Lowest first: the status of a set of ranks is the lowest among them."""

_RANK = {s: i for i, s in enumerate(COMBINE_ORDER)}
_DEFAULT_REASON = {Event.FAIL: "failed (no reason given)", Event.ABORT: "aborted"}


def combine(statuses: Iterable[Status]) -> Status:
    """The status of a request across ranks: the lowest in :data:`COMBINE_ORDER`.
    Raises ``ValueError`` for no statuses (there is nothing to report)."""
    found = list(statuses)
    if not found:
        raise ValueError("combine() needs at least one status")
    return min(found, key=_RANK.__getitem__)


class Latch:
    """A one-shot event: :meth:`set` once, then every :meth:`wait` returns True at once.

    A ``threading.Event`` builds a ``Condition`` (several Python objects); this is one
    lock, held from creation until :meth:`set` releases it, so each request can afford
    several (its status waiters, settled, released). Thread-safe."""

    __slots__ = ("_gate", "_open")

    def __init__(self) -> None:
        self._open = False
        self._gate = threading.Lock()
        self._gate.acquire()

    def is_set(self) -> bool:
        return self._open

    def set(self) -> None:
        if not self._open:
            self._open = True
            self._pass()

    def wait(self, timeout: float | None = None) -> bool:
        """True once set (at once if it is), False after ``timeout`` seconds without."""
        if self._open:
            return True
        if not self._gate.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            return self._open
        self._pass()  # let the next waiter through
        return True

    def _pass(self) -> None:
        # another setter or waiter may have opened the gate first: it stays open
        with contextlib.suppress(RuntimeError):
            self._gate.release()


class StateMachine:
    """One request's status on one rank, driven by :meth:`fire`.

    Thread-safe: every method may be called from any thread; waiters block on an
    event of their own (no polling), set only by a change into a state they wait for,
    so an intermediate step wakes nobody. ``reason`` is set once, by the transition into
    FAILED, and never changes afterwards. ``since`` is the ``clock()`` reading at the
    last change of state (timeouts are measured from it).
    """

    def __init__(self, *, name: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self._clock = clock
        self._lock = threading.RLock()
        self._waiters: list[tuple[frozenset[Status], Latch]] = []
        self._state = Status.BOOTSTRAPPING
        self._reason: str | None = None
        self._since = clock()

    def __repr__(self) -> str:
        why = f" ({self._reason})" if self._reason else ""
        return f"<StateMachine {self.name or hex(id(self))}: {self._state.value}{why}>"

    @property
    def state(self) -> Status:
        return self._state

    @property
    def reason(self) -> str | None:
        return self._reason

    @property
    def since(self) -> float:
        return self._since

    @property
    def terminal(self) -> bool:
        return self._state in TERMINAL

    def fire(self, event: Event, reason: str | None = None) -> Status:
        """Apply ``event`` and return the new state.

        Raises :class:`~kvhandoff.protocol.LocalProtocolError` when the table has no
        rule for (current state, event); the state is then unchanged. ``reason`` is
        recorded only by a transition into FAILED."""
        with self._lock:
            old = self._state
            new = TRANSITIONS.get((old, event))
            if new is None:
                why = f" ({self._reason})" if self._reason else ""
                raise LocalProtocolError(
                    f"{self.name or 'request'}: event {event.value} is illegal in state "
                    f"{old.value}{why}"
                )
            if new is Status.FAILED and self._reason is None:
                self._reason = reason or _DEFAULT_REASON.get(event, event.value)
            if new is not old:
                self._state = new
                self._since = self._clock()
                for want, ev in self._waiters:  # only those waiting for this state
                    if new in want:
                        ev.set()
            return new

    def fail(self, reason: str, *, event: Event = Event.FAIL) -> bool:
        """Move to FAILED unless already terminal. Returns True when this call did it.

        For racing failure paths (timeout vs. peer loss vs. abort): the first one wins,
        and a request that already succeeded stays succeeded."""
        if event not in _DEFAULT_REASON:
            raise ValueError(f"fail() takes FAIL or ABORT, got {event.value}")
        with self._lock:
            if self._state in TERMINAL:
                return False
            self.fire(event, reason)
            return True

    def wait(self, states: Status | Iterable[Status], timeout: float | None = None) -> Status:
        """Block until the state is one of ``states`` or terminal, or ``timeout`` seconds
        pass; return the state at that moment (check it: a timeout returns whatever
        the state is)."""
        want = frozenset({states} if isinstance(states, Status) else states) | TERMINAL
        entry = (want, Latch())
        with self._lock:
            if self._state in want:
                return self._state
            self._waiters.append(entry)
        try:
            entry[1].wait(timeout)
        finally:
            with self._lock:
                self._waiters.remove(entry)
        return self._state
