"""What an agent asks of its role's desk: the one interface both desks implement.

A rank's role lives in its desk (:class:`~kvhandoff.session.rank.prefill_desk.PrefillDesk`
or :class:`~kvhandoff.session.rank.decode_desk.DecodeDesk`). The shared core of the
agent — its heartbeats, dispatch, counters and closing — talks to either through this
protocol only, so nothing role-neutral asks which desk it holds; what belongs to one
role is a method of that role's agent class
(:class:`~kvhandoff.session.rank.agent.PrefillAgent` /
:class:`~kvhandoff.session.rank.agent.DecodeAgent`).

Thread-safety is each desk's own (see their modules); every method here may be called
from the agent's threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvhandoff.protocol import Message
from kvhandoff.session.control.channel import Origin
from kvhandoff.session.request.host import Backlog, Request


class Desk(Protocol):
    """A role's desk, as the agent's shared core sees it."""

    def attach(self, side: Request) -> Backlog:
        """Take a new request of this role; returns what reached the rank for it first."""
        ...

    def finished(self, side: Request) -> None:
        """The request is over here."""

    def live(self) -> Sequence[Request]:
        """The requests not yet finished here."""
        ...

    def on_message(self, origin: Origin, msg: Message) -> bool:
        """Handle a control message; False when this role does not take it."""
        ...

    def on_tick(self, now: float, in_use: set[str]) -> None:
        """The timer tick (I/O thread); ``in_use``: the live requests' peer endpoints."""

    def peer_lost(self, endpoint: str, reason: str) -> None:
        """Drop the peer at ``endpoint`` (after its requests heard of it)."""

    def close_requests(self) -> Sequence[Request]:
        """Take no more requests; returns the live ones (to fail)."""
        ...

    def close(self) -> None:
        """Release what the desk holds."""

    def counters(self) -> dict[str, int]:
        """This role's counters for :attr:`Agent.stats` (those of the other role read 0)."""
        ...
