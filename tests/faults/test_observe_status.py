"""``kvhandoff status``: the bootstrap's instances and ranks and an agent's metrics, from a
live deployment (two agents in this process over tcp), over HTTP."""

from __future__ import annotations

import json

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.status import collect, main, render
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.observe import report
from kvhandoff.session import Status


def test_status_shows_instances_ranks_and_what_the_agents_did() -> None:
    obs = {"metrics_port": 0}
    with BootstrapServer() as srv:
        rig = Rig(srv.url, "status-view", prefill_cfg=obs, decode_cfg=obs)
        try:
            url = report.metrics_url()
            assert url is not None
            dead = "http://127.0.0.1:9/metrics"  # nothing listens on the discard port
            first = collect(srv.url, [url, dead])
            rig.handoff(rig.plan("s-1", block=1))
            s, _, _ = rig.sender(rig.plan("s-2", block=2))
            s.abort("the engine dropped it")
            assert s.wait(10) is Status.FAILED and s.wait_settled(10)
            second = collect(srv.url, [url, dead], before=first)
            lines: list[str] = []
            assert main(srv.url, [url], interval=0.0, count=2, as_json=False,
                        out=lines.append) == 0
            out: list[str] = []
            assert main(srv.url, [url], interval=0.0, count=None, as_json=True,
                        out=out.append) == 0
        finally:
            rig.close()
    (inst,) = second.instances
    assert (inst.name, inst.ready, inst.registered, inst.expected) == ("status-view", True, 1, 1)
    assert [(r.endpoint, r.metrics) for r in inst.ranks] == [(rig.prefill.endpoint, url)]
    agent, gone = second.agents
    assert agent.ok and not gone.ok and "9" in gone.url
    assert agent.peers["prefill"] >= 1 and agent.peers["decode"] >= 1  # the rig's two
    before = next(a for a in first.agents if a.url == url)
    grew = {k: v - before.requests.get(k, 0.0) for k, v in agent.requests.items()}
    assert grew.get("prefill success") == 1 and grew.get("decode success") == 1
    assert agent.new_failures == {"prefill RequestAborted": 1.0}
    text = render(second)
    assert "instance status-view [tcp] ready" in text and rig.prefill.endpoint in text
    assert "new prefill RequestAborted 1" in text and "not answering" in text
    assert len(lines) == 2 and "kvhandoff status" in lines[0]
    assert json.loads(out[0])["instances"][0]["name"] == "status-view"
