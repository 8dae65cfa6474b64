"""The busy-engine benchmark end to end: a spawned receiver, both processes' busy loops,
every handoff checked byte-exact once, and the JSON it writes (the timings are the
benchmark's business, not the test's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvhandoff.lab.bench import busy


def test_every_condition_is_measured_and_the_interval_given_back(tmp_path: Path) -> None:
    out = tmp_path / "busy.json"
    before = sys.getswitchinterval()
    assert busy.main(["--transports", "tcp", "--rounds", "1", "--samples", "2",
                      "--json", str(out)]) == 0
    assert sys.getswitchinterval() == before  # the stand-in engine loop is gone
    res = json.loads(out.read_text())
    labels = [label for label, _ in busy.conditions()]
    assert res["conditions"] == labels == ["idle", "busy 5000us", "busy 100us"]
    r = res["results"]["tcp"]
    assert "error" not in r, r["error"]
    for key in ("tiny", "state"):
        assert set(r[key]) == set(labels)
        assert all(r[key][c]["n"] == 2 for c in labels)
        assert all("engine_ms_per_handoff" in r[key][c] for c in labels[1:])
    assert {(v["transport"], v["handoff"]) for v in res["verdicts"]} == \
        {("tcp", "tiny"), ("tcp", "state")}
    assert out.with_suffix(".png").exists()


def test_rounds_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        busy.main(["--rounds", "0"])
    assert e.value.code == 2
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
