"""What a Sender and a Receiver share: one request's identity, status and failure.

Each side of a request owns a :class:`~kvhandoff.session.status.StateMachine` and, once
failed, the error that failed it; the engine reads both the same way on either side.
Its rank's agent is a :class:`~kvhandoff.session.host.RankHost`: the request never
imports the agent."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from kvhandoff.observe.timeline import Timeline
from kvhandoff.protocol import RequestId
from kvhandoff.session.errors import RequestAborted, SessionError
from kvhandoff.session.host import RankHost
from kvhandoff.session.status import Event, StateMachine, Status


class RequestSide:
    """One rank's view of one request (base of :class:`Sender` and :class:`Receiver`)."""

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
        self._error: SessionError | None = None
        self.timeline = Timeline()  # when this request reached each event on this rank
        self.nbytes = 0  # bytes this rank's side has seen land (written / reported written)
        # notable events, for reports: "rehandshake", "refused_write", "checksum_mismatch"
        self.events: Counter[str] = Counter()
        self.component_bytes: Counter[str] = Counter()  # bytes planned per component
        self._created = time.monotonic()

    @property
    def peers(self) -> list[str]:
        """The ranks of the other side this request dealt with (``instance/tpN``)."""
        return []

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
        return self._error

    @property
    def reason(self) -> str | None:
        return self._sm.reason

    @property
    def failure(self) -> str | None:
        """The class name of the error that failed the request (None: it did not fail)."""
        return None if self._error is None else type(self._error).__name__

    def _mark_failed(self, error: SessionError) -> bool:
        """Move to FAILED (an abort as ABORT) with ``error`` and log it in the subclass's
        module logger; False when the request had already ended (the first reason
        stays). Caller holds the request lock and does its side's clean-up after."""
        event = Event.ABORT if isinstance(error, RequestAborted) else Event.FAIL
        if not self._sm.fail(str(error), event=event):
            return False
        self._error = error
        logging.getLogger(type(self).__module__).info("%s failed: %s", self, error)
        return True
