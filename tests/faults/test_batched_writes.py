"""Batched writes (:mod:`kvhandoff.session.control.write_batch`) over real sockets: requests
handed over together reach decode in one submit per chunk round, with one in-band
notice carrying every status, every byte in place; a batch that fails fails exactly
its requests, each saying it was batched. On decode, the requests one step opens send
their indices as one message per prefill rank (:mod:`kvhandoff.session.control.post_batch`)."""

from __future__ import annotations

import threading

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.faulty import CountingTcp
from kvhandoff.lab.testing.hostile import landed
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.protocol import Abort, Message, TransferInit, TransferInits
from kvhandoff.session import Status
from kvhandoff.session.control.channel import Origin


def test_requests_handed_over_together_share_writes_and_land_byte_exact(
        bootstrap: BootstrapServer, instance: str) -> None:
    t = CountingTcp()
    rig = Rig(bootstrap.url, instance, prefill_transport=t)
    try:
        plans = [rig.plan(i + 1, block=i, chunk_pages=2) for i in range(3)]
        recvs = [rig.receiver(rp) for rp in plans]
        sends = [rig.sender(rp) for rp in plans]
        for s, _, _ in sends:
            assert s.wait_bootstrapped(10) is Status.WAITING_FOR_INPUT
        with rig.prefill.batched_writes():
            for s, chunks, state in sends:
                rig.send_all(s, chunks, state)
            assert t.notices == []  # held until the context exits
        for r in recvs:
            assert r.wait(10) is Status.SUCCESS, r.reason
        for s, _, _ in sends:
            assert s.wait(10) is Status.SUCCESS, s.reason
        rounds = max(len(chunks) for _, chunks, _ in sends)
        assert t.notices == [3] * rounds, t.notices  # one write per chunk round, 3 statuses
        assert rig.decode.stats["in_band_statuses"] == 3 * rounds
        for rp in plans:
            assert landed(rig, rp), "bytes differ"
    finally:
        rig.close()


def test_a_refused_batch_fails_exactly_its_requests(bootstrap: BootstrapServer,
                                                    instance: str) -> None:
    t = CountingTcp()
    rig = Rig(bootstrap.url, instance, prefill_transport=t)
    try:
        plans = [rig.plan(i + 1, block=i, chunk_pages=32) for i in range(2)]  # one chunk
        recvs = [rig.receiver(rp) for rp in plans]
        sends = [rig.sender(rp) for rp in plans]
        for s, _, _ in sends:
            assert s.wait_bootstrapped(10) is Status.WAITING_FOR_INPUT
        t.refuse = True
        with rig.prefill.batched_writes():
            for s, chunks, state in sends:
                rig.send_all(s, chunks, state)
        for (s, _, _), r in zip(sends, recvs, strict=True):
            assert s.wait(10) is Status.FAILED
            assert "submit refused: injected: peer closed by its owner" in str(s.reason)
            assert "one batched write with 1 other chunk(s)" in str(s.reason), s.reason
            assert s.wait_settled(10)
            assert r.wait(10) is Status.FAILED
            assert r.wait_released(10)  # prefill acked: nothing of it in flight
        rig.handoff(rig.plan(9, block=3))  # the agents still work, unbatched
    finally:
        rig.close()


def test_a_decode_step_sends_its_indices_in_one_message_and_each_lands(
        bootstrap: BootstrapServer, instance: str) -> None:
    """Receivers opened inside decode's ``batched_writes`` post nothing until it exits,
    then one TransferInits per prefill rank; prefill handles each init as if alone, so
    an Abort held after one still follows it, and every other request lands exactly.
    (The Senders start once prefill has handled that Abort: one started before it
    could finish its write first, and rightly succeed, on a busy machine.)"""
    rig = Rig(bootstrap.url, instance)
    heard: list[object] = []
    packed, aborted = threading.Event(), threading.Event()
    desk = rig.prefill._desk
    assert desk is not None
    take = desk.on_message

    def spy(origin: Origin, msg: Message) -> bool:
        if isinstance(msg, TransferInits):
            heard.append(tuple(m.request_id for m in msg.inits))
            packed.set()
        elif isinstance(msg, TransferInit):
            heard.append(msg.request_id)
        handled = take(origin, msg)
        if isinstance(msg, Abort) and msg.request_id == 3:
            aborted.set()
        return handled

    desk.on_message = spy  # type: ignore[method-assign]
    try:
        rig.handoff(rig.plan(99, block=6))  # the group is connected: posts come from here
        plans = [rig.plan(i + 1, block=i) for i in range(4)]
        with rig.decode.batched_writes():
            recvs = [rig.receiver(rp) for rp in plans]
            recvs[2].abort("the engine dropped it")
            assert heard == [99]  # held until the block exits
        assert packed.wait(10) and aborted.wait(10)
        assert heard == [99, (1, 2, 3, 4)]
        sends = [rig.sender(rp) for rp in plans]
        for i, (s, chunks, state) in enumerate(sends):
            rig.send_all(s, chunks, state)
            want = Status.FAILED if i == 2 else Status.SUCCESS
            assert recvs[i].wait(10) is want, recvs[i].reason
            assert s.wait(10) is want, s.reason
        assert "aborted by decode" in str(sends[2][0].reason)
        for rp in plans[:2] + plans[3:]:
            assert landed(rig, rp), "bytes differ"
    finally:
        rig.close()
