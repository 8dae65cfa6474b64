"""Two hosts: prefill and decode in separate network namespaces joined by a veth link,
created by the test (skipped with the reason where that is not permitted).

A handoff crosses the link byte-exact; then the link is cut mid-transfer and both sides
end their requests FAILED with a reason, decode's pages are released only by the release
timeout (no AbortAck can cross a cut link), and both processes close without leaks.
"""

from __future__ import annotations

import json

import pytest

from kvhandoff.lab.testing import netns
from kvhandoff.lab.testing.handoff import RequestPlan, Scenario, Topology

OK, WHY = netns.available()
pytestmark = pytest.mark.skipif(not OK, reason=WHY)

TOPO = Topology(shape="qwen3_next", prefill_tp=2, decode_tp=1, num_pages=96)
NO_LEAKS = {"threads": [], "fds": 0}
CONFIG = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.5, "release_timeout": 2.0,
          "bootstrap_timeout": 20.0}


def _run(hosts: netns.TwoHosts, scn: Scenario, *, cut: bool
         ) -> tuple[dict[str, object], dict[str, object], object, object]:
    url = f"http://{hosts.prefill_ip}:{netns.BOOTSTRAP_PORT}"
    p = netns.SideProcess(hosts.popen(hosts.prefill_ns))
    d = netns.SideProcess(hosts.popen(hosts.decode_ns))
    try:
        p.start(netns.SideJob("prefill", scn, url, hosts.prefill_ip))
        d.start(netns.SideJob("decode", scn, url, hosts.decode_ip,
                              announce=("transferring",) if cut else ()))
        if cut:
            assert d.expect("STATE ", 60) == "transferring", d.lines
            hosts.cut()
        dr, pr = d.expect("REPORT ", 120), p.expect("REPORT ", 120)
        assert dr is not None and pr is not None, (d.lines, p.lines)
        return json.loads(pr), json.loads(dr), p.finish(), d.finish()
    finally:
        for s in (p, d):
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait(10)


def test_handoff_across_hosts() -> None:
    reqs = (RequestPlan(rid=0, num_tokens=21, chunk_pages=2, block=0, seed=1),
            RequestPlan(rid="b", num_tokens=30, prefix_len=8, chunk_pages=3, block=1, seed=2))
    scn = Scenario(topo=TOPO, requests=reqs, config={"instance": "hosts", **CONFIG})
    with netns.TwoHosts() as hosts:
        pr, dr, pl, dl = _run(hosts, scn, cut=False)
    assert not pr["problems"] and not dr["problems"], (pr["problems"], dr["problems"])
    assert {o["status"] for o in dr["outcomes"]} == {"success"}  # type: ignore[index, union-attr]
    assert len(dr["outcomes"]) == 2 and len(pr["outcomes"]) == 4  # type: ignore[arg-type]
    assert pl == NO_LEAKS and dl == NO_LEAKS


def test_link_cut_mid_transfer() -> None:
    reqs = tuple(RequestPlan(rid=i, num_tokens=48, chunk_pages=1, block=i, seed=i)
                 for i in range(2))
    scn = Scenario(topo=TOPO, requests=reqs, faults={"chunk_delay": 0.2},
                   config={"instance": "cut", **CONFIG}, timeout=30.0)
    with netns.TwoHosts() as hosts:
        pr, dr, pl, dl = _run(hosts, scn, cut=True)
    assert not dr["problems"], dr["problems"]
    for o in dr["outcomes"]:  # type: ignore[attr-defined]
        assert o["status"] == "failed" and "silent" in o["reason"], o
        assert o["released"] and "release_timeout" in o["release_reason"], o
    for o in pr["outcomes"]:  # type: ignore[attr-defined]
        assert o["status"] == "failed" and "decode" in o["reason"], o
    assert pl == NO_LEAKS and dl == NO_LEAKS
