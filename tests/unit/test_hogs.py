"""The CPU-hog runner behind ``make test-stress``: runs the command K times, stops at the
first failure, and leaves no hog behind."""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

from kvhandoff.lab.testing.hogs import run


def test_every_run_passes_and_the_hogs_are_gone() -> None:
    assert run([sys.executable, "-c", "pass"], hogs=1, runs=2) == 0
    assert not [p for p in mp.active_children() if p.name.startswith("kvh-hog")]


def test_the_first_failure_stops_the_runs(tmp_path: Path) -> None:
    count = tmp_path / "runs"
    script = (f"import pathlib, sys; p = pathlib.Path({str(count)!r}); "
              "p.write_text(p.read_text() + 'x' if p.exists() else 'x'); sys.exit(3)")
    assert run([sys.executable, "-c", script], hogs=0, runs=3) == 3
    assert count.read_text() == "x"
