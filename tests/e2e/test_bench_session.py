"""The session benchmark's concurrent rounds, end to end: two spawned processes, a real
bootstrap server and control sockets, every handoff successful, and the JSON it writes
(the numbers are the benchmark's business, not the test's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhandoff.lab.bench import session


def test_throughput_only_runs_every_concurrency_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "session.json"
    assert session.main(["--throughput-only", "--rounds", "4", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "latency" not in res and "big" not in res  # only the rounds ran
    points = res["scaling"]
    assert [p["concurrent"] for p in points] == list(session.CONCURRENCY)
    assert [p["rounds"] for p in points] == [4, 3, 3]  # 64: as asked; the others >= 3
    assert res["throughput"] == points[0]
    for p in points:
        assert p["failures"] == [], p["failures"]
        assert p["handoffs_per_s"] > 0 and p["raw_transport_requests_per_s"] > 0
        assert abs(p["ratio"] - p["handoffs_per_s"] / p["raw_transport_requests_per_s"]) < 1e-9


def test_rounds_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        session.main(["--throughput-only", "--rounds", "0"])
    assert e.value.code == 2
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
