"""The control plane with the deployment secret (findings H2, H3, M6; 2f, 4c, 4d): every
control message is signed and checked (kvhandoff.session.control.auth). Strangers without
the secret, even claiming a real peer's endpoint, change nothing and learn nothing; a
captured frame cannot be replayed; a peer with another secret (or none) fails at its
handshake, saying so; an authenticated peer that is not a request's own peer cannot
abort it or report on it; and a second set of indices for a request fails it on both
sides instead of handing the KV to whoever sent them first. A legitimate handoff before
and after each attack is byte-exact."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.fixtures import bootstrap, instance, no_leaked_threads
from kvhandoff.lab.testing.hostile import (
    Impostor,
    eventually,
    exact,
    hello_as,
    memory_problems,
    prefill_desk,
)
from kvhandoff.lab.testing.rig import Rig, config
from kvhandoff.protocol import (
    Abort,
    ErrorCode,
    ErrorReply,
    Heartbeat,
    IndexListMsg,
    Message,
    Outcome,
    TransferInit,
    TransferStatus,
    decode_message,
    encode_message,
)
from kvhandoff.secret import PURPOSE_CONTROL, Secret, data_key, write_secret_file
from kvhandoff.session import Agent, Status
from kvhandoff.session.control.auth import (
    HEADER_BYTES,
    MAGIC,
    UNAUTHENTICATED,
    Signer,
    Stream,
    is_signed,
)
from kvhandoff.session.errors import HandshakeError
from kvhandoff.transport import create_transport

FIXTURES = (bootstrap, instance, no_leaked_threads)  # imported for pytest
HINT = "control message not authenticated: is KVHANDOFF_SECRET_FILE the same on both sides?"


@pytest.fixture
def arig(secure: BootstrapServer, instance: str, secret_file: str) -> Iterator[Rig]:
    """The rig, both agents holding the deployment secret."""
    r = Rig(secure.url, instance, prefill_cfg={"secret_file": secret_file},
            decode_cfg={"secret_file": secret_file})
    yield r
    r.close()
    assert r.prefill.live_requests == 0 and r.decode.live_requests == 0



def _payload(frame: bytes) -> bytes:
    """The message in a frame, past its authentication header if it has one (read as a
    stranger can: it cannot check the MAC)."""
    if not is_signed(frame):
        return frame
    n = int.from_bytes(frame[HEADER_BYTES - 2:HEADER_BYTES], "big")
    return frame[HEADER_BYTES + n:]


def _forged(msg: Message, *, sender: str, to: str) -> bytes:
    """``msg`` in a well-formed header naming ``sender``, signed with another secret."""
    key = Secret.from_bytes(b"not the deployment secret, 32 B+").key(PURPOSE_CONTROL)
    return Signer(key, endpoint=sender, now=time.time()).seal(
        encode_message(msg), recipient=to.encode(), stream=Stream.DEALER, now=time.time())


def _answers(imp: Impostor, timeout: float = 10.0) -> list[Message]:
    """What reached the stranger's DEALER: the first answer (bounded wait), and any more
    already there."""
    out: list[Message] = []
    wait = int(timeout * 1000)
    while imp.dealer.poll(wait):
        out.append(decode_message(_payload(imp.dealer.recv())))
        wait = 0
    return out


def _route_back(a: Agent, b: Agent) -> None:
    """Wait (bounded) until ``a`` hears ``b``'s answers on its own connection again: a
    stranger that claimed ``a``'s endpoint at ``b`` took that route over while it was
    connected (ZeroMQ hands an identity to its newest connection; ``a`` reconnects)."""
    def pinged() -> bool:
        before = a.stats["received"]
        a.post(b.endpoint, Heartbeat(seq=0, sender=a.endpoint))
        return eventually(lambda: a.stats["received"] > before, 0.5)
    assert eventually(pinged, 20)


def _finish(rig: Rig, rp: Any, s: Any, chunks: Any, state: Any, r: Any) -> None:
    rig.send_all(s, chunks, state)
    assert r.wait(10) is Status.SUCCESS, r.reason
    assert s.wait(10) is Status.SUCCESS, s.reason


def test_handoffs_are_authenticated_and_byte_exact(arig: Rig) -> None:
    first, second = arig.plan(1), arig.plan(2, block=1)
    arig.handoff(first)
    arig.handoff(second)
    for a in (arig.prefill, arig.decode):
        assert a._control is not None and a._control.authenticated
        assert a.stats["unauthenticated"] == 0 and a.stats["not_request_peer"] == 0
    assert exact(arig, [first, second]) == []


STRANGERS = [("prefill", "abort"), ("prefill", "steal"), ("prefill", "hello"),
             ("prefill", "forged_mac"), ("decode", "abort"), ("decode", "status"),
             ("decode", "unknown_peer"), ("decode", "hello")]


@pytest.mark.parametrize(("target", "attack"), STRANGERS)
def test_strangers_without_the_secret_change_nothing(
        arig: Rig, ctx: zmq.Context[zmq.Socket[bytes]], target: str, attack: str) -> None:
    """A process without the secret that claims the other side's endpoint (the identity
    a real peer's messages carry, which made each of these work before) sends each attack
    against a live request: refused, counted, answered (if the answer reaches it: the
    real peer may have taken its identity back) with nothing but "not authenticated", and
    the request completes. "steal" sends indices before the real decode does."""
    first, rp = arig.plan(1), arig.plan(2, block=1)
    arig.handoff(first)
    victim, peer = (arig.prefill, arig.decode) if target == "prefill" else \
        (arig.decode, arig.prefill)
    s, chunks, state = arig.sender(rp)  # live on prefill: waiting for decode's indices
    live = target == "decode" or attack in ("abort", "forged_mac")
    r = arig.receiver(rp) if live else None  # decode's indices in: the peer is known
    if r is not None:
        assert eventually(lambda: s.status is Status.WAITING_FOR_INPUT)
    rank = hello_as(arig.decode, control_endpoint="", transport_endpoint=b"").rank
    bad: Message
    if attack == "abort" or attack == "forged_mac":
        bad = Abort(request_id=rp.rid, rank=rank, reason="spoofed")
    elif attack == "steal":
        bad = TransferInit(request_id=rp.rid, rank=rank,
                           indices={"kv": IndexListMsg.of(range(8))})
    elif attack == "unknown_peer":  # finding 4a step 4: drop decode's handshake
        bad = ErrorReply(reason="forget me", request_id=rp.rid, code=ErrorCode.UNKNOWN_PEER)
    elif attack == "status":
        bad = TransferStatus(request_id=rp.rid, rank=arig.prefill.rank_id, chunk=0, last=True,
                             outcome=Outcome.FAILED, reason="forged by a stranger")
    else:
        bad = hello_as(arig.decode, control_endpoint=peer.endpoint,
                       transport_endpoint=arig.decode.transport.endpoint())
    before = victim.stats["unauthenticated"]
    peers = arig.prefill.stats["decode_peers"], arig.decode.stats["prefill_peers"]
    with Impostor(victim.endpoint, ctx=ctx, listen=False, identity=peer.endpoint) as imp:
        if attack == "forged_mac":
            imp.dealer.send(_forged(bad, sender=peer.endpoint, to=victim.endpoint))
        else:
            imp.send(bad)
        assert eventually(lambda: victim.stats["unauthenticated"] == before + 1)
        leaked = _answers(imp, 0)
    assert all(a == ErrorReply(reason=UNAUTHENTICATED) for a in leaked), leaked
    _route_back(peer, victim)
    assert s.status is not Status.FAILED and (r is None or r.status is not Status.FAILED)
    assert (arig.prefill.stats["decode_peers"], arig.decode.stats["prefill_peers"]) == peers
    if r is None:
        r = arig.receiver(rp)
    _finish(arig, rp, s, chunks, state, r)
    assert exact(arig, [first, rp]) == []


@pytest.mark.parametrize("target", ["prefill", "decode"])
def test_a_stranger_hears_only_that_it_is_not_authenticated(
        arig: Rig, ctx: zmq.Context[zmq.Socket[bytes]], target: str) -> None:
    """From its own connection, whatever it sends (a message, a forged header, junk) is
    answered with the same one sentence; nothing reaches the desks."""
    victim = arig.prefill if target == "prefill" else arig.decode
    rank = hello_as(arig.decode, control_endpoint="", transport_endpoint=b"").rank
    abort = Abort(request_id=1, rank=rank, reason="x")
    msg = encode_message(abort)
    sends: list[list[bytes]] = [
        [msg], [_forged(abort, sender=arig.decode.endpoint, to=victim.endpoint)],
        [_forged(abort, sender="tcp://127.0.0.1:1", to=victim.endpoint)],
        [MAGIC + bytes(HEADER_BYTES) + msg], [b"\xc1junk"], [MAGIC, msg]]
    with Impostor(victim.endpoint, ctx=ctx, listen=False, identity="tcp://127.0.0.1:1") as imp:
        for frames in sends:
            imp.dealer.send_multipart(frames)
            assert _answers(imp) == [ErrorReply(reason=UNAUTHENTICATED)]
    assert victim.stats["unauthenticated"] == len(sends)
    assert victim.stats["received"] == 0 and victim.stats["malformed"] == 0
    rp = arig.plan(1)
    arig.handoff(rp)
    assert exact(arig, [rp]) == []


class _Tap:
    """A DEALER that records the frames it sends (a wiretap on a real peer's link)."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self.sent: list[bytes] = []

    def send(self, frame: bytes, flags: int = 0) -> None:
        self.sent.append(bytes(frame))
        self.sock.send(frame, flags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def test_a_captured_frame_cannot_be_replayed(arig: Rig,
                                             ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """The real decode's signed TransferInit, captured on the wire and sent again on the
    same connection or on a new one claiming the decode's endpoint, is refused: its
    sequence number was seen (finding 4d's replay variant)."""
    first, rp = arig.plan(1), arig.plan(2, block=1)
    arig.handoff(first)
    ch = arig.decode._control
    assert ch is not None
    with ch._dlock:
        d = ch._dealers[arig.prefill.endpoint]
        tap = _Tap(d.sock)
        d.sock = tap  # type: ignore[assignment]
    arig.handoff(rp)
    inits = [f for f in tap.sent if isinstance(decode_message(_payload(f)), TransferInit)]
    assert len(inits) == 1 and is_signed(inits[0])
    desk = prefill_desk(arig)
    before = arig.prefill.stats["unauthenticated"]
    with ch._dlock:
        tap.sock.send(inits[0])  # replayed on the decode's own connection
    assert eventually(lambda: arig.prefill.stats["unauthenticated"] == before + 1)
    with Impostor(arig.prefill.endpoint, ctx=ctx, listen=False,
                  identity=arig.decode.endpoint) as imp:
        imp.dealer.send(inits[0])  # and from a new connection
        assert eventually(lambda: arig.prefill.stats["unauthenticated"] == before + 2)
    assert rp.rid not in desk.backlog.inits and rp.rid not in desk.senders  # nothing buffered
    _route_back(arig.decode, arig.prefill)
    third = arig.plan(3, block=2)
    arig.handoff(third)
    assert exact(arig, [first, rp, third]) == []


def test_a_frame_signed_under_a_peers_name_does_not_silence_it(
        arig: Rig, secret_file: str, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Finding "lower": a holder of the secret sends the decode one frame naming the
    prefill, from a "run" of the prefill that starts a minute from now. Before, the
    decode then took every frame the real prefill sent it for a replay from an earlier
    run (statuses, aborts, acks: requests failed after their timeouts). Now the real
    prefill's frames still verify, and the next handoff is exact."""
    first, rp = arig.plan(1), arig.plan(2, block=1)
    arig.handoff(first)
    later = time.time() + 60  # inside the ±120 s window
    key = Secret.load(secret_file).key(PURPOSE_CONTROL)
    forger = Signer(key, endpoint=arig.prefill.endpoint, now=later)
    beat = encode_message(Heartbeat(seq=1, sender=arig.prefill.endpoint))
    before = arig.decode.stats["received"]
    with Impostor(arig.decode.endpoint, ctx=ctx, listen=False,
                  identity="tcp://127.0.0.1:1") as imp:
        imp.dealer.send(forger.seal(beat, recipient=arig.decode.endpoint.encode(),
                                    stream=Stream.DEALER, now=later))
        assert eventually(lambda: arig.decode.stats["received"] > before)  # it verified
    refused, heard = arig.decode.stats["unauthenticated"], arig.decode.stats["received"]
    arig.prefill.post(arig.decode.endpoint, Heartbeat(seq=2, sender=arig.prefill.endpoint))
    assert eventually(lambda: arig.decode.stats["received"] > heard
                      or arig.decode.stats["unauthenticated"] > refused)
    assert arig.decode.stats["unauthenticated"] == refused  # the real prefill still heard
    arig.handoff(rp)
    assert arig.decode.stats["unauthenticated"] == refused
    assert exact(arig, [first, rp]) == []


@pytest.mark.parametrize("misfit", ["other_secret", "decode_without", "prefill_without"])
def test_a_peer_without_the_same_secret_fails_its_handshake_saying_why(
        instance: str, secret_file: str, tmp_path: Path, misfit: str) -> None:
    """At start-up (``Agent.handshake``), not mid-request and not after a timeout: the
    handshake error names the cause, and the prefill counts what it refused. (The
    bootstrap server here takes anyone's registration: it is not what is tested.)"""
    other = write_secret_file(tmp_path / "other")
    mine = {"secret_file": secret_file}
    pcfg = {"insecure": True} if misfit == "prefill_without" else mine
    dcfg = {"other_secret": {"secret_file": other}, "decode_without": {"insecure": True}
            }.get(misfit, mine)
    with BootstrapServer(insecure=True) as srv:
        rig = Rig(srv.url, instance, prefill_cfg=pcfg, decode_cfg=dcfg)
        try:
            err = rig.decode.handshake(srv.url)
            assert isinstance(err, HandshakeError), err
            assert HINT in str(err), err  # not "no answer to Hello within bootstrap_timeout"
            assert rig.prefill.stats["unauthenticated"] >= 1
            assert rig.prefill.stats["decode_peers"] == 0  # nothing was dialed or kept
        finally:
            rig.close()


def test_the_secret_file_is_checked_when_the_agent_starts(secure: BootstrapServer,
                                                          instance: str, secret_file: str,
                                                          tmp_path: Path) -> None:
    Path(secret_file).chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        Rig(secure.url, instance, prefill_cfg={"secret_file": secret_file},
            decode_cfg={"secret_file": secret_file})


def test_an_authenticated_stranger_cannot_abort_or_report_on_anothers_request(
        arig: Rig, secure: BootstrapServer, instance: str, secret_file: str) -> None:
    """Holders of the secret that are not the request's peers: another decode rank aborts
    the prefill's live request (and poisons a future id), another prefill rank sends the
    decode a failed status and an Abort. Each is ignored and counted (findings 4c/M6)."""
    first, rp, later = arig.plan(1), arig.plan(2, block=1), arig.plan(3, block=2)
    arig.handoff(first)
    other = arig.add_decode(decode_cfg={"secret_file": secret_file}).agent
    rogue = Agent.prefill(arig.src, bootstrap_url=secure.url,
                          transport=create_transport("tcp", data_secret=data_key(secret_file)),
                          config=config(instance + "-rogue", secret_file=secret_file))
    try:
        s, chunks, state = arig.sender(rp)
        r = arig.receiver(rp)
        assert eventually(lambda: s.status is Status.WAITING_FOR_INPUT)
        rank = other.rank_id
        other.post(arig.prefill.endpoint, Abort(request_id=rp.rid, rank=rank, reason="not yours"))
        other.post(arig.prefill.endpoint, Abort(request_id=later.rid, rank=rank,
                                                reason="poisoned in advance"))
        assert eventually(lambda: arig.prefill.stats["not_request_peer"] == 2)
        assert later.rid not in prefill_desk(arig).backlog.early  # no tombstone for a future id
        rogue.post(arig.decode.endpoint, TransferStatus(
            request_id=rp.rid, rank=rogue.rank_id, chunk=0, last=True,
            outcome=Outcome.FAILED, reason="forged by a secret holder"))
        rogue.post(arig.decode.endpoint, Abort(request_id=rp.rid, rank=rogue.rank_id,
                                               reason="not yours either"))
        assert eventually(lambda: arig.decode.stats["not_request_peer"] == 2)
        assert s.status is Status.WAITING_FOR_INPUT and r.status is not Status.FAILED
        assert arig.prefill.stats["unauthenticated"] == arig.decode.stats["unauthenticated"] == 0
        _finish(arig, rp, s, chunks, state, r)
        arig.handoff(later)  # the id "poisoned in advance" hands off
    finally:
        rogue.close()
    assert exact(arig, [first, rp, later]) == []


@pytest.mark.parametrize("sender_first", [True, False])
def test_without_a_key_a_second_set_of_indices_fails_the_request_on_both_sides(
        arig: Rig, secret_file: str, sender_first: bool) -> None:
    """Finding H2 ("steal") by a secret holder, for a request without a key
    (kvhandoff.binding, test_binding.py, is the fix): a rogue decode of the same layout
    sends its indices for the request first, then the real decode does. Before: the
    rogue got an exact copy of the KV and the real decode starved. Without a key the
    prefill cannot tell them apart: once the Sender has both (at once, or when it
    starts), the request fails on the prefill and both decodes, naming the reason, and
    no byte is written to either."""
    first, rp = arig.plan(1), arig.plan(2, block=1)
    arig.handoff(first)
    rogue = arig.add_decode(decode_cfg={"secret_file": secret_file})
    s = arig.sender(rp)[0] if sender_first else None
    bad = arig.receiver(rp, on=rogue)
    if s is not None:
        assert eventually(lambda: s.status is Status.WAITING_FOR_INPUT)
    else:
        assert eventually(lambda: rp.rid in prefill_desk(arig).backlog.inits)
    good = arig.receiver(rp)
    if s is None:
        assert eventually(lambda: len(prefill_desk(arig).backlog.inits.get(rp.rid, ())) == 2)
        s = arig.sender(rp)[0]  # judges both sets when it starts
    for r in (bad, good):
        assert r.wait(10) is Status.FAILED
        assert "two endpoints" in str(r.reason), r.reason
    assert s.wait(10) is Status.FAILED and "two endpoints" in str(s.reason), s.reason
    assert bad.wait_released(10) and good.wait_released(10)  # AbortAcks: nothing in flight
    assert memory_problems(arig, rogue, [], failed=[rp]) == []
    assert memory_problems(arig, arig.decodes[0], [first], failed=[rp]) == []
    later = arig.plan(3, block=2)
    arig.handoff(later)
    assert memory_problems(arig, arig.decodes[0], [first, later], failed=[rp]) == []


def test_an_abort_reason_from_the_requests_peer_is_bounded(arig: Rig) -> None:
    """The real decode aborts a request whose indices wait for a Sender, with a 2 MiB
    reason: the tombstone keeps a bounded reason, and the Sender fails on arrival."""
    from kvhandoff.session.rank import backlog

    rp = arig.plan(2, block=1)
    r = arig.receiver(rp)
    desk = prefill_desk(arig)
    assert eventually(lambda: rp.rid in desk.backlog.inits)
    r.abort("z" * (2 << 20))
    assert eventually(lambda: rp.rid in desk.backlog.early)
    assert len(desk.backlog.early[rp.rid].reason) <= backlog.MAX_REASON
    assert rp.rid not in desk.backlog.inits
    s = arig.sender(rp)[0]
    assert s.wait(10) is Status.FAILED and "aborted by decode" in str(s.reason)
    assert r.wait_released(10)
