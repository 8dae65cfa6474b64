"""Timelines with a fake clock, for tests of what is measured from them."""

from __future__ import annotations

import itertools

from kvhandoff.observe import timeline as tl


def ticking(role: str, step: float = 0.001) -> tl.Timeline:
    """A timeline of ``role`` that went through every phase, each event ``step`` seconds
    after the one before (on a clock that ticks once per reading)."""
    ticks = itertools.count(0.0, step)
    t = tl.Timeline(clock=lambda: next(ticks))
    for event in tl.ORDER[role][1:]:
        t.mark(event)
    return t
