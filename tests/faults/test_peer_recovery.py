"""Prefill's view of a decode rank after trouble on the data path: a broken data
connection is re-dialed when the rank is next needed; a rank that cannot be reached, or
that was asked to handshake again and went silent, fails the request with the reason,
never a wait for indices_timeout."""

from __future__ import annotations

import zmq

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.servers import free_port
from kvhandoff.lab.testing.fixtures import OPEN
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.protocol import Heartbeat, RankId, TransferInit, decode_message, encode_message
from kvhandoff.session import PeerLost, Status
from kvhandoff.session.peers.decode_ranks import DecodePeer
from kvhandoff.transport.errors import PeerLost as TransportPeerLost


def _only_peer(rig: Rig) -> DecodePeer:
    peers = rig.prefill._peers
    assert peers is not None and len(peers) == 1
    return next(iter(peers._peers.values()))


def test_a_broken_data_connection_is_redialed_for_the_next_request(
        bootstrap: BootstrapServer, instance: str) -> None:
    rig = Rig(bootstrap.url, instance)
    try:
        rig.handoff(rig.plan(1))
        old = _only_peer(rig)
        old.transport_peer._fail(TransportPeerLost("test: the data connection broke"))
        assert old.transport_peer.closed
        rig.handoff(rig.plan(2, block=1))  # re-dialed on its indices; nothing fails
        new = _only_peer(rig)
        assert new is not old and not new.transport_peer.closed
        assert new.endpoint == old.endpoint and new.rank == old.rank
    finally:
        rig.close()


def test_an_unreachable_rank_fails_the_request_naming_why(bootstrap: BootstrapServer,
                                                          instance: str) -> None:
    """The failed re-dial is the only way this request can fail: heartbeats get a
    minute, so a loaded machine cannot declare decode lost first (that path fails the
    request too, rightly, but names the loss, not the re-dial)."""
    slow = {"heartbeat_timeout": 60.0}
    rig = Rig(bootstrap.url, instance, prefill_cfg=slow, decode_cfg=slow)
    try:
        rig.handoff(rig.plan(1))
        old = _only_peer(rig)
        old.transport_peer._fail(TransportPeerLost("test: the data connection broke"))
        rig.decode.transport.close()  # and nothing listens there any more
        rp = rig.plan(2, block=1)
        r = rig.receiver(rp)
        s, chunks, state = rig.sender(rp)
        rig.send_all(s, chunks, state)
        assert s.wait(10) is Status.FAILED
        assert isinstance(s.error, PeerLost)
        assert "re-dialing its tcp endpoint failed" in str(s.reason), s.reason
        assert len(rig.prefill._peers or ()) == 0  # the rank was dropped
        assert r.wait(10) is Status.FAILED
    finally:
        rig.close()



def _indices_from(ctx: zmq.Context[zmq.Socket[bytes]], ghost: str, rig: Rig,
                  instance: str) -> None:
    """Send request 1's indices to prefill as a decode rank at control endpoint
    ``ghost`` that prefill never handshook, and wait for prefill's answer (asking it to
    handshake again)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, ghost.encode())
    sock.connect(rig.prefill.endpoint)
    rank = RankId(instance=instance, dp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    sock.send(encode_message(TransferInit(request_id=1, rank=rank, indices={})))
    assert sock.poll(60_000), "no answer to the indices"


def test_indices_from_an_unknown_rank_that_goes_silent_fail_the_request(
        open_bootstrap: BootstrapServer, instance: str) -> None:
    """A decode rank prefill does not know (dropped, or never handshaken) sends indices
    and is asked to handshake again; it never does and answers no heartbeat: the
    request fails on the heartbeat (nothing listens there: its link is down), not on
    indices_timeout (10 minutes: the bounded wait ends long before). (An open
    deployment: the ghost speaks without the secret.)"""
    rig = Rig(open_bootstrap.url, instance, prefill_cfg={**OPEN, "indices_timeout": 600.0},
              decode_cfg=OPEN)
    ctx = zmq.Context()
    try:
        s = rig.sender(rig.plan(1))[0]
        ghost = f"tcp://127.0.0.1:{free_port()}"  # nothing will answer there
        _indices_from(ctx, ghost, rig, instance)
        assert s.wait(120) is Status.FAILED
        assert "asked to handshake again" in str(s.reason), s.reason
        assert ghost in str(s.reason) and "control link is down" in str(s.reason)
    finally:
        ctx.destroy(linger=0)  # every socket, also after a failed assert
        rig.close()


def test_a_rank_whose_process_answers_but_not_its_python_is_busy_not_lost(
        open_bootstrap: BootstrapServer, instance: str) -> None:
    """The same unknown rank, but its process is alive: a ROUTER is bound at its endpoint
    (libzmq answers the link's own heartbeats) and never answers ours, as a peer whose
    interpreter is starved. Prefill keeps the request, busy not lost, while its pings go
    unanswered for many heartbeat timeouts; when the process goes (the socket closes),
    the link drops and the request fails naming it. (Open, as above.)"""
    rig = Rig(open_bootstrap.url, instance, prefill_cfg={**OPEN, "indices_timeout": 600.0},
              decode_cfg=OPEN)
    hb_timeout = rig.prefill_cfg.heartbeat_timeout
    ctx = zmq.Context()
    try:
        s = rig.sender(rig.plan(1))[0]
        busy = ctx.socket(zmq.ROUTER)
        busy.setsockopt(zmq.LINGER, 0)
        ghost = f"tcp://127.0.0.1:{busy.bind_to_random_port('tcp://127.0.0.1')}"
        _indices_from(ctx, ghost, rig, instance)
        pings = 0
        while pings < 3:  # prefill pings the rank it waits on: none is answered
            assert busy.poll(60_000), "prefill does not ping the rank it waits on"
            _, frame = busy.recv_multipart()
            pings += isinstance(decode_message(frame), Heartbeat)
        # silent at our level for well past heartbeat_timeout, alive at the link's
        assert s.wait(3 * hb_timeout) is Status.BOOTSTRAPPING, s.reason
        busy.close()  # the process goes: its link drops
        assert s.wait(120) is Status.FAILED
        assert isinstance(s.error, PeerLost) and ghost in str(s.reason)
        assert "control link is down" in str(s.reason), s.reason
    finally:
        ctx.destroy(linger=0)  # every socket, also after a failed assert
        rig.close()
