"""``kvhandoff demo`` end to end: separate prefill and decode processes over the default
transport (auto: cma between two processes on one host)."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvhandoff.lab import cli
from kvhandoff.lab.demo_worker import pool_leaks

SMALL = ["demo", "--model", "qwen3_next", "--prefill-tp", "2", "--decode-tp", "1",
         "--requests", "2", "--max-new-tokens", "4", "--chunk", "8"]


def test_demo_hands_off_and_matches_colocated(capsys: pytest.CaptureFixture[str],
                                              tmp_path: object) -> None:
    out, trace = f"{tmp_path}/demo.json", f"{tmp_path}/trace.jsonl"
    assert cli.main([*SMALL, "--json", out, "--trace", trace, "--metrics-port", "0"]) == 0
    text = capsys.readouterr().out
    assert "prefill TP 2 → decode TP 1 over auto" in text
    assert text.count("tokens equal ✓") == 2 and "2/2 requests" in text and "✗" not in text
    assert "prefill and decode pools are empty after the run ✓" in text
    with open(out) as f:
        data = json.load(f)
    assert data["ok"] is True and data["leaks"] == {}
    # the per-phase table: one line per request, every phase of both sides measured
    table = text.split("phases, ms")[1].splitlines()[2:4]
    assert [line.split()[0] for line in table] == ["0", "1"]
    assert all("-" not in line.split()[1:] for line in table), table
    # the trace: each request on both prefill ranks and the decode rank
    with open(trace) as f:
        sides = sorted((json.loads(line)["request"], json.loads(line)["rank"]) for line in f)
    assert sides == [(r, rank) for r in ("0", "1")
                     for rank in ("decode-tp0", "prefill-tp0", "prefill-tp1")]
    # both workers served their metrics over HTTP while still running, after the run
    served = re.findall(r"(prefill|decode) metrics at http://\S+: (\d+) kvhandoff series ✓",
                        text)
    assert sorted(side for side, _ in served) == ["decode", "prefill"], text
    assert all(int(n) > 20 for _, n in served)


def test_demo_hands_off_a_local_all_sliding_window_checkpoint(
        capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    """A checkpoint directory whose attention is all sliding-window (Mistral-7B-v0.1's
    config), as a user passes it: no KV component, the window pages move instead."""
    from kvhandoff.lab.engine import load_model

    load_model("mistral", seed=5).save_pretrained(f"{tmp_path}/ckpt")
    args = ["demo", "--model", f"{tmp_path}/ckpt", "--prefill-tp", "1", "--decode-tp", "2",
            "--requests", "2", "--max-new-tokens", "4", "--chunk", "8"]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert text.count("tokens equal ✓") == 2 and "2/2 requests" in text and "✗" not in text


def test_demo_hands_off_short_convolution_state(capsys: pytest.CaptureFixture[str]) -> None:
    """LFM2's short-conv slots (sharded by channel) over the session layer and tcp."""
    args = ["demo", "--model", "lfm2", "--prefill-tp", "2", "--decode-tp", "1",
            "--requests", "2", "--max-new-tokens", "4", "--chunk", "8"]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "short_conv" in text
    assert text.count("tokens equal ✓") == 2 and "2/2 requests" in text and "✗" not in text


@pytest.mark.parametrize(("family", "component"), [
    ("inkling_text", "short_conv"),  # attention + short convs in one layer (swa / attn)
    ("zamba", "mamba"),  # multi-head Mamba1, alone and beside attention in one layer
    ("mimo_v2_flash", "swa"),  # a pool per K/V page shape; K and V head dims differ
])
def test_demo_hands_off_a_local_checkpoint_of_the_new_layer_kinds(
        family: str, component: str, capsys: pytest.CaptureFixture[str],
        tmp_path: object) -> None:
    """One family per layer kind the sweep added, as a user passes it (a checkpoint
    directory), over the session layer and tcp, at decode TP 2."""
    from kvhandoff.lab.engine import load_model
    from kvhandoff.lab.engine.tiny import tiny_config

    load_model(tiny_config(family), seed=5).save_pretrained(f"{tmp_path}/ckpt")
    args = ["demo", "--model", f"{tmp_path}/ckpt", "--prefill-tp", "1", "--decode-tp", "2",
            "--requests", "2", "--max-new-tokens", "4", "--chunk", "8"]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert component in text
    assert text.count("tokens equal ✓") == 2 and "2/2 requests" in text and "✗" not in text


def test_demo_fails_on_a_corrupted_byte(capsys: pytest.CaptureFixture[str]) -> None:
    # decode flips one received KV byte before rebuilding its cache: the check must fail
    assert cli.main([*SMALL, "--corrupt", "kv"]) == 1
    text = capsys.readouterr().out
    assert "MISMATCH ✗" in text and "0/2 requests" in text


def test_worker_leak_check_names_the_pools() -> None:
    """What each worker answers after the run: a request admitted on decode but never
    finished still holds its pages, slot and aux row, and they are named; freed, nothing
    is."""
    from kvhandoff.lab.engine import LocalTransfer
    from kvhandoff.lab.engine.decode import DecodeInstance
    from kvhandoff.lab.engine.pools import PoolConfig
    from kvhandoff.lab.engine.run import prepare

    prep = prepare("llama")
    inst = DecodeInstance(prep.model, prep.arch, tp=1,
                          pools=PoolConfig(page_size=4, num_pages=16, num_slots=2))
    assert pool_leaks(inst, "decode").pools == {}
    inst.admit(0, list(range(10)), LocalTransfer([], inst.ranks))
    assert pool_leaks(inst, "decode").pools == {"decode pages": 3, "decode slots": 1,
                                                "decode aux rows": 1}
