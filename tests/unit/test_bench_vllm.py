"""``kvhandoff bench vllm``'s pure parts: what ``auto`` resolved to, the ratios, and the
verdict line (the bench itself runs real servers: ``kvhandoff bench vllm --quick``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvhandoff.lab.bench import vllm as bench


def _row(tokens: int, transfer: list[float], *, memcpy: float | None = None,
         nbytes: int = 1 << 20, move: list[float] | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"prompt_tokens": tokens, "ok": True, "error": None,
                           "ttft_ms": [10.0], "transfer_ms": transfer, "load_ms": [1.0],
                           "prepare_ms": [0.1], "bytes": nbytes, "move_ms": move or []}
    if memcpy is not None:
        row["memcpy_ms"] = memcpy
    return row


def _results() -> dict[str, dict[str, Any]]:
    rate = {"requests_per_s": 2.0}
    return {"kvhandoff": {"transport": "auto→cma", "rate": rate, "rows": [
                _row(64, [9.0, 9.0], memcpy=0.01),  # small prompts do not count
                _row(512, [0.2, 0.3, 0.4], memcpy=0.1, move=[0.1, 0.2, 0.1]),
                _row(900, [0.5, 0.6, 0.7], memcpy=0.2, move=[0.3, 0.2, 0.4])]},
            "nixl": {"rate": rate, "rows": [
                _row(64, [0.1]), _row(512, [0.5, 0.5, 0.6]), _row(900, [1.0, 0.9, 1.1])]}}


def test_the_verdict_is_the_worst_prompt_of_512_tokens_or_more() -> None:
    cmp = bench.compare(_results())
    by_tokens = {r["prompt_tokens"]: r for r in cmp["per_prompt"]}
    assert by_tokens[512]["transfer_ms"]["ratio"] == pytest.approx(0.3 / 0.5)
    assert by_tokens[900]["transfer_ms"]["ratio"] == pytest.approx(0.6 / 1.0)
    assert by_tokens[900]["memcpy_ratio"] == pytest.approx(0.6 / 0.2)
    # the bytes moving beside NIXL's READ: shown, never the verdict
    assert by_tokens[512]["move_ms"] == {"kvhandoff": 0.1, "nixl": 0.5,
                                         "ratio": pytest.approx(0.2)}
    assert by_tokens[64]["move_ms"]["ratio"] is None
    assert cmp["verdict"] == {"transport": "auto→cma", "vs_nixl": pytest.approx(0.6),
                              "vs_memcpy": pytest.approx(3.0),
                              "move_vs_nixl": pytest.approx(0.3)}
    met = {g["what"].split(",")[0]: g["met"] for g in cmp["goals"]}
    assert met["transfer vs NIXL"] and not met["transfer vs one memcpy"]
    assert bench.verdict_line(cmp) == ("transfer vs NIXL on the default transport "
                                       "(auto→cma): 0.60x; vs memcpy: 3.00x")


def test_a_verdict_with_nothing_measured_says_so() -> None:
    res = _results()
    for side in res.values():
        side["rows"] = side["rows"][:1]  # only 64 tokens
    assert bench.verdict_line(bench.compare(res)).endswith("(auto→cma): n/ax; vs memcpy: n/ax")


def test_what_auto_picked_is_read_from_the_servers_logs(tmp_path: Path) -> None:
    p, d, none = tmp_path / "p.log", tmp_path / "d.log", tmp_path / "missing.log"
    p.write_text("INFO transport auto: using cma for a peer on this host: one copy\n")
    d.write_text("noise\nINFO transport auto: using cma for a peer on this host: ...\n")
    assert bench.resolved("auto", [p, d, none]) == "auto→cma"
    d.write_text("transport auto: using tcp for a peer on another host: ...\n")
    assert bench.resolved("auto", [p, d]) == "auto→cma+tcp"
    assert bench.resolved("auto", [none]) == "auto→?"
    assert bench.resolved("tcp", [p]) == "tcp"

