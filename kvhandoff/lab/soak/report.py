"""The soak's result: :class:`Report` (summary, time-to-detect table, faults, problems),
its text tables (:func:`render`) and its JSON (:func:`write_json`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from kvhandoff.lab.soak.checker import Detection, Summary


@dataclass(slots=True)
class Report:
    """One soak run: what was asked, the verdicts, the faults as planned and whether each
    ran, and problems outside the invariants (a worker that could not start or crashed);
    :attr:`ok` needs both clean."""

    settings: dict[str, Any]
    summary: Summary
    detection: list[Detection]
    faults: list[dict[str, Any]]
    problems: list[str] = field(default_factory=list)  # worker start failures, stray deaths
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.summary.ok and not self.problems

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "wall_s": round(self.wall_s, 1), "settings": self.settings,
                "invariants": self.summary.invariants(),
                "summary": dataclasses.asdict(self.summary),
                "detection": [dataclasses.asdict(d) for d in self.detection],
                "faults": self.faults, "problems": self.problems}


def render(rep: Report) -> str:
    """The summary table and the time-to-detect table, as text."""
    sm = rep.summary
    lines = ["", "soak summary", "-" * 64]
    rows = [("requests", str(sm.requests)),
            ("decode statuses", ", ".join(f"{k} {v}" for k, v in sm.decode_status.items())),
            ("prefill statuses", ", ".join(f"{k} {v}" for k, v in sm.prefill_status.items())),
            *((f"  over {t}", ", ".join(f"{k} {v}" for k, v in row.items()))
              for t, row in sm.by_transport.items()),
            ("bytes checked (decode success)", f"{sm.checked_bytes:,}"),
            ("wrong bytes reported as success", str(len(sm.wrong_success))),
            ("requests without a timely status", str(len(sm.unended))),
            ("flipped source bytes / caught", f"{sm.flips} / {sm.flips_caught}"),
            ("prefill success, decode failed", str(sm.prefill_success_decode_failed)),
            ("prefill success, decode died", str(sm.prefill_success_decode_died)),
            ("sides lost with a killed process", str(sm.side_deaths)),
            ("releases without acknowledgement", str(sm.unacked_releases)),
            ("faults run", f"{sum(f['done'] for f in rep.faults)} of {len(rep.faults)}"),
            ("leaks", "; ".join(sm.leaks) or "none"),
            ("RSS peak MiB (1st / 2nd half)", ", ".join(
                f"{w} {v['first_half_mib']:g}/{v['second_half_mib']:g}"
                for w, v in sm.rss.items()))]
    lines += [f"{k:<34} {v}" for k, v in rows]
    for title, table in (("decode failures by reason", sm.reasons),
                         ("prefill success, decode failed: why decode failed",
                          sm.split_reasons)):
        if table:
            lines.append(title)
            lines += [f"  {n:>6}  {k}" for k, n in list(table.items())[:8]]
    lines += ["-" * 64]
    lines += [f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in sm.invariants().items()]
    if rep.problems:
        lines += ["problems:"] + [f"  {p}" for p in rep.problems]
    if rep.detection:
        lines += ["", "time to detect (fault → survivor's FAILED)",
                  f"{'fault':<16}{'faults':>7}{'in flight':>10}{'failed':>8}"
                  f"{'median s':>10}{'max s':>8}{'bound s':>9}"]
        for d in rep.detection:
            med = "-" if d.median_s is None else f"{d.median_s:.2f}"
            mx = "-" if d.max_s is None else f"{d.max_s:.2f}"
            lines.append(f"{d.kind:<16}{d.faults:>7}{d.affected:>10}{d.failed:>8}"
                         f"{med:>10}{mx:>8}{d.bound_s:>9g}")
    return "\n".join(lines)


def write_json(rep: Report, path: str) -> None:
    with open(path, "w") as f:
        json.dump(rep.as_json(), f, indent=2, default=str)
