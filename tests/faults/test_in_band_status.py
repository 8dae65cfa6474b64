"""Statuses in band (:mod:`kvhandoff.session.rank.notices`): on tcp a chunk's status rides
with its writes; decode must accept them in any order, refuse impossible counts with a
reason, and ignore notices that do not decode or name no agent."""

from __future__ import annotations

import logging

import pytest

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.hostile import landed
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.plan.model import Plan
from kvhandoff.protocol import (
    Outcome,
    RankId,
    StatusNotice,
    TransferStatus,
    decode_notice,
    encode_notice,
)
from kvhandoff.session import SessionConfig, Status
from kvhandoff.transport.base import Handle, Peer
from kvhandoff.transport.tcp.transport import TcpTransport


class ReorderingTcp(TcpTransport):
    """Holds back every non-last chunk's in-band status and delivers it after the last
    one's: the order two connections may produce, made certain. ``repeat``: deliver the
    last (or first) chunk's status twice, before the held ones (a buggy or hostile
    prefill)."""

    def __init__(self, *, repeat: str = "") -> None:
        super().__init__(data_secret=SessionConfig().data_key())  # as the rig's agents
        self.held: list[tuple[Peer, bytes]] = []
        self.repeat = repeat  # "last" or "first": deliver that chunk's status twice
        self.reordered = 0

    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        if notice is None:
            return super().submit(peer, plan)
        if not decode_notice(notice).status.last:
            h = super().submit(peer, plan)
            self.held.append((peer, notice))
            return h
        h = super().submit(peer, plan, notice=notice)
        assert h.wait(10).value == "done", h.error
        again = {"last": [(peer, notice)], "first": self.held[:1]}.get(self.repeat, [])
        late = again + self.held
        self.held = []
        for p, n in late:
            self.reordered += 1
            assert super().submit(p, Plan(entries=()), notice=n).wait(10).value == "done"
        return h


def test_tcp_statuses_travel_in_band(rig: Rig) -> None:
    for i in range(3):
        rig.handoff(rig.plan(i + 1, block=i, chunk_pages=1))
    got = rig.decode.stats
    assert got["in_band_statuses"] >= 3 * 3, got  # every chunk of every request


def test_decode_can_ask_for_statuses_over_the_control_socket(bootstrap: BootstrapServer,
                                                             instance: str) -> None:
    rig = Rig(bootstrap.url, instance, decode_cfg={"in_band_status": False})
    try:
        for i in range(2):
            rig.handoff(rig.plan(i + 1, block=i, chunk_pages=1))
        assert rig.decode.stats["in_band_statuses"] == 0
    finally:
        rig.close()


def test_last_status_may_overtake_earlier_chunks(bootstrap: BootstrapServer,
                                                 instance: str) -> None:
    t = ReorderingTcp()
    rig = Rig(bootstrap.url, instance, prefill_transport=t)
    try:
        rp = rig.plan(1, chunk_pages=1)
        _, r = rig.handoff(rp)
        assert t.reordered >= 2, "the test did not reorder anything"
        assert r.released
        assert landed(rig, rp), "bytes differ"
    finally:
        rig.close()


@pytest.mark.parametrize(("repeat", "why"), [("last", "reported chunk 5 twice"),
                                             ("first", "reported chunk 0 twice")])
def test_a_repeated_status_fails_with_a_reason(bootstrap: BootstrapServer, instance: str,
                                               repeat: str, why: str) -> None:
    t = ReorderingTcp(repeat=repeat)
    rig = Rig(bootstrap.url, instance, prefill_transport=t)
    try:
        rp = rig.plan(1, chunk_pages=1)
        r = rig.receiver(rp)
        s, chunks, state = rig.sender(rp)
        rig.send_all(s, chunks, state)
        assert r.wait(10) is Status.FAILED
        assert s.wait(10) in (Status.SUCCESS, Status.FAILED)  # decode's Abort may come first
        assert s.wait_settled(10)
        assert why in str(r.reason), r.reason
        assert r.wait_released(10)
    finally:
        rig.close()


def test_junk_notices_are_dropped_and_logged(rig: Rig, caplog: pytest.LogCaptureFixture
                                             ) -> None:
    """Bytes that are no StatusNotice, or one naming no agent here, change nothing."""
    peer = rig.prefill.transport.connect(rig.decode.transport.endpoint())
    stray = encode_notice(StatusNotice(
        to="tcp://127.0.0.1:1", sender="tcp://127.0.0.1:2",
        status=TransferStatus(request_id=1, rank=RankId(instance="x", dp_rank=0, tp_rank=0,
                                                        tp_size=1, pp_rank=0, pp_size=1),
                              chunk=0, last=True, outcome=Outcome.SUCCESS)))
    with caplog.at_level(logging.WARNING, logger="kvhandoff.session.rank.notices"):
        for junk in (b"\x00garbage", stray):
            h = rig.prefill.transport.submit(peer, Plan(entries=()), notice=junk)
            assert h.wait(10).value == "done", h.error
    assert "dropping an in-band notice" in caplog.text
    assert rig.decode.stats["in_band_statuses"] == 0
    peer.close()
    rig.handoff(rig.plan(1))  # the decode agent still works
