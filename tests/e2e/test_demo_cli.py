"""``kvhandoff demo`` end to end: separate prefill and decode processes over tcp."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvhandoff import cli

SMALL = ["demo", "--model", "qwen3_next", "--prefill-tp", "2", "--decode-tp", "1",
         "--requests", "2", "--max-new-tokens", "4", "--chunk", "8"]


def test_demo_hands_off_and_matches_colocated(capsys: pytest.CaptureFixture[str],
                                              tmp_path: object) -> None:
    out = f"{tmp_path}/demo.json"
    assert cli.main([*SMALL, "--json", out]) == 0
    text = capsys.readouterr().out
    assert "prefill TP 2 → decode TP 1 over tcp" in text
    assert text.count("tokens equal ✓") == 2 and "2/2 requests" in text and "✗" not in text
    with open(out) as f:
        assert '"ok": true' in f.read()


def test_demo_fails_on_a_corrupted_byte(capsys: pytest.CaptureFixture[str]) -> None:
    # decode flips one received KV byte before rebuilding its cache: the check must fail
    assert cli.main([*SMALL, "--corrupt", "kv"]) == 1
    text = capsys.readouterr().out
    assert "MISMATCH ✗" in text and "0/2 requests" in text
