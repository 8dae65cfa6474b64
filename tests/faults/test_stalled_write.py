"""A write that never completes (stuck in the network): prefill's ``transfer_timeout``
fails the request on both sides with a reason, and decode keeps the destination pages
until ``release_timeout`` (the cancelled write may still land), saying so."""

from __future__ import annotations

import time

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.plan.model import Plan
from kvhandoff.session import SessionConfig, Status
from kvhandoff.transport.base import Handle, Peer
from kvhandoff.transport.tcp.transport import TcpTransport


class StalledTcp(TcpTransport):
    """Accepts every write and never completes it."""

    def __init__(self) -> None:
        super().__init__(data_secret=SessionConfig().data_key())  # as the rig's agents
        self.stalled: list[Handle] = []

    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        self.check_sources(plan)
        h = Handle(nbytes=plan.nbytes, peer=peer.name)
        self.stalled.append(h)
        return h


def test_prefill_transfer_timeout_fails_both_sides_and_holds_the_pages(
        bootstrap: BootstrapServer, instance: str) -> None:
    t = StalledTcp()
    rig = Rig(bootstrap.url, instance, prefill_transport=t,
              prefill_cfg={"transfer_timeout": 1.0}, decode_cfg={"release_timeout": 2.0})
    try:
        rp = rig.plan(1)
        r = rig.receiver(rp)
        s, chunks, state = rig.sender(rp)
        t0 = time.monotonic()
        rig.send_all(s, chunks, state)
        assert s.wait(15) is Status.FAILED
        assert t.stalled, "nothing was written"
        assert "timed out" in str(s.reason) or "timeout" in str(s.reason), s.reason
        assert r.wait(15) is Status.FAILED
        assert f"prefill {rig.prefill.rank_id}" in str(r.reason), r.reason
        # the cancelled write may still land: no AbortAck, so the pages stay held ...
        assert not r.released, r.release_reason
        assert r.wait_released(15)
        # ... until release_timeout, which the reason names
        assert "release_timeout (2 s)" in r.release_reason, r.release_reason
        assert time.monotonic() - t0 >= 2.0
        assert s.wait_settled(5)
        assert all(h.released for h in t.stalled), "the timed-out handles were not released"
    finally:
        rig.close()
