"""The soak's verdicts: pure functions of what the workers answered.

:class:`Record` is one request as the parent saw it (its spec, each side's
:class:`~kvhandoff.lab.soak.worker.Ended` or that the side's process died with it in flight);
:func:`summarise` turns the records, the workers' leak reports, the block accounting and
the RSS samples into a :class:`Summary`, whose :meth:`Summary.invariants` are what a soak
must keep:

* ``no wrong bytes as success`` — every decode ``SUCCESS`` was checked against the fill and
  no byte differed;
* ``every request ended`` — every side whose process lived through the request answered a
  terminal status within the job's limit (none ``hung``, none silent);
* ``no leaks`` — the surviving workers hold no request, no ``kvh-*`` thread, no extra
  descriptor or socket after closing their agents, and every page block came back;
* ``memory bounded`` — no worker's RSS in the second half of its life exceeds
  :data:`RSS_GROWTH` x its first-half peak plus :data:`RSS_SLACK` bytes.

Anything else worth knowing (prefill ``SUCCESS`` whose decode failed or died, flips caught
by the checksum, releases without acknowledgement) is counted, not judged.
:func:`detection` measures how long each fault took to surface on the survivors.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvhandoff.lab.soak.messages import Ended, Leaks
from kvhandoff.lab.soak.plan import ChaosEvent, Fault, RequestSpec

RSS_GROWTH = 1.5
RSS_SLACK = 64 << 20


@dataclass(slots=True, kw_only=True)
class Record:
    """One request: its spec, when it was handed out, and each side's end."""

    spec: RequestSpec
    dispatched: float
    limit: float
    prefill: Ended | None = None
    decode: Ended | None = None
    prefill_died: bool = False  # the prefill worker died with the request in flight
    decode_died: bool = False

    @property
    def done(self) -> bool:
        return ((self.prefill is not None or self.prefill_died)
                and (self.decode is not None or self.decode_died))


@dataclass(frozen=True, slots=True, kw_only=True)
class Blocks:
    """The parent's page-block accounting at the end."""

    total: int
    free: int
    quarantined: int  # not reused: released without acknowledgement, or writes not settled
    in_flight: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Summary:
    requests: int
    decode_status: dict[str, int]
    prefill_status: dict[str, int]
    checked_bytes: int
    wrong_success: list[str]  # rids: decode SUCCESS with a wrong byte (or none checked)
    unended: list[str]  # "rid (side): why"
    prefill_success_decode_failed: int
    prefill_success_decode_died: int
    flips: int
    flips_caught: int  # decode failed with a checksum (crc) mismatch after the flip
    unacked_releases: int
    side_deaths: int  # request sides lost with a killed process
    leaks: list[str]
    rss: dict[str, dict[str, float]]  # worker → first-half / second-half peak MiB
    rss_problems: list[str]
    by_transport: dict[str, dict[str, int]] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)  # decode failures, by kind
    split_reasons: dict[str, int] = field(default_factory=dict)  # prefill success, decode not

    def invariants(self) -> dict[str, bool]:
        return {"no wrong bytes as success": not self.wrong_success,
                "every request ended": not self.unended,
                "no leaks": not self.leaks,
                "memory bounded": not self.rss_problems}

    @property
    def ok(self) -> bool:
        return all(self.invariants().values())


def _count(values: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


_ID = re.compile(r"'?soak-\d+-\d+'?")
_NUM = re.compile(r"0x[0-9a-f]+|\d+(\.\d+)?")


def reason_kind(reason: str) -> str:
    """A failure reason with the request id and numbers taken out, so like ones count
    together."""
    first = reason.strip().splitlines()[0] if reason.strip() else "(no reason)"
    return _NUM.sub("N", _ID.sub("<rid>", first))[:120]


def wrong_success(rec: Record) -> bool:
    """Decode said ``SUCCESS`` but a byte differs from the fill (or none was checked)."""
    d = rec.decode
    return d is not None and d.status == "success" and (d.wrong_bytes > 0
                                                        or d.checked_bytes == 0)


def unended(rec: Record) -> list[str]:
    """The sides of ``rec`` that owe a terminal status, with why."""
    out = []
    for side, end, died in (("prefill", rec.prefill, rec.prefill_died),
                            ("decode", rec.decode, rec.decode_died)):
        if end is None and not died:
            out.append(f"{rec.spec.rid} ({side}): no answer")
        elif end is not None and end.status == "hung":
            out.append(f"{rec.spec.rid} ({side}): no terminal status within {rec.limit:g} s")
    return out


def leak_problems(leaks: Sequence[Leaks], missing: Sequence[str], blocks: Blocks) -> list[str]:
    """What the survivors and the block accounting left behind."""
    out = [f"{w}: gave no leak report" for w in missing]
    for lk in leaks:
        who = f"{lk.role}{lk.index}"
        if lk.live_requests:
            out.append(f"{who}: {lk.live_requests} requests still live in its agents")
        if lk.threads:
            out.append(f"{who}: threads left: {lk.threads}")
        if lk.fds or lk.sockets:
            out.append(f"{who}: {lk.fds} descriptors ({lk.sockets} sockets) above baseline")
        if lk.request_threads:
            out.append(f"{who}: {lk.request_threads} request threads still running")
    if blocks.in_flight:
        out.append(f"{blocks.in_flight} page blocks still held by requests")
    if blocks.free + blocks.quarantined != blocks.total:
        out.append(f"page blocks: {blocks.free} free + {blocks.quarantined} quarantined "
                   f"!= {blocks.total}")
    return out


def rss_check(samples: Mapping[str, Sequence[tuple[float, int]]]
              ) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Per worker life (``(t, rss bytes)`` samples): first- and second-half peaks in MiB,
    and the lives whose second half outgrew the bound."""
    table: dict[str, dict[str, float]] = {}
    problems = []
    for who, ss in samples.items():
        if len(ss) < 4:
            continue
        half = len(ss) // 2
        first, second = max(r for _, r in ss[:half]), max(r for _, r in ss[half:])
        table[who] = {"first_half_mib": round(first / 2**20, 1),
                      "second_half_mib": round(second / 2**20, 1)}
        if second > RSS_GROWTH * first + RSS_SLACK:
            problems.append(f"{who}: RSS grew from {first / 2**20:.0f} MiB to "
                            f"{second / 2**20:.0f} MiB")
    return table, problems


def summarise(records: Sequence[Record], leaks: Sequence[Leaks], missing: Sequence[str],
              blocks: Blocks, rss: Mapping[str, Sequence[tuple[float, int]]],
              other_leaks: Sequence[str] = ()) -> Summary:
    """The verdicts. ``missing``: workers that gave no leak report; ``other_leaks``: what
    else was left behind (e.g. registrations the bootstrap server still holds)."""
    dec = [r.decode.status if r.decode else "died" for r in records]
    pre = [r.prefill.status if r.prefill else "died" for r in records]
    by_transport: dict[str, dict[str, int]] = {}
    for r, d in zip(records, dec, strict=True):
        row = by_transport.setdefault(r.spec.transport, {})
        row[d] = row.get(d, 0) + 1
    flipped = [r for r in records if r.prefill is not None and r.prefill.flipped]
    table, rss_problems = rss_check(rss)
    return Summary(
        requests=len(records), decode_status=_count(dec), prefill_status=_count(pre),
        checked_bytes=sum(r.decode.checked_bytes for r in records if r.decode),
        wrong_success=[r.spec.rid for r in records if wrong_success(r)],
        unended=[u for r in records for u in unended(r)],
        prefill_success_decode_failed=sum(
            1 for r in records if r.prefill and r.prefill.status == "success"
            and r.decode and r.decode.status == "failed"),
        prefill_success_decode_died=sum(
            1 for r in records if r.prefill and r.prefill.status == "success"
            and r.decode_died),
        flips=len(flipped),
        flips_caught=sum(1 for r in flipped if r.decode and r.decode.status == "failed"
                         and "crc" in r.decode.reason.lower()),
        unacked_releases=sum(1 for r in records if r.decode and not r.decode.settled),
        side_deaths=sum(r.prefill_died + r.decode_died for r in records),
        leaks=[*leak_problems(leaks, missing, blocks), *other_leaks], rss=table,
        rss_problems=rss_problems,
        by_transport=dict(sorted(by_transport.items())),
        reasons=_by_count([reason_kind(r.decode.reason) for r in records
                           if r.decode and r.decode.status == "failed"]),
        split_reasons=_by_count([reason_kind(r.decode.reason) for r in records
                                 if r.prefill and r.prefill.status == "success"
                                 and r.decode and r.decode.status == "failed"]))


def _by_count(values: Sequence[str]) -> dict[str, int]:
    return dict(sorted(_count(values).items(), key=lambda kv: -kv[1]))


@dataclass(frozen=True, slots=True, kw_only=True)
class Detection:
    """How one kind of fault surfaced on the surviving side."""

    kind: str  # e.g. "kill decode"
    faults: int
    affected: int  # requests in flight with the victim when the fault hit
    failed: int  # ... that the survivor failed
    median_s: float | None  # fault → survivor's FAILED
    max_s: float | None
    bound_s: float  # the configured timeout that should bound it
    reasons: dict[str, int] = field(default_factory=dict)  # the survivors' failures, by kind


def detection(events: Sequence[ChaosEvent], times: Mapping[int, float],
              records: Sequence[Record], bound: float) -> list[Detection]:
    """Per fault kind: the requests the victim was serving while the fault lasted
    (``times[i]``: when event ``i`` happened, monotonic; it lasted ``hold`` seconds), and
    how long the survivor took to fail them, from the fault or the request's start,
    whichever is later."""
    groups: dict[str, tuple[list[int], list[float]]] = {}
    why: dict[str, list[str]] = {}
    for i, ev in enumerate(events):
        at = times.get(i)
        kind = f"{ev.fault.value} {ev.role}"
        count, delays = groups.setdefault(kind, ([0, 0], []))
        reasons = why.setdefault(kind, [])
        if at is None:
            continue
        count[0] += 1
        for r in records:
            if ev.fault is Fault.CUT:  # both sides live on; decode's view of the request
                hit, survivor = r.spec.lane, r.decode
            else:
                victim = r.spec.prefill if ev.role == "prefill" else r.spec.decode
                hit = victim == ev.worker and not r.spec.lane
                survivor = r.decode if ev.role == "prefill" else r.prefill
            # in flight when the fault hit, or started while it lasted (a frozen worker
            # still takes requests; a cut link still has requests sent over it)
            if not hit or survivor is None or survivor.started > at + ev.hold:
                continue
            if survivor.ended < at or (r.spec.abort is not None):
                continue
            count[1] += 1
            if survivor.status == "failed":  # its status, not its later release
                seen = survivor.status_at or survivor.ended
                delays.append(seen - max(at, survivor.started))
                reasons.append(reason_kind(survivor.reason))
    out = []
    for kind, ((faults, affected), delays) in sorted(groups.items()):
        out.append(Detection(kind=kind, faults=faults, affected=affected, failed=len(delays),
                             median_s=round(statistics.median(delays), 3) if delays else None,
                             max_s=round(max(delays), 3) if delays else None, bound_s=bound,
                             reasons=_count(why[kind])))
    return out
