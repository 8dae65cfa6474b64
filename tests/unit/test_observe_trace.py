"""Trace lines: written per finished request, read back (a torn line skipped), drawn."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvhandoff.observe import timeline as tl
from kvhandoff.observe import trace


def _timeline(role: str, *, upto: int | None = None) -> tl.Timeline:
    ticks = itertools.count(100.0, 0.002)
    t = tl.Timeline(clock=lambda: next(ticks))
    for event in tl.ORDER[role][1:][:upto]:
        t.mark(event)
    return t


def test_a_trace_line_holds_what_a_timeline_needs(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    w = trace.TraceWriter(path)
    w.write(role="prefill", request="r1", rank="p/tp0", transport="tcp",
            timeline=_timeline("prefill"), outcome="success", reason=None,
            nbytes={"kv": 4096, "mamba": 512}, peers=["d"])
    w.write(role="decode", request="r1", rank="d/tp0", transport="tcp",
            timeline=_timeline("decode", upto=1), outcome="failed", reason="PeerLost",
            nbytes={"kv": 4096})
    with path.open("a") as f:
        f.write('{"role": "decode", "requ')  # a writer killed mid-line
    rows = trace.read(path)
    assert [(r["role"], r["outcome"], r["reason"]) for r in rows] == [
        ("prefill", "success", None), ("decode", "failed", "PeerLost")]
    p = rows[0]
    assert p["bytes"] == {"kv": 4096, "mamba": 512} and p["peers"] == ["d"]
    assert list(p["events"]) == list(tl.ORDER["prefill"])
    assert p["phases"] == pytest.approx({"wait_indices": 0.002, "prepare": 0.002,
                                         "transfer": 0.006, "move": 0.002, "settle": 0.002})
    assert rows[1]["phases"] == pytest.approx({"bootstrap": 0.002})  # never got further


def test_the_trace_command_draws_a_png_and_says_when_nothing_matches(
        tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    w = trace.TraceWriter(path)
    for rid in ("a", "b"):
        for role in ("prefill", "decode"):
            w.write(role=role, request=rid, rank="r0", transport="shm",
                    timeline=_timeline(role), outcome="success", reason=None,
                    nbytes={"kv": 1})
    out = tmp_path / "t.png"
    assert trace.main(str(path), str(out), ["a"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert trace.main(str(path), str(out), ["nope"]) == 2
