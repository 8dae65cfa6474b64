"""Transfer failures to one decode peer that stays alive do not poison the others.

One prefill agent serves two decode deployments (in process, :meth:`Rig.add_decode`);
the prefill transport (:class:`~kvhandoff.lab.testing.faulty.FailingTcp`) fails every write
to one of them. That decode's requests fail, naming the failed write; the other's all
succeed byte-exact, nothing else in its memory changes; both sides end with no live
request and the live decode is neither dropped nor left suspect. Once the fault is gone
the same decode completes a new request: prefill reuses its transport peer, or re-dials
it when the failure closed it (``peer-closed``).
"""

from __future__ import annotations

import logging

import pytest

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.faulty import FailingTcp
from kvhandoff.lab.testing.hostile import eventually, memory_problems
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.protocol import RequestId
from kvhandoff.session import Receiver, Sender, Status

INJECTED = "injected write failure to"


@pytest.mark.parametrize("close_peer", [False, True], ids=["peer-kept", "peer-closed"])
def test_a_failing_live_decode_peer_does_not_poison_the_others(
        bootstrap: BootstrapServer, instance: str, close_peer: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    t = FailingTcp(close_peer=close_peer)
    rig = Rig(bootstrap.url, instance, prefill_transport=t)
    try:
        bad, good = rig.decodes[0], rig.add_decode()
        t.fail_to.add(bad.agent.transport.endpoint())
        # distinct blocks: distinct prefill aux rows, and the good decode's memory shows
        # any write meant for the other decode that lands there instead
        doomed = [rig.plan(f"bad-{i}", block=i, chunk_pages=1) for i in range(3)]
        healthy = [rig.plan(f"good-{i}", block=3 + i, chunk_pages=1) for i in range(3)]
        receivers: dict[RequestId, Receiver] = {}
        for rp_bad, rp_good in zip(doomed, healthy, strict=True):
            receivers[rp_bad.rid] = rig.receiver(rp_bad, on=bad)
            receivers[rp_good.rid] = rig.receiver(rp_good, on=good)
        work = [(rp, *rig.sender(rp)) for pair in zip(doomed, healthy, strict=True)
                for rp in pair]
        senders: dict[RequestId, Sender] = {rp.rid: s for rp, s, _, _ in work}
        # chunk by chunk, the two decodes' requests interleaved
        for k in range(max(len(chunks) for _, _, chunks, _ in work)):
            for _, s, chunks, state in work:
                if k < len(chunks) and s.poll() is not Status.FAILED:
                    last = k == len(chunks) - 1
                    s.send(chunks[k], state_indices=state if last else None, last=last)

        for rp in healthy:
            r, s = receivers[rp.rid], senders[rp.rid]
            assert r.wait(10) is Status.SUCCESS, (rp.rid, r.reason)
            assert s.wait(10) is Status.SUCCESS, (rp.rid, s.reason)
        for rp in doomed:
            r, s = receivers[rp.rid], senders[rp.rid]
            assert r.wait(10) is Status.FAILED, rp.rid
            assert INJECTED in str(r.reason), (rp.rid, r.reason)
            assert s.wait(10) is Status.FAILED, rp.rid
            assert INJECTED in str(s.reason), (rp.rid, s.reason)
            assert r.wait_released(5), rp.rid
        assert t.failed >= len(doomed) and t.passed > 0
        problems = memory_problems(rig, good, healthy)
        assert not problems, "\n".join(problems)

        assert eventually(lambda: rig.prefill.live_requests == 0), rig.prefill.stats
        assert eventually(lambda: all(d.agent.live_requests == 0 for d in rig.decodes))
        # the failing decode answers heartbeats: no longer suspect, and not dropped
        assert eventually(lambda: rig.prefill.stats["suspect_peers"] == 0), rig.prefill.stats
        assert rig.prefill.stats["decode_peers"] == 2, rig.prefill.stats

        # the fault is gone: the same decode completes a new request. The Sender comes
        # first, so its indices find it live (the other order races a re-dial: see
        # test_recovery_when_indices_come_before_the_sender)
        t.fail_to.clear()
        again = rig.plan("bad-again", block=6, chunk_pages=1)
        with caplog.at_level(logging.INFO, logger="kvhandoff.session.peers.decode_ranks"):
            s, chunks, state = rig.sender(again)
            r = rig.receiver(again, on=bad)
            rig.send_all(s, chunks, state)
            assert r.wait(10) is Status.SUCCESS, r.reason
            assert s.wait(10) is Status.SUCCESS, s.reason
        assert ("re-dialed decode" in caplog.text) is close_peer, caplog.text
        problems = memory_problems(rig, bad, [again], failed=doomed)
        assert not problems, "\n".join(problems)  # the failed writes left no byte there
        assert eventually(lambda: rig.prefill.live_requests == 0), rig.prefill.stats
        assert rig.prefill.stats["decode_peers"] == 2, rig.prefill.stats
    finally:
        rig.close()


def _redialed(caplog: pytest.LogCaptureFixture) -> bool:
    return any("re-dialed decode" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("when", ["redial-done", "redial-in-flight"])
def test_recovery_when_indices_come_before_the_sender(
        bootstrap: BootstrapServer, instance: str, when: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """A write failure closed the decode's transport peer; the decode's next indices
    arrive before prefill's Sender exists, which triggers a re-dial. The Sender, created
    after the re-dial or while it is still connecting, must write through the fresh
    peer."""
    caplog.set_level(logging.INFO, logger="kvhandoff.session.peers.decode_ranks")
    t = FailingTcp(close_peer=True)
    rig = Rig(bootstrap.url, instance, prefill_transport=t)
    try:
        t.fail_to.add(rig.decode.transport.endpoint())
        first = rig.plan("doomed", block=0)
        r = rig.receiver(first)
        s, chunks, state = rig.sender(first)
        rig.send_all(s, chunks, state)
        assert r.wait(10) is Status.FAILED and INJECTED in str(r.reason), r.reason
        assert r.wait_released(5)
        assert eventually(lambda: rig.prefill.live_requests == 0)
        t.fail_to.clear()

        t.connect_delay = 0.5 if when == "redial-in-flight" else 0.0
        t.dialing.clear()
        rp = rig.plan("next", block=1)
        r = rig.receiver(rp)  # its indices reach prefill first: a re-dial starts
        assert t.dialing.wait(5), "prefill did not re-dial"
        if when == "redial-done":
            assert eventually(lambda: _redialed(caplog)), caplog.text
        else:
            assert not _redialed(caplog)
        s, chunks, state = rig.sender(rp)
        rig.send_all(s, chunks, state)
        assert s.wait(10) is Status.SUCCESS, s.reason
        assert r.wait(10) is Status.SUCCESS, r.reason
        assert _redialed(caplog)
        problems = memory_problems(rig, rig.decodes[0], [rp], failed=[first])
        assert not problems, "\n".join(problems)
    finally:
        rig.close()
