"""The bootstrap server is down: prefill refuses to start with the reason; decode fails
each request with the reason after bootstrap_timeout; nothing leaks."""

from __future__ import annotations

import pytest

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.servers import dead_url
from kvhandoff.lab.testing.handoff import DECODE, PREFILL, Arena, Topology, layout_of
from kvhandoff.lab.testing.rig import Rig, config
from kvhandoff.session import Agent, BootstrapFailed, Receiver, Status

TOPO = Topology(shape="qwen3_next", num_pages=32)


def test_prefill_cannot_start_without_bootstrap(instance: str) -> None:
    url = dead_url()
    src = layout_of(TOPO, PREFILL, 0, 0, Arena((0, 0, 0, 0, 0)))
    with pytest.raises(BootstrapFailed, match=r"could not register.*unavailable"):
        Agent.prefill(src, bootstrap_url=url, config=config(instance))


def test_decode_request_fails_after_bootstrap_timeout(instance: str) -> None:
    dst = layout_of(TOPO, DECODE, 0, 0, Arena((0, 1, 0, 0, 0)))
    with Agent.decode(dst, config=config(instance, bootstrap_timeout=1.0)) as d:
        r = Receiver(d, dead_url(), 1)
        assert r.wait(10) is Status.FAILED
        assert isinstance(r.error, BootstrapFailed)
        assert "not found within bootstrap_timeout" in str(r.error)
        assert r.released and d.live_requests == 0


def test_unknown_instance_fails_with_its_name(bootstrap: BootstrapServer, instance: str) -> None:
    dst = layout_of(TOPO, DECODE, 0, 0, Arena((0, 1, 0, 0, 0)))
    with Agent.decode(dst, config=config(instance, bootstrap_timeout=1.0)) as d:
        r = Receiver(d, bootstrap.url, 1, instance="no-such-prefill")
        assert r.wait(10) is Status.FAILED
        assert "no-such-prefill" in (r.reason or "") and "unknown" in (r.reason or "")


def test_handoffs_continue_after_the_server_stops(instance: str) -> None:
    """Once handshaken, prefill and decode need the server no more."""
    srv = BootstrapServer().start()
    try:
        rig = Rig(srv.url, instance)
    except BaseException:
        srv.close()
        raise
    try:
        rig.handoff(rig.plan(1))
        srv.close()
        rig.handoff(rig.plan(2, block=1))
    finally:
        rig.close()  # deregistration fails (server gone): logged, bounded
