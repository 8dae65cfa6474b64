"""The soak checker's verdicts on crafted outcomes (no processes, no clock)."""

from __future__ import annotations

from typing import Any

from kvhandoff.lab.soak.checker import (
    Blocks,
    Record,
    detection,
    leak_problems,
    reason_kind,
    rss_check,
    summarise,
)
from kvhandoff.lab.soak.messages import Ended, Leaks
from kvhandoff.lab.soak.plan import Abort, ChaosEvent, Fault, RequestSpec

BLOCKS = Blocks(total=8, free=8, quarantined=0, in_flight=0)


def spec(i: int, **kw: Any) -> RequestSpec:
    return RequestSpec(**{"rid": f"soak-0-{i}", "index": i, "prefill": 0, "decode": 1,
                          "transport": "tcp", "num_tokens": 9, "chunk_pages": 1, **kw})


def ended(role: str, status: str, t: tuple[float, float] = (0.0, 1.0), **kw: Any) -> Ended:
    worker = 0 if role == "prefill" else 1
    checked = 100 if role == "decode" and status == "success" else 0
    return Ended(**{"rid": "x", "role": role, "worker": worker, "status": status,
                    "reason": "", "started": t[0], "ended": t[1],
                    "checked_bytes": checked, **kw})


def rec(i: int, p: Ended | None, d: Ended | None, **kw: Any) -> Record:
    return Record(spec=spec(i), dispatched=0.0, limit=60.0, prefill=p, decode=d, **kw)


def clean_leaks() -> list[Leaks]:
    return [Leaks(role=r, index=i, live_requests=0, threads=[], fds=0, sockets=0,
                  request_threads=0) for r in ("prefill", "decode") for i in range(2)]


def test_a_clean_run_keeps_every_invariant() -> None:
    records = [rec(0, ended("prefill", "success"), ended("decode", "success")),
               rec(1, ended("prefill", "failed"), ended("decode", "failed", reason="x"))]
    sm = summarise(records, clean_leaks(), [], BLOCKS, {})
    assert sm.ok, sm
    assert sm.decode_status == {"failed": 1, "success": 1}
    assert sm.checked_bytes == 100


def test_a_wrong_byte_reported_as_success_is_caught() -> None:
    bad = rec(0, ended("prefill", "success"), ended("decode", "success", wrong_bytes=1))
    unchecked = rec(1, ended("prefill", "success"),
                    ended("decode", "success", checked_bytes=0))
    wrong_but_failed = rec(2, ended("prefill", "success"),
                           ended("decode", "failed", wrong_bytes=0))
    sm = summarise([bad, unchecked, wrong_but_failed], clean_leaks(), [], BLOCKS, {})
    assert sm.wrong_success == ["soak-0-0", "soak-0-1"]
    assert not sm.invariants()["no wrong bytes as success"] and not sm.ok
    assert sm.prefill_success_decode_failed == 1
    assert sm.split_reasons == {"(no reason)": 1}


def test_every_living_side_owes_a_timely_status() -> None:
    records = [rec(0, ended("prefill", "hung"), ended("decode", "failed")),
               rec(1, None, ended("decode", "failed")),  # prefill never answered
               rec(2, None, ended("decode", "failed"), prefill_died=True),  # excused
               rec(3, ended("prefill", "success"), None, decode_died=True)]
    sm = summarise(records, clean_leaks(), [], BLOCKS, {})
    assert sm.unended == ["soak-0-0 (prefill): no terminal status within 60 s",
                          "soak-0-1 (prefill): no answer"]
    assert sm.side_deaths == 2 and sm.prefill_success_decode_died == 1
    assert sm.invariants() == {"no wrong bytes as success": True,
                               "every request ended": False, "no leaks": True,
                               "memory bounded": True}


def test_leaks_name_the_worker_and_what_it_kept() -> None:
    leaky = Leaks(role="decode", index=1, live_requests=2, threads=["kvh-io"], fds=3,
                  sockets=1, request_threads=1)
    out = leak_problems([leaky], ["prefill0"],
                        Blocks(total=8, free=5, quarantined=1, in_flight=1))
    assert out == ["prefill0: gave no leak report",
                   "decode1: 2 requests still live in its agents",
                   "decode1: threads left: ['kvh-io']",
                   "decode1: 3 descriptors (1 sockets) above baseline",
                   "decode1: 1 request threads still running",
                   "1 page blocks still held by requests",
                   "page blocks: 5 free + 1 quarantined != 8"]
    assert leak_problems(clean_leaks(), [], Blocks(total=8, free=7, quarantined=1,
                                                   in_flight=0)) == []
    sm = summarise([], clean_leaks(), [], BLOCKS, {}, ["bootstrap server still holds 2"])
    assert sm.leaks == ["bootstrap server still holds 2"] and not sm.ok


def test_memory_is_bounded_by_the_first_half() -> None:
    mib = 2**20
    flat = [(float(t), 100 * mib) for t in range(10)]
    growing = [(float(t), (100 + 40 * t) * mib) for t in range(10)]
    table, problems = rss_check({"decode0.0": flat, "prefill1.2": growing,
                                 "short": flat[:3]})
    assert table["decode0.0"] == {"first_half_mib": 100.0, "second_half_mib": 100.0}
    assert "short" not in table
    assert len(problems) == 1 and problems[0].startswith("prefill1.2: RSS grew")


def test_flips_count_as_caught_only_on_a_checksum_failure() -> None:
    crc = "request 'soak-0-0' chunk 0 from prefill p: component 'kv': decode bytes crc32 " \
          "0x1f, prefill sent 0x2e"
    records = [rec(0, ended("prefill", "success", flipped=True),
                   ended("decode", "failed", reason=crc)),
               rec(1, ended("prefill", "success", flipped=True), ended("decode", "success"))]
    sm = summarise(records, clean_leaks(), [], BLOCKS, {})
    assert (sm.flips, sm.flips_caught) == (2, 1) and sm.ok
    assert sm.reasons == {reason_kind(crc): 1}
    assert "soak-0-0" not in reason_kind(crc) and "0x1f" not in reason_kind(crc)


def test_time_to_detect_counts_the_survivors_of_each_fault() -> None:
    events = (ChaosEvent(at=5.0, fault=Fault.KILL, role="decode", worker=1, hold=1.0),
              ChaosEvent(at=9.0, fault=Fault.FREEZE, role="prefill", worker=0, hold=2.0),
              ChaosEvent(at=12.0, fault=Fault.KILL, role="prefill", worker=1, hold=1.0))
    times = {0: 105.0, 1: 109.0}  # event 2 was skipped (its worker was not up)
    records = [
        # in flight on prefill when decode1 died: failed 3.5 s later
        rec(0, ended("prefill", "failed", (104.0, 108.5)), None, decode_died=True),
        # in flight too, but succeeded (its bytes had landed)
        rec(1, ended("prefill", "success", (104.5, 105.2)), None, decode_died=True),
        # started after the fault was over: not counted
        rec(2, ended("prefill", "failed", (106.5, 107.0)), ended("decode", "failed")),
        # decode survivor of the freeze of prefill0, failed 4 s later
        rec(3, ended("prefill", "failed"), ended("decode", "failed", (108.0, 113.0))),
        # an abort is not a detection
        Record(spec=spec(4, abort=Abort(side="decode", after=0.1)), dispatched=0.0,
               limit=60.0, prefill=ended("prefill", "failed"),
               decode=ended("decode", "failed", (108.0, 110.0))),
    ]
    table = {d.kind: d for d in detection(events, times, records, bound=3.0)}
    kill = table["kill decode"]
    assert (kill.faults, kill.affected, kill.failed, kill.max_s) == (1, 2, 1, 3.5)
    freeze = table["freeze prefill"]
    assert (freeze.faults, freeze.affected, freeze.failed, freeze.median_s) == (1, 1, 1, 4.0)
    assert freeze.reasons == {"(no reason)": 1}
    started_in_freeze = rec(5, ended("prefill", "failed"),
                            ended("decode", "failed", (110.0, 113.5)))
    table2 = {d.kind: d for d in detection(events, times, [*records, started_in_freeze], 3.0)}
    # the status counts, not the release that follows it (up to release_timeout later)
    released_late = rec(6, ended("prefill", "failed"),
                        ended("decode", "failed", (108.0, 118.0), status_at=112.0))
    table3 = {d.kind: d for d in detection(events, times, [*records, released_late], 3.0)}
    assert table3["freeze prefill"].max_s == 4.0
    assert table2["freeze prefill"].affected == 2
    assert table2["freeze prefill"].max_s == 4.0 and table2["freeze prefill"].median_s == 3.75
    skipped = table["kill prefill"]
    assert (skipped.faults, skipped.affected, skipped.median_s) == (0, 0, None)
