"""Metrics and traces from real handoffs between two agents (tcp, this process): a
success moves each counter and histogram by one, a failure counts under its reason, and
the trace holds a line per request side. Read back over HTTP, as Prometheus would."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.observe import report, trace
from kvhandoff.session import Status


def scrape() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    url = report.metrics_url()
    assert url is not None, "no agent served the metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def delta(before: dict[tuple[str, frozenset[tuple[str, str]]], float],
          after: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_handoffs_move_the_metrics_and_write_traces(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    obs = {"metrics_port": 0, "trace": str(path)}
    with BootstrapServer() as srv:
        rig = Rig(srv.url, "observed", prefill_cfg=obs, decode_cfg=obs)
        try:
            before = scrape()
            rig.handoff(rig.plan("ok-1", block=1))
            r = rig.receiver(rig.plan("gone-2", block=2))
            s, _, _ = rig.sender(rig.plan("gone-2", block=2))
            s.abort("the engine dropped it")
            assert r.wait(10) is Status.FAILED
            assert s.wait(10) is Status.FAILED
            assert r.wait_released(10) and s.wait_settled(10)
            after = scrape()
        finally:
            rig.close()
    # prefill's engine aborted; decode heard prefill fail the transfer
    for role, reason in (("prefill", "RequestAborted"), ("decode", "TransferFailed")):
        assert delta(before, after, "kvhandoff_requests_total", role=role, transport="tcp",
                     status="success") == 1
        assert delta(before, after, "kvhandoff_requests_total", role=role, transport="tcp",
                     status="failed") == 1
        assert delta(before, after, "kvhandoff_failures_total", role=role, transport="tcp",
                     reason=reason) == 1
        assert delta(before, after, "kvhandoff_handoff_seconds_count", role=role,
                     transport="tcp") == 1
        assert delta(before, after, "kvhandoff_phase_seconds_count", role=role,
                     transport="tcp", phase="transfer") == 1
        assert delta(before, after, "kvhandoff_handoff_bytes_sum", role=role,
                     transport="tcp") > 0
    assert delta(before, after, "kvhandoff_transfer_gbps_count", transport="tcp") == 1
    # the rig's decode connected one prefill group, before the first request
    for stage in ("lookup", "handshake"):
        assert after.get(("kvhandoff_peer_setup_seconds_count",
                          frozenset({("stage", stage)})), 0) >= 1
    assert after[("kvhandoff_live_requests", frozenset({("role", "decode")}))] == 0
    # read from the live agents at the scrape: the rig's prefill knew its decode rank and
    # decode its prefill rank (other tests' agents may be alive in this process too)
    for role in ("prefill", "decode"):
        assert after[("kvhandoff_peers", frozenset({("role", role)}))] >= 1
    rows = trace.read(path)
    assert sorted((r["request"], r["role"], r["outcome"]) for r in rows) == [
        ("gone-2", "decode", "failed"), ("gone-2", "prefill", "failed"),
        ("ok-1", "decode", "success"), ("ok-1", "prefill", "success")]
    ok = {r["role"]: r for r in rows if r["request"] == "ok-1"}
    assert set(ok["prefill"]["phases"]) == {"wait_indices", "prepare", "transfer", "move",
                                            "settle"}
    assert set(ok["decode"]["phases"]) == {"bootstrap", "transfer"}
    assert ok["prefill"]["bytes"]["total"] == ok["decode"]["bytes"]["total"] > 0
    # prefill names what it planned per component (its layout's), and each side its peer
    planned = {k: v for k, v in ok["prefill"]["bytes"].items() if k != "total"}
    assert set(planned) <= {c.name for c in rig.src.components}
    assert sum(planned.values()) == ok["prefill"]["bytes"]["total"]  # every planned byte
    assert ok["prefill"]["peers"] == ["observed/tp0"] and ok["decode"]["peers"] == ["observed/tp0"]
