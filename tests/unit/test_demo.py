"""The layout-only demo really checks bytes: it passes, and it notices a wrong one.

(The multi-process demo is tested in ``tests/e2e/test_demo_cli.py``.)
"""

from __future__ import annotations

import json

import pytest

from kvhandoff.lab import cli
from kvhandoff.lab import layout_demo as demo
from kvhandoff.lab.demo import Row
from kvhandoff.plan.execute import HostMemory


def test_demo_handoff_verifies_every_byte() -> None:
    s = demo.handoff(demo.HYBRID, prefill_tp=2, decode_tp=1, tokens=300, page_size=16)
    assert s.ok and s.verified_bytes == sum(p.nbytes for p in s.pairs) > 0
    assert {c for p in s.pairs for c in p.by_component} == {"kv", "swa", "mamba", "aux"}
    assert "match the oracle ✓" in demo.render(s)


def test_demo_notices_a_corrupted_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    real = demo.execute

    def corrupting(plan: object, src: object, dst: HostMemory) -> int:
        moved = real(plan, src, dst)  # type: ignore[arg-type]
        entry = plan.entries[0]  # type: ignore[attr-defined]
        view = dst.view(entry.dst_ptr + int(entry.dst_idx[0]) * entry.dst_unit)
        view[int(entry.pieces[0, 1])] ^= 0xFF
        return moved

    monkeypatch.setattr(demo, "execute", corrupting)
    s = demo.handoff(demo.HYBRID, prefill_tp=2, decode_tp=1, tokens=100, page_size=16)
    assert not s.ok and s.mismatched_bytes >= 1
    assert "WRONG ✗" in demo.render(s)


def test_cli_demo_exit_code_and_json(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    out = f"{tmp_path}/demo.json"
    assert cli.main(["demo", "--layout-only", "--tokens", "64", "--page-size", "16",
                     "--prefill-tp", "1", "--decode-tp", "2", "--json", out]) == 0
    assert "prefill TP 1 → decode TP 2" in capsys.readouterr().out
    with open(out) as f:
        assert '"ok": true' in f.read()


def test_prompt_plan_covers_the_cases() -> None:
    from kvhandoff.lab.demo_worker import prompt_plan

    plan = prompt_plan(5, page_size=4, chunk=16, window=8, vocab=128)
    kinds = [k for k, _ in plan]
    assert kinds == ["short", "aligned", "long", "prefix hit", "short"]
    lens = {k: len(t) for k, t in plan}
    assert lens["short"] % 4 and lens["aligned"] % 4 == 0 and lens["aligned"] >= 32
    assert lens["long"] > 8 and lens["long"] > 2 * 16 and lens["long"] % 4
    long, hit = plan[2][1], plan[3][1]
    assert hit[:16] == long[:16] and hit != long[:len(hit)]
    assert len(hit) - 16 > 8  # the window still comes from prefill


def test_layout_only_rejects_an_unknown_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--layout-only", "--model", "no-such-shape"]) == 2
    assert "unknown shape 'no-such-shape'" in capsys.readouterr().err


def _row(rid: int) -> Row:
    return Row(rid=rid, kind="short", prompt_tokens=5, pages=2, cached_tokens=0,
               bytes_by_component={"kv": 1024, "aux": 64}, transfer_ms=1.0, tokens=[1, 2],
               colocated=[1, 2], state_equal=True, problem="")


def test_leaked_pools_fail_the_demo_and_are_named(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str],
                                                  tmp_path: object) -> None:
    """Every request matched, but decode's pages were not all freed: exit 1, and the
    output and the JSON name the pool and the count."""
    from kvhandoff.lab import demo as engine_demo

    leaks = {"prefill pages": 0, "decode pages": 3, "decode slots": 1}
    monkeypatch.setattr(engine_demo, "run",
                        lambda opts, progress=None: engine_demo.Outcome([_row(0)], leaks))
    out = f"{tmp_path}/demo.json"
    assert cli.main(["demo", "--requests", "1", "--json", out]) == 1
    text = capsys.readouterr().out
    assert "1/1 requests decode the same tokens" in text
    assert "LEAK ✗ pools still hold ids after the run: decode pages 3, decode slots 1" in text
    assert "prefill pages" not in text
    with open(out) as f:
        data = json.load(f)
    assert data["ok"] is False and data["leaks"]["decode pages"] == 3


def test_empty_pools_pass(monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    from kvhandoff.lab import demo as engine_demo

    monkeypatch.setattr(engine_demo, "run", lambda opts, progress=None: engine_demo.Outcome(
        [_row(0), _row(1)], {"prefill pages": 0, "decode pages": 0}))
    assert cli.main(["demo", "--requests", "2"]) == 0
    assert "prefill and decode pools are empty after the run ✓" in capsys.readouterr().out
