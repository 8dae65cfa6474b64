"""A finished handoff's figures on one rank, measured once from its timeline.

Every place that reports a handoff reads these and nothing else: kvhandoff's own
Prometheus metrics (:mod:`~kvhandoff.observe.metrics`) and trace lines, vLLM's connector
stats and SGLang's ``get_transfer_metric``. So a phase means the same span everywhere
(:data:`~kvhandoff.observe.timeline.PHASES`), and a byte count the same bytes. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from kvhandoff.observe import timeline as tl

SUCCESS = "success"
"""The outcome of a handoff that succeeded; any other outcome is an error class name."""


class Finished(Protocol):
    """What a finished request tells its reporter (a Sender or a Receiver)."""

    @property
    def request_id(self) -> int | str: ...

    @property
    def timeline(self) -> tl.Timeline: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def failure(self) -> str | None:
        """The error class name, or None after a success."""

    @property
    def events(self) -> Mapping[str, int]:
        """Notable events (:data:`~kvhandoff.observe.metrics.EVENTS`)."""

    @property
    def component_bytes(self) -> Mapping[str, int]: ...

    @property
    def peers(self) -> list[str]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Figures:
    """One finished handoff on one rank.

    ``seconds``: opened to settled (prefill) or landed (decode), successes only;
    ``phases``: the role's phases it went through; ``nbytes`` and ``component_bytes``:
    what it moved (per component when known); ``outcome``: :data:`SUCCESS` or the error
    class name (a bounded set, fit for a label)."""

    role: str
    outcome: str
    seconds: float | None = None
    phases: Mapping[str, float] = field(default_factory=dict)
    nbytes: int = 0
    component_bytes: Mapping[str, int] = field(default_factory=dict)
    events: Mapping[str, int] = field(default_factory=dict)

    @property
    def success(self) -> bool:
        return self.outcome == SUCCESS

    @property
    def transfer_seconds(self) -> float | None:
        """The ``transfer`` phase (prefill: its writes; decode: indices out to landed)."""
        return self.phases.get("transfer")


def measure(role: str, timeline: tl.Timeline, *, nbytes: int, reason: str | None,
            events: Mapping[str, int] | None = None,
            component_bytes: Mapping[str, int] | None = None) -> Figures:
    """The figures of a handoff that ended with ``reason`` (None: success). With
    ``component_bytes`` (an engine's own count per component) ``nbytes`` is their sum."""
    if component_bytes is not None:
        nbytes = sum(component_bytes.values())
    if reason is not None:
        return Figures(role=role, outcome=reason, events=dict(events or {}))
    return Figures(role=role, outcome=SUCCESS,
                   seconds=timeline.span(tl.OPENED, tl.END[role]),
                   phases=tl.phase_seconds(role, timeline), nbytes=nbytes,
                   component_bytes=dict(component_bytes or {}), events=dict(events or {}))


def figures(role: str, side: Finished, *,
            component_bytes: Mapping[str, int] | None = None) -> Figures:
    """:func:`measure` of a finished Sender or Receiver (``component_bytes`` overrides
    what the side counted, e.g. an engine's blocks on decode, where a Receiver does not
    count per component)."""
    return measure(role, side.timeline, nbytes=side.nbytes, reason=side.failure,
                   events=side.events,
                   component_bytes=(side.component_bytes or None) if component_bytes is None
                   else component_bytes)
