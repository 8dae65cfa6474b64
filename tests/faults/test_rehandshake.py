"""A prefill rank that forgot our handshake (it restarted) answers a request's indices
with "unknown decode peer": decode handshakes again and resends them, and the request
succeeds as if nothing happened. Bounded: a rank that keeps forgetting fails the request
with the reason."""

from __future__ import annotations

import logging

import pytest

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.protocol import ErrorCode
from kvhandoff.session import RequestRejected, Status


def test_a_restarted_prefill_is_handshaken_again_transparently(
        bootstrap: BootstrapServer, instance: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvhandoff.session.request.receiver")
    rig = Rig(bootstrap.url, instance)
    try:
        rig.handoff(rig.plan(1))  # the decode rank's group is handshaken and cached
        before = rig.prefill.endpoint
        rig.restart_prefill()
        assert rig.prefill.endpoint == before  # same rank, same address: a restart
        counts = []
        for rid in (2, 3):  # the first meets the forgotten handshake; both succeed
            _, r = rig.handoff(rig.plan(rid, block=rid))
            counts.append(r.events["rehandshake"])
        assert counts == [1, 0]  # what the metrics count as kvhandoff_rehandshakes
        assert rig.decode.stats.get("handler_errors", 0) == 0
        assert len(rig.prefill._peers or ()) == 1  # the decode rank handshook again
        forgot = [m for m in caplog.messages if "forgot our handshake" in m]
        assert len(forgot) == 1 and "request 2" in forgot[0]  # the path this test is for
    finally:
        rig.close()


def test_a_prefill_that_keeps_forgetting_fails_the_request_with_the_reason(
        bootstrap: BootstrapServer, instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(bootstrap.url, instance)
    try:
        assert rig.prefill._peers is not None
        monkeypatch.setattr(rig.prefill._peers, "get", lambda endpoint: None)
        r = rig.receiver(rig.plan(1))
        assert r.wait(30) is Status.FAILED
        assert isinstance(r.error, RequestRejected)
        assert "unknown decode peer" in str(r.error) and "new handshake" in str(r.error)
        assert r.wait_released(30)
        assert ErrorCode.UNKNOWN_PEER.value == "unknown_peer"
    finally:
        rig.close()
