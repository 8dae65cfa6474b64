"""Strangers on the control socket cannot grow a prefill rank's tables without bound,
evict what real requests left, make it dial addresses of their choosing, or flood its
log; the decode's handshake waits as long as ``bootstrap_timeout`` says. A legitimate
handoff before and after each attack is byte-exact (findings M1, M3, M5, M6, M7, L6, L7).

The deployment here is open (``insecure``): the strangers must get as far as a
handshake, which without the secret they now cannot (test_control_auth.py); the bounds
hold the same for a holder of the secret."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.fixtures import (
    OPEN,
    instance,
    no_leaked_threads,
    open_bootstrap,
    open_rig,
)
from kvhandoff.lab.testing.hostile import Impostor, eventually, exact, hello_as, prefill_desk
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.protocol import (
    Abort,
    AbortAck,
    ErrorReply,
    Hello,
    HelloAck,
    HelloReject,
    IndexListMsg,
    TransferInit,
    decode_message,
    encode_message,
)
from kvhandoff.session import Sender, Status
from kvhandoff.session.peers import decode_ranks as peers
from kvhandoff.session.peers import prefill_groups as groups
from kvhandoff.session.rank import backlog
from kvhandoff.session.request.chunks import KvCursor
from kvhandoff.transport import Transport, create_transport

FIXTURES = (instance, no_leaked_threads, open_bootstrap, open_rig)  # imported for pytest


@pytest.fixture
def rig(open_rig: Rig) -> Rig:
    """The rig of this module: an open deployment (see the module docstring)."""
    return open_rig


@pytest.fixture
def attacker_tcp() -> Iterator[Transport]:
    """The attacker's own tcp transport: what its Hellos name as their data endpoint."""
    t = create_transport("tcp")
    t.endpoint()
    yield t
    t.close()


def _handshaken(rig: Rig, ctx: zmq.Context[zmq.Socket[bytes]], tcp: Transport) -> Impostor:
    imp = Impostor(rig.prefill.endpoint, ctx=ctx)
    imp.send(hello_as(rig.decode, control_endpoint=imp.endpoint,
                      transport_endpoint=tcp.endpoint()))
    assert isinstance(imp.answer(), HelloAck)
    return imp


def test_decode_peers_are_capped_and_idle_ones_reclaimed(
        rig: Rig, ctx: zmq.Context[zmq.Socket[bytes]], attacker_tcp: Transport,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "MAX_DECODE_PEERS", 4)
    first = rig.plan(1)
    rig.handoff(first)
    imps = [Impostor(rig.prefill.endpoint, ctx=ctx) for _ in range(10)]
    try:
        for imp in imps:
            imp.send(hello_as(rig.decode, control_endpoint=imp.endpoint,
                              transport_endpoint=attacker_tcp.endpoint()))
        answers = [imp.answer() for imp in imps]
        acks = [a for a in answers if isinstance(a, HelloAck)]
        rejects = [a for a in answers if isinstance(a, HelloReject)]
        assert len(acks) == 3 and len(rejects) == 7, answers  # the real decode is the 4th
        assert all("MAX_DECODE_PEERS" in r.problems[0] for r in rejects)
        assert rig.prefill.stats["decode_peers"] == 4
        monkeypatch.setattr(peers, "PEER_IDLE_S", 0.2)  # zombies (and the idle real one) go
        assert eventually(lambda: rig.prefill.stats["decode_peers"] == 0)
    finally:
        for imp in imps:
            imp.close()
    monkeypatch.setattr(peers, "PEER_IDLE_S", 600.0)
    second = rig.plan(2, block=2)
    rig.handoff(second)  # the real decode handshakes again, transparently
    assert rig.prefill.stats["decode_peers"] == 1
    assert exact(rig, [first, second]) == []


def test_a_hello_from_an_unnamed_client_is_refused_without_dialing(
        rig: Rig, ctx: zmq.Context[zmq.Socket[bytes]], attacker_tcp: Transport) -> None:
    named = Impostor(rig.prefill.endpoint, ctx=ctx)  # only its ROUTER is used
    anon = ctx.socket(zmq.DEALER)
    anon.setsockopt(zmq.LINGER, 0)
    try:
        anon.connect(rig.prefill.endpoint)
        anon.send(encode_message(hello_as(rig.decode, control_endpoint=named.endpoint,
                                          transport_endpoint=attacker_tcp.endpoint())))
        assert anon.poll(10_000)
        assert isinstance(decode_message(anon.recv()), HelloReject)
        assert named.answer(0.2) is None  # nothing dialed the endpoint it named
        assert rig.prefill.stats["decode_peers"] == 0
    finally:
        anon.close(linger=0)
        named.close()
    rig.handoff(rig.plan(1))
    assert exact(rig, [rig.plan(1)]) == []


def test_aborts_from_strangers_are_answered_on_their_connection_never_dialed(
        rig: Rig, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    rig.handoff(rig.plan(1))
    dealers = len(rig.prefill._control._dealers)  # type: ignore[union-attr]
    rank = hello_as(rig.decode, control_endpoint="", transport_endpoint=b"").rank
    imps = [Impostor(rig.prefill.endpoint, ctx=ctx, listen=False,
                     identity=f"tcp://127.0.0.1:{1 + i}") for i in range(30)]
    try:
        for i, imp in enumerate(imps):
            imp.send(Abort(request_id=10_000 + i, rank=rank, reason="spoofed"))
        for imp in imps:  # before the fix: sent to tcp://127.0.0.1:<i> on a new DEALER
            assert isinstance(imp.answer(5.0), AbortAck)
        assert len(rig.prefill._control._dealers) == dealers  # type: ignore[union-attr]
    finally:
        for imp in imps:
            imp.close()
    rig.handoff(rig.plan(2, block=2))
    assert exact(rig, [rig.plan(1), rig.plan(2, block=2)]) == []


def test_a_flood_of_aborts_cannot_evict_a_real_tombstone(
        rig: Rig, ctx: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backlog, "MAX_TOMBSTONES", 8)
    monkeypatch.setattr(backlog, "MAX_EARLY_ABORTS", 8)
    first = rig.plan(1)
    rig.handoff(first)
    doomed = Sender(rig.prefill, 500)
    doomed.abort("the engine gave up")
    desk = prefill_desk(rig)
    assert doomed.wait(5) is Status.FAILED
    assert eventually(lambda: 500 in desk.backlog.tombstones)
    rank = hello_as(rig.decode, control_endpoint="", transport_endpoint=b"").rank
    with Impostor(rig.prefill.endpoint, ctx=ctx) as imp:  # it answers on either path
        for rid in range(1000, 1100):
            imp.send(Abort(request_id=rid, rank=rank, reason="sweep"))
        assert all(isinstance(imp.answer(5.0), AbortAck) for _ in range(100))
    assert 500 in desk.backlog.tombstones  # before the fix: evicted by the sweep
    assert len(desk.backlog.tombstones) <= 8 and len(desk.backlog.early) <= 8
    second = rig.plan(2, block=2)
    rig.handoff(second)
    assert exact(rig, [first, second]) == []


def test_buffered_indices_ids_and_reasons_are_bounded(
        rig: Rig, ctx: zmq.Context[zmq.Socket[bytes]], attacker_tcp: Transport,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backlog, "MAX_INIT_BYTES", 64 << 10)
    first = rig.plan(1)
    rig.handoff(first)
    desk = prefill_desk(rig)
    imp = _handshaken(rig, ctx, attacker_tcp)
    try:
        rank = hello_as(rig.decode, control_endpoint="", transport_endpoint=b"").rank

        def init(rid: int | str, nbytes: int) -> TransferInit:
            return TransferInit(request_id=rid, rank=rank,
                                indices={"kv": IndexListMsg(items=bytes(nbytes))})

        imp.send(init(7000, 40 << 10))
        imp.send(init(7000, 40 << 10))  # a repeat from the same rank: the first stands
        imp.send(init(7001, 40 << 10))  # over MAX_INIT_BYTES: refused, loudly
        refused = imp.answer()
        assert isinstance(refused, ErrorReply) and "MAX_INIT_BYTES" in refused.reason
        assert refused.request_id == 7001
        assert len(desk.backlog.inits[7000]) == 1 and 7001 not in desk.backlog.inits
        imp.send(init("x" * (2 << 20), 8))  # a 2 MiB request id
        big = imp.answer()
        assert isinstance(big, ErrorReply) and "request id of" in big.reason
        imp.send(Abort(request_id="y" * (2 << 20), rank=rank, reason="r"))
        big = imp.answer()
        assert isinstance(big, ErrorReply) and "request id of" in big.reason
        imp.send(init(7002, 8))  # indices first: only the request's own peer may abort it
        imp.send(Abort(request_id=7002, rank=rank, reason="z" * (2 << 20)))
        assert isinstance(imp.answer(), AbortAck)
        tomb = desk.backlog.early[7002]
        assert len(tomb.reason) <= backlog.MAX_REASON
    finally:
        imp.close()
    second = rig.plan(2, block=2)
    rig.handoff(second)
    assert exact(rig, [first, second]) == []


def test_hellos_naming_a_blackhole_do_not_hold_the_agent(
        open_bootstrap: BootstrapServer, instance: str,
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Six Hellos name a data port that accepts and never answers (the prefill waits up
    to its 30 s connect timeout on each): the agent's two workers stay free, and another
    decode deployment handshakes and hands off meanwhile."""
    rig = Rig(open_bootstrap.url, instance, prefill_cfg=OPEN, decode_cfg=OPEN,
              prefill_transport=create_transport("tcp", connect_timeout=30.0))
    hole = socket.create_server(("127.0.0.1", 0), backlog=64)  # never accepts, never answers
    imps: list[Impostor] = []
    try:
        first = rig.plan(1)
        rig.handoff(first)
        ep = json.loads(rig.decode.transport.endpoint())
        ep["port"] = hole.getsockname()[1]
        received = rig.prefill.stats["received"]
        imps = [Impostor(rig.prefill.endpoint, ctx=ctx) for _ in range(6)]
        for imp in imps:
            imp.send(hello_as(rig.decode, control_endpoint=imp.endpoint,
                              transport_endpoint=json.dumps(ep).encode()))
        assert eventually(lambda: rig.prefill.stats["received"] >= received + 6)
        ran = threading.Event()
        rig.prefill.spawn(ran.set)  # before the fix: queued behind six 30 s dials
        assert ran.wait(10)
        other = rig.add_decode(decode_cfg=OPEN)
        rig.handoff(rig.plan(2, block=2), on=other)
    finally:
        hole.close()  # the dials fail at once now
        for imp in imps:
            imp.close()
        rig.close()


class _CountingCondition(threading.Condition):
    """A group's condition whose timed waits return after a millisecond, counted: the
    wait loop runs many times in a moment of real time."""

    waits = 0
    many = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        cls = type(self)
        cls.waits += 1
        if cls.waits >= 200:
            cls.many.set()
        return super().wait(None if timeout is None else min(timeout, 0.001))


def test_the_handshake_waits_for_the_whole_bootstrap_timeout(
        open_bootstrap: BootstrapServer, instance: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill answers Hello only once the decode's handshake wait woke 200 times
    (the old loop gave up after 65 wake-ups, ~6.5 s, whatever the timeout); the decode's
    bootstrap_timeout (30 s) is far from over, so the handoff must succeed."""
    init = groups.PrefillGroup.__init__

    def counting(self: groups.PrefillGroup, key: groups.GroupKey) -> None:
        init(self, key)
        self._cond = _CountingCondition()

    monkeypatch.setattr(groups.PrefillGroup, "__init__", counting)
    monkeypatch.setattr(_CountingCondition, "waits", 0)
    monkeypatch.setattr(_CountingCondition, "many", threading.Event())
    rig = Rig(open_bootstrap.url, instance, prefill_cfg=OPEN,
              decode_cfg={**OPEN, "bootstrap_timeout": 30.0})
    try:
        answers = prefill_desk(rig).peers
        answer = answers.answer

        def late(sender: str | None, hello: Hello) -> None:
            _CountingCondition.many.wait(20)
            answer(sender, hello)

        monkeypatch.setattr(answers, "answer", late)
        rp = rig.plan(1)
        rig.handoff(rp)
        assert _CountingCondition.waits >= 200
        assert exact(rig, [rp]) == []
    finally:
        _CountingCondition.many.set()
        rig.close()


def test_junk_is_logged_at_a_bounded_rate(rig: Rig, ctx: zmq.Context[zmq.Socket[bytes]],
                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvhandoff.session.control.channel")
    with Impostor(rig.prefill.endpoint, ctx=ctx, listen=False,
                  identity="tcp://127.0.0.1:1") as imp:
        for i in range(50):
            imp.dealer.send(b"\xc1junk %d" % i)
        assert all(isinstance(imp.answer(5.0), ErrorReply) for _ in range(50))
    junk = [m for m in caplog.messages if "malformed control message" in m]
    assert len(junk) <= 1, len(junk)  # before the fix: one line per message
    assert rig.prefill.stats["malformed"] == 50
    rig.handoff(rig.plan(1))
    assert exact(rig, [rig.plan(1)]) == []


def test_a_hostile_first_row_is_named_as_such() -> None:
    cursor = KvCursor(component="kv", dst_items=np.arange(2, dtype=np.int64),
                      dst_first_row=1 << 62, src_page=4, dst_page=4, prefix_len=0,
                      num_pages=2, num_tokens=None, repageable=True)
    problem = cursor.problem()
    assert problem is not None and "first_row" in problem
    assert "page sizes differ" not in problem
