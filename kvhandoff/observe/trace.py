"""Per-request traces: one JSON line per finished request and rank, opt-in.

``KVHANDOFF_TRACE=PATH`` (or :class:`TraceWriter` directly) appends, for every request a
rank finishes, what is needed to draw its timeline::

    {"at": 1764080000.123, "role": "prefill", "request": "r-17", "rank": "p0/tp0",
     "transport": "tcp", "peers": ["d0"], "outcome": "success", "reason": null,
     "bytes": {"kv": 1048576, "mamba": 73728},
     "events": {"opened": 0.0, "indices": 0.0021, "write": 0.0023, ...},
     "phases": {"wait_indices": 0.0021, "prepare": 0.0002, ...}}

``at`` is the wall-clock time the request opened (seconds since the epoch); ``events``
are seconds since then; ``phases`` as in :data:`kvhandoff.observe.timeline.PHASES`.
:func:`read` loads a file back (skipping a torn last line, as a killed process may
leave), :func:`render` draws requests as a PNG (``kvhandoff trace FILE``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvhandoff.errors import MissingExtra
from kvhandoff.observe import timeline as tl

ENV = "KVHANDOFF_TRACE"


class TraceWriter:
    """Appends trace lines to ``path`` (thread-safe; one ``write`` per line)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> TraceWriter | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def write(self, *, role: str, request: object, rank: str, transport: str,
              timeline: tl.Timeline, outcome: str, reason: str | None,
              nbytes: Mapping[str, int], peers: Sequence[str] = ()) -> None:
        events = timeline.relative()
        opened = timeline.at(tl.OPENED) or 0.0
        line = {
            "at": time.time() - (time.monotonic() - opened), "role": role,
            "request": str(request), "rank": rank, "transport": transport,
            "peers": sorted(peers), "outcome": outcome, "reason": reason,
            "bytes": dict(nbytes), "events": events,
            "phases": tl.phase_seconds(role, timeline),
        }
        data = json.dumps(line) + "\n"
        with self._lock, self.path.open("a") as f:
            f.write(data)


def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete trace line of ``path``."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line a killed writer left half written
        if isinstance(row, dict) and "events" in row:
            out.append(row)
    return out


def render(rows: Sequence[Mapping[str, Any]], png: str | os.PathLike[str], *,
           title: str = "kvhandoff requests") -> None:
    """One bar per request and rank, one coloured segment per phase, on a common
    wall-clock axis (ms since the first request opened)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingExtra("matplotlib", extra="plot", needed_by="drawing a trace") from e

    if not rows:
        raise ValueError("no trace lines to draw")
    t0 = min(float(r["at"]) for r in rows)
    names = [p for role in ("prefill", "decode") for p, _, _ in tl.PHASES[role]]
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(dict.fromkeys(names))}
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    labels, seen = [], set()
    for y, r in enumerate(rows):
        base = (float(r["at"]) - t0) * 1e3
        ev = r["events"]
        for phase, a, b in tl.PHASES[r["role"]]:
            if a in ev and b in ev:
                ax.barh(y, (ev[b] - ev[a]) * 1e3, left=base + ev[a] * 1e3,
                        color=colors[phase], label=None if phase in seen else phase)
                seen.add(phase)
        mark = "" if r["outcome"] == "success" else f" ✗ {r.get('reason') or ''}"
        labels.append(f"{r['role']} {r['request']} {r['rank']}{mark}")
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first request opened")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(path: str, out: str | None, requests: Sequence[str] | None) -> int:
    """``kvhandoff trace FILE``: 0 once the PNG is written, 2 when nothing matched."""
    rows = read(path)
    if requests:
        rows = [r for r in rows if r["request"] in set(requests)]
    if not rows:
        print(f"trace: no request in {path}" + (f" matching {requests}" if requests else ""))
        return 2
    png = out or f"{path}.png"
    render(rows, png, title=f"{len(rows)} request sides from {Path(path).name}")
    print(f"wrote {png} ({len(rows)} request sides)")
    return 0
