"""Prefill's view of a decode rank after trouble on the data path: a broken data
connection is re-dialed when the rank is next needed; a rank that cannot be reached, or
that was asked to handshake again and went silent, fails the request with the reason,
never a wait for indices_timeout."""

from __future__ import annotations

import socket
import time

import zmq

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.fixtures import OPEN
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.protocol import RankId, TransferInit, encode_message
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_indices_from_an_unknown_rank_that_goes_silent_fail_the_request(
        open_bootstrap: BootstrapServer, instance: str) -> None:
    """A decode rank prefill does not know (dropped, or never handshaken) sends indices
    and is asked to handshake again; it never does and answers no heartbeat: the
    request fails within the heartbeat timeout, not indices_timeout. (An open
    deployment: the ghost speaks without the secret.)"""
    rig = Rig(open_bootstrap.url, instance, prefill_cfg={**OPEN, "indices_timeout": 60.0},
              decode_cfg=OPEN)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        s = rig.sender(rig.plan(1))[0]
        ghost = f"tcp://127.0.0.1:{_free_port()}"  # nothing will answer there
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, ghost.encode())
        sock.connect(rig.prefill.endpoint)
        rank = RankId(instance=instance, dp_rank=0, tp_rank=0, tp_size=1, pp_rank=0,
                      pp_size=1)
        sock.send(encode_message(TransferInit(request_id=1, rank=rank, indices={})))
        assert sock.poll(5000), "no answer to the indices"
        t0 = time.monotonic()
        assert s.wait(10) is Status.FAILED
        assert time.monotonic() - t0 < 10  # the heartbeat (1 s), not indices_timeout (60 s)
        assert "asked to handshake again" in str(s.reason), s.reason
        assert ghost in str(s.reason)
    finally:
        sock.close()
        ctx.term()
        rig.close()
