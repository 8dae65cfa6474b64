"""What a Sender and a Receiver share: one request's identity, status, failure and shell.

Each side of a request is a thin shell around a sans-IO core
(:class:`~kvhandoff.session.request.core.CoreBase`): the shell holds the request's lock,
feeds the core events and carries out the effects it returns, in order (:meth:`_do`).
It owns a :class:`~kvhandoff.session.request.status.StateMachine` that mirrors the core's status,
so that the engine's threads can wait on it. Its rank's agent is a
:class:`~kvhandoff.session.request.host.RankHost`: the request never imports the agent."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping

from kvhandoff.observe.timeline import Timeline
from kvhandoff.protocol import RequestId
from kvhandoff.session.errors import SessionError
from kvhandoff.session.request.core import CoreBase, Fail, Fire, Mark, Post
from kvhandoff.session.request.host import RankHost
from kvhandoff.session.request.status import StateMachine, Status


class RequestSide:
    """One rank's view of one request (base of :class:`Sender` and :class:`Receiver`).

    A subclass sets ``_core`` in its ``__init__`` and carries out its role's own effects
    in :meth:`_carry_out`."""

    _core: CoreBase

    def __init__(self, agent: RankHost, request_id: RequestId, role: str) -> None:
        if agent.role.value != role:
            kind = "Sender" if role == "prefill" else "Receiver"
            raise ValueError(f"a {kind} needs a {role} agent, got a {agent.role.value} agent")
        if isinstance(request_id, bool) or not isinstance(request_id, int | str):
            raise TypeError(f"request_id must be an int or a str, got {request_id!r}")
        self.agent = agent
        self.request_id = request_id
        self._lock = threading.RLock()
        self._sm = StateMachine(name=f"{role} request {request_id!r}")
        self.timeline = Timeline()  # when this request reached each event on this rank
        self._created = time.monotonic()

    @property
    def peers(self) -> list[str]:
        """The ranks of the other side this request dealt with (``instance/tpN``)."""
        return []

    @property
    def component_bytes(self) -> Mapping[str, int]:
        """Bytes planned per component (a Sender's; empty on decode)."""
        return {}

    def _stamp(self, event: str) -> float | None:
        """When ``event``, which the core just reached, really happened, if this side
        knows it was earlier than now (None: now)."""
        del event
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.request_id!r} {self._sm.state.value}>"

    @property
    def status(self) -> Status:
        return self._sm.state

    def poll(self) -> Status:
        """The request's status on this rank now; never blocks."""
        return self._sm.state

    def wait(self, timeout: float) -> Status:
        """Block until SUCCESS or FAILED, or ``timeout`` seconds; returns the status then."""
        return self._sm.wait((Status.SUCCESS, Status.FAILED), timeout)

    @property
    def error(self) -> SessionError | None:
        """Why the request failed (None unless FAILED)."""
        return self._core.error

    @property
    def reason(self) -> str | None:
        return self._sm.reason

    @property
    def failure(self) -> str | None:
        """The class name of the error that failed the request (None: it did not fail)."""
        error = self._core.error
        return None if error is None else type(error).__name__

    @property
    def nbytes(self) -> int:
        """Bytes this rank's side has seen land (written / reported written)."""
        return self._core.nbytes

    @property
    def events(self) -> Counter[str]:
        """Notable events, for reports: "rehandshake", "refused_write", "checksum_mismatch"."""
        return self._core.events

    def _do(self, effects: Iterable[object]) -> None:
        """Carry out ``effects`` in order; what carrying one out returns (the core's
        answer to its result) runs next, before the rest. Caller holds the lock."""
        todo = deque(effects)
        while todo:
            more = self._carry(todo.popleft())
            todo.extendleft(reversed(more))

    def _carry(self, effect: object) -> list[object]:
        match effect:
            case Post(endpoint=endpoint, msg=msg):
                self.agent.post(endpoint, msg)
            case Fire(event=event):
                self._sm.fire(event)
            case Fail(error=error):
                self._sm.fail(str(error), event=effect.event)
                logging.getLogger(type(self).__module__).info("%s failed: %s", self, error)
            case Mark(name=name):
                self.timeline.mark(name, self._stamp(name))
            case _:
                return self._carry_out(effect)
        return []

    def _carry_out(self, effect: object) -> list[object]:
        """Carry out one of the role's own effects; returns the core's answer."""
        raise TypeError(f"{type(self).__name__}: no way to carry out {effect!r}")
