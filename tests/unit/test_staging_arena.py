"""The staging arena's slot count in use (what kvhandoff_staging_slots_in_use reports)."""

from __future__ import annotations

from kvhandoff.transport.staging import Arena


def test_leased_and_quarantined_slots_are_in_use_until_free() -> None:
    a = Arena(4, 4096)
    assert a.in_use == 0
    got = a.lease(3)
    assert len(got) == 3 and a.in_use == 3
    a.give_back(got[:1])
    assert a.in_use == 2
    a.quarantine(got[1:2], 600.0)  # a late write may still reach it: held, not free
    assert a.in_use == 2 and a.quarantined == 1
    assert len(a.lease(10)) == 2 and a.in_use == 4  # the free ones only
