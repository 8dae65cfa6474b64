"""The layout-only demo really checks bytes: it passes, and it notices a wrong one.

(The multi-process demo is tested in ``tests/e2e/test_demo_cli.py``.)
"""

from __future__ import annotations

import pytest

from kvhandoff import cli
from kvhandoff import layout_demo as demo
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
    from kvhandoff.demo_worker import prompt_plan

    plan = prompt_plan(5, page_size=4, chunk=16, window=8, vocab=128)
    kinds = [k for k, _ in plan]
    assert kinds == ["short", "aligned", "long", "prefix hit", "short"]
    lens = {k: len(t) for k, t in plan}
    assert lens["short"] % 4 and lens["aligned"] % 4 == 0 and lens["aligned"] >= 32
    assert lens["long"] > 8 and lens["long"] > 2 * 16 and lens["long"] % 4
    long, hit = plan[2][1], plan[3][1]
    assert hit[:16] == long[:16] and hit != long[:len(hit)]
    assert len(hit) - 16 > 8  # the window still comes from prefill
