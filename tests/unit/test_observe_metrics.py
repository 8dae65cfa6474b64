"""Metrics: the bootstrap server's /metrics over HTTP, and the agents' metrics moving by
the right amounts with bounded labels."""

from __future__ import annotations

import gc
import urllib.error
import urllib.request

import msgspec
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvhandoff.bootstrap.client import RankRecord
from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.timelines import ticking
from kvhandoff.observe import timeline as tl
from kvhandoff.observe.metrics import HandoffMetrics


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, frozenset(labels.items())), 0.0)


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def _post(url: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_the_bootstrap_server_counts_answers_by_route_and_reports_its_registry() -> None:
    rec = RankRecord(instance="m", dp_size=1, dp_rank=0, tp_size=2, tp_rank=0, pp_size=1,
                     pp_rank=0, control_endpoint="tcp://10.0.0.1:1", transport="tcp",
                     model_signature="0123abcd")
    with BootstrapServer(insecure=True) as srv:
        assert _post(srv.url + "/v1/register", msgspec.json.encode(rec)) == 200
        assert _get(srv.url + "/v1/instances/m") == 503  # 1 of 2 ranks
        assert _get(srv.url + "/v1/instances/m") == 503
        assert _get(srv.url + "/v1/instances/someone-elses") == 404
        assert _get(srv.url + "/no/such/route") == 404
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    name = "kvhandoff_bootstrap_requests_total"
    assert value(text, name, route="/v1/register", status="200") == 1
    assert value(text, name, route="/v1/instances/{instance}", status="503") == 2
    assert value(text, name, route="/v1/instances/{instance}", status="404") == 1
    assert value(text, name, route="other", status="404") == 1
    assert value(text, "kvhandoff_bootstrap_instances") == 1
    assert value(text, "kvhandoff_bootstrap_ready_instances") == 0
    assert value(text, "kvhandoff_bootstrap_ranks") == 1
    # no label carries a name a client chose
    assert not any("someone" in v or v == "m" for (_, labels) in samples(text)
                   for _, v in labels)



def test_a_finished_handoff_moves_each_metric_once() -> None:
    m = HandoffMetrics()
    m.finished("prefill", "tcp", ticking("prefill"), nbytes=1 << 20, reason=None)
    m.finished("decode", "tcp", ticking("decode"), nbytes=1 << 20, reason=None)
    m.finished("decode", "tcp", tl.Timeline(), nbytes=0, reason="PeerLost")
    text = generate_latest(m.registry).decode()
    assert value(text, "kvhandoff_requests_total", role="prefill", transport="tcp",
                 status="success") == 1
    assert value(text, "kvhandoff_requests_total", role="decode", transport="tcp",
                 status="failed") == 1
    assert value(text, "kvhandoff_failures_total", role="decode", transport="tcp",
                 reason="PeerLost") == 1
    for role, phases in tl.PHASES.items():
        for phase, _, _ in phases:
            assert value(text, "kvhandoff_phase_seconds_count", role=role, transport="tcp",
                         phase=phase) == 1, (role, phase)
        assert value(text, "kvhandoff_handoff_seconds_count", role=role,
                     transport="tcp") == 1
    # 1 MiB in the 3 ms transfer phase (write, moving, moved, written: a tick apart)
    assert value(text, "kvhandoff_transfer_gbps_sum", transport="tcp") == \
        pytest.approx((1 << 20) / 3e-3 / 1e9)
    assert value(text, "kvhandoff_handoff_bytes_sum", role="decode", transport="tcp") == \
        1 << 20


def test_label_sets_stay_bounded_under_ten_thousand_requests() -> None:
    """Request ids never become labels: 10,000 requests of every outcome leave a fixed
    set of series, and each counts what it should."""
    m = HandoffMetrics()
    reasons = ["PeerLost", "RequestAborted", "TransferFailed", "ChecksumMismatch"]
    for i in range(10_000):
        role = ("prefill", "decode")[i % 2]
        reason = None if i % 5 else reasons[i // 5 % 4]
        events = {"rehandshake": 1} if i % 7 == 0 else {}
        m.finished(role, "tcp", ticking(role), nbytes=4096, reason=reason, events=events)
    text = generate_latest(m.registry).decode()
    series = {(name, labels) for (name, labels) in samples(text)}
    assert not any(v.startswith("r-") or v.isdigit() for _, labels in series
                   for _, v in labels if v not in ("1",))
    assert len(series) < 300, len(series)
    assert value(text, "kvhandoff_requests_total", role="prefill", transport="tcp",
                 status="success") == 4000
    assert value(text, "kvhandoff_rehandshakes_total", role="prefill", transport="tcp") + \
        value(text, "kvhandoff_rehandshakes_total", role="decode", transport="tcp") == 1429


class _Agent:
    def __init__(self, role: str, stats: dict[str, int]) -> None:
        self.role, self.stats, self.closed = role, stats, False


def test_peer_gauges_sum_the_live_agents_at_scrape_time() -> None:
    m = HandoffMetrics()
    p1 = _Agent("prefill", {"decode_peers": 2, "suspect_peers": 1, "staging_slots": 3})
    p2 = _Agent("prefill", {"decode_peers": 3, "suspect_peers": 0})
    d = _Agent("decode", {"prefill_peers": 4})
    m.watch(p1)
    m.watch(p2)
    m.watch(d)
    text = generate_latest(m.registry).decode()
    assert value(text, "kvhandoff_peers", role="prefill") == 5
    assert value(text, "kvhandoff_suspect_peers", role="prefill") == 1
    assert value(text, "kvhandoff_peers", role="decode") == 4
    assert value(text, "kvhandoff_staging_slots_in_use", role="prefill") == 3
    p2.closed = True
    del d  # gone: the metrics hold a weak reference only
    gc.collect()
    text = generate_latest(m.registry).decode()
    assert value(text, "kvhandoff_peers", role="prefill") == 2
    assert value(text, "kvhandoff_peers", role="decode") == 0
