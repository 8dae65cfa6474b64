"""What the sans-IO request cores share: the effects both return and their status keeping.

A request core (:class:`~kvhandoff.session.request.send_core.SendCore`,
:class:`~kvhandoff.session.request.recv_core.RecvCore`) holds every decision of one side of one
request. It does no I/O, takes no lock, reads no clock and starts no thread: each event
is a method call (the time passed in where a rule needs it) that returns the effects the
shell must carry out, **in order**. Effects common to both sides:

========================  ===================================================================
``Post(endpoint, msg)``   queue a control message for ``endpoint``
``Fire(event)``           mirror a status change (never into FAILED) on the shell's machine
``Fail(error)``           the request failed with ``error`` (the first failure only)
``Mark(name)``            stamp the request's timeline
========================  ===================================================================

The core's :attr:`CoreBase.status` is the truth; the shell's
:class:`~kvhandoff.session.request.status.StateMachine` mirrors it through ``Fire``/``Fail`` so
that engine threads can wait on it. Transitions follow
:data:`~kvhandoff.session.request.status.TRANSITIONS`, the same table.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from kvhandoff.protocol import LocalProtocolError, Message, RankId, RequestId
from kvhandoff.session.config import SessionConfig
from kvhandoff.session.errors import RequestAborted, SessionError
from kvhandoff.session.request.status import TERMINAL, TRANSITIONS, Event, Status


@dataclass(frozen=True, slots=True)
class Post:
    endpoint: str
    msg: Message


@dataclass(frozen=True, slots=True)
class Fire:
    event: Event


@dataclass(frozen=True, slots=True)
class Fail:
    error: SessionError

    @property
    def event(self) -> Event:
        """ABORT for an abort, else FAIL (what the status machine is told)."""
        return Event.ABORT if isinstance(self.error, RequestAborted) else Event.FAIL


@dataclass(frozen=True, slots=True)
class Mark:
    name: str


class RankFacts(Protocol):
    """What a core reads of its rank (a :class:`~kvhandoff.session.request.host.RankHost` is one;
    a test passes a plain record). Read when a rule needs it, never written."""

    @property
    def rank_id(self) -> RankId: ...

    @property
    def config(self) -> SessionConfig: ...


class CoreBase:
    """Status, failure and counters of one side of one request; the effect buffer.

    Subclasses append effects with :meth:`_emit` while they handle an event and hand
    them back with :meth:`_take`. Not thread-safe: the shell calls it under its lock."""

    def __init__(self, *, request_id: RequestId, facts: RankFacts, created: float) -> None:
        self.request_id = request_id
        self._facts = facts
        self.created = created
        self.status = Status.BOOTSTRAPPING
        self.error: SessionError | None = None
        self.nbytes = 0  # bytes seen land (written / reported written)
        self.events: Counter[str] = Counter()  # notable events, for reports
        self._out: list[object] = []

    @property
    def rank(self) -> RankId:
        """This rank's id, as its messages name it."""
        return self._facts.rank_id

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def reason(self) -> str | None:
        return None if self.error is None else str(self.error)

    def _emit(self, effect: object) -> None:
        self._out.append(effect)

    def _take(self) -> list[object]:
        out, self._out = self._out, []
        return out

    def _fire(self, event: Event) -> None:
        new = TRANSITIONS.get((self.status, event))
        if new is None:
            raise LocalProtocolError(f"request {self.request_id!r}: event {event.value} is "
                                     f"illegal in state {self.status.value}")
        if new is not self.status:
            self.status = new
            self._emit(Fire(event))

    def _mark_failed(self, error: SessionError) -> bool:
        """Move to FAILED with ``error``; False when already terminal (the first
        failure stays, and a success stays a success)."""
        if self.terminal:
            return False
        self.status, self.error = Status.FAILED, error
        self._emit(Fail(error))
        return True
