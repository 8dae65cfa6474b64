"""The per-request timeline: first stamp wins, spans need both ends."""

from __future__ import annotations

import itertools

from kvhandoff.observe import timeline as tl


def _clock() -> tl.Timeline:
    ticks = itertools.count(10.0, 0.5)  # 10.0 (opened), 10.5, 11.0, ...
    return tl.Timeline(clock=lambda: next(ticks))


def test_the_first_stamp_of_an_event_wins() -> None:
    t = _clock()
    t.mark(tl.WRITE)  # 10.5
    t.mark(tl.WRITE)  # a second write does not move it
    t.mark(tl.WRITTEN)  # 11.5 (the clock advanced for the ignored stamp too)
    assert t.at(tl.WRITE) == 10.5
    assert t.span(tl.WRITE, tl.WRITTEN) == 1.0
    assert t.span(tl.OPENED, tl.WRITTEN) == 1.5


def test_a_span_is_none_until_both_events_happened() -> None:
    t = _clock()
    assert t.span(tl.OPENED, tl.LANDED) is None
    assert t.span(tl.ASKED, tl.OPENED) is None
    assert t.at(tl.ASKED) is None


def test_relative_lists_events_in_the_order_they_happened() -> None:
    t = _clock()
    t.mark(tl.ASKED)
    t.mark(tl.LANDED)
    assert list(t.relative().items()) == [(tl.OPENED, 0.0), (tl.ASKED, 0.5),
                                          (tl.LANDED, 1.0)]


def test_an_event_may_be_stamped_with_a_time_of_its_own() -> None:
    t = _clock()  # opened at 10.0
    t.mark(tl.WRITE, at=10.25)  # e.g. when the transport began moving the bytes
    t.mark(tl.WRITE, at=12.0)  # the first stamp still wins
    assert t.at(tl.WRITE) == 10.25


def test_the_earliest_of_out_of_order_stamps_wins() -> None:
    t = _clock()
    t.mark_earliest(tl.WRITE, 11.0)  # the second write's start, reported first
    t.mark_earliest(tl.WRITE, 10.5)  # the first write's, reported later
    t.mark_earliest(tl.WRITE, 10.75)
    assert t.at(tl.WRITE) == 10.5
