"""When one request reached each point of its handoff on one rank.

A :class:`~kvhandoff.session.request.sender.Sender` or
:class:`~kvhandoff.session.request.receiver.Receiver`
stamps named events as they happen, on whichever thread sees them; the first stamp of an
event wins, so a retried or repeated step does not move it. Readers take the seconds
between two events (:meth:`Timeline.span`), which is how a host measures a phase
exactly instead of from when it happened to poll::

    prefill   opened ─ indices ─ write ─ moving ─ moved ─ written ─ settled
    decode    opened ─ asked ───────────────────────────── landed

* ``indices``: decode's indices reached prefill (the first of its ranks' inits);
* ``write`` … ``written``: prefill's first transport write submitted … its last one
  acknowledged by the transport (the bytes are in decode's memory);
* ``moving`` … ``moved``: the same writes timed where the bytes move. A transport whose
  receiver pulls (cma) reports the receiver's own span, from having a write's frame to
  its last byte pulled, which leaves out the two wake-ups around it (the frame reaching
  the receiver, its reply reaching prefill); for every other transport they are
  ``write`` and ``written``;
* ``asked``: decode posted its indices (the first rank's init);
* ``landed``: decode verified the last status and the arrival guard (SUCCESS).

Pure bookkeeping: no locks (a dict's ``setdefault`` is atomic), no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

OPENED = "opened"
INDICES = "indices"
WRITE = "write"
WRITTEN = "written"
MOVING = "moving"
MOVED = "moved"
SETTLED = "settled"
ASKED = "asked"
LANDED = "landed"


class Timeline:
    """Named events, each with the monotonic time it first happened."""

    __slots__ = ("_at", "_clock")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._at: dict[str, float] = {OPENED: clock()}

    def mark(self, event: str, at: float | None = None) -> None:
        """Stamp ``event`` now (or ``at``, a time of this timeline's clock), unless it
        already happened."""
        self._at.setdefault(event, self._clock() if at is None else at)

    def mark_earliest(self, event: str, at: float) -> None:
        """Stamp ``event`` at ``at`` unless it was stamped earlier (for events reported
        out of order, such as writes that complete in another order than they began)."""
        old = self._at.get(event)
        if old is None or at < old:
            self._at[event] = at

    def at(self, event: str) -> float | None:
        """When ``event`` happened (monotonic seconds), or None."""
        return self._at.get(event)

    def span(self, first: str, last: str) -> float | None:
        """Seconds from ``first`` to ``last``; None unless both happened."""
        a, b = self._at.get(first), self._at.get(last)
        return None if a is None or b is None else b - a

    def relative(self) -> dict[str, float]:
        """Every event, in seconds since the request opened, in the order they happened."""
        t0 = self._at[OPENED]
        return {k: v - t0 for k, v in sorted(self._at.items(), key=lambda kv: kv[1])}


PHASES: Mapping[str, tuple[tuple[str, str, str], ...]] = {
    "prefill": (("wait_indices", OPENED, INDICES), ("prepare", INDICES, WRITE),
                ("transfer", WRITE, WRITTEN), ("move", MOVING, MOVED),
                ("settle", WRITTEN, SETTLED)),
    "decode": (("bootstrap", OPENED, ASKED), ("transfer", ASKED, LANDED)),
}
"""Per role, the phases of a handoff as (phase, from event, to event): prefill waits for
decode's indices, prepares its first write (``prepare``: the engine's ``send`` if it comes
later, planning, and the transport's own preparation: bounds checks, descriptors, its
queue), writes (``transfer``: from the transport starting to move the first write's bytes
— ``Handle.started`` — until it acknowledged the last write; ``move``: within it, the
bytes moving, timed by the side that moves them — ``Handle.moving`` to ``Handle.moved``,
the span NIXL's ``xferDuration`` covers for its READs) and settles; decode looks prefill
up and handshakes (``bootstrap``), then waits for the bytes and verifies them
(``transfer``: its indices out until SUCCESS)."""

ORDER: Mapping[str, tuple[str, ...]] = {
    "prefill": (OPENED, INDICES, WRITE, MOVING, MOVED, WRITTEN, SETTLED),
    "decode": (OPENED, ASKED, LANDED),
}
"""Per role, its events in the order a handoff reaches them (each at the latest when the
next one is stamped)."""

END: Mapping[str, str] = {"prefill": SETTLED, "decode": LANDED}
"""The event that ends a successful handoff, per role."""


def phase_seconds(role: str, timeline: Timeline) -> dict[str, float]:
    """Each of ``role``'s :data:`PHASES` the request went through, in seconds."""
    out = {}
    for phase, a, b in PHASES[role]:
        s = timeline.span(a, b)
        if s is not None:
            out[phase] = s
    return out
