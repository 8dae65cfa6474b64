"""Malformed, unknown, oversized and out-of-place control messages: each is answered with
an ErrorReply saying why, no thread dies, and the agent keeps serving handoffs.

The deployment is open (``insecure``): with the deployment secret, a message that is not
signed is refused before it is read at all (tests/security/test_control_auth.py), so the
parser would never see this junk."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvhandoff.lab.testing.rig import Rig
from kvhandoff.protocol import (
    MAX_MESSAGE_BYTES,
    ErrorReply,
    Outcome,
    RankId,
    TransferInit,
    TransferStatus,
    decode_message,
    encode_message,
)


@pytest.fixture
def rig(open_rig: Rig) -> Rig:
    return open_rig


JUNK = [
    pytest.param([b""], "malformed", id="empty"),
    pytest.param([b"\xc1garbage"], "malformed", id="not-msgpack"),
    pytest.param([msgspec.msgpack.encode({"type": "Nope", "x": 1})], "malformed", id="unknown"),
    pytest.param([msgspec.msgpack.encode({"type": "Heartbeat", "seq": -1, "sender": "x"})],
                 "malformed", id="out-of-range"),
    pytest.param([msgspec.msgpack.encode({"type": "Hello", "protocol_version": 99})],
                 "version", id="future-version"),
    pytest.param([b"a", b"b"], "one frame", id="two-frames"),
    pytest.param([b"\x00" * (MAX_MESSAGE_BYTES + 1)], "exceeds", id="oversized"),
]


def _ask(endpoint: str, frames: list[bytes], timeout_ms: int = 60_000) -> ErrorReply:
    """The agent's answer to ``frames``. The wait bounds a broken agent, it times nothing:
    under CPU hogs an oversized message took its answer past 5 s, and then the socket,
    left open, made ``ctx.term()`` hang the whole run instead of failing the test."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        s.send_multipart(frames)
        assert s.poll(timeout_ms), "no answer"
        reply = decode_message(s.recv())
    finally:
        s.close()
        ctx.term()
    assert isinstance(reply, ErrorReply)
    return reply


@pytest.mark.parametrize(("frames", "says"), JUNK)
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_junk_gets_an_error_reply_and_nothing_dies(rig: Rig, frames: list[bytes], says: str,
                                                   side: str) -> None:
    agent = rig.prefill if side == "prefill" else rig.decode
    reply = _ask(agent.endpoint, frames)
    assert says in reply.reason.lower()
    assert agent.stats["malformed"] == 1 and agent.stats.get("handler_errors", 0) == 0
    rig.handoff(rig.plan(1))  # still serving


def test_out_of_place_messages_are_refused_with_reasons(rig: Rig) -> None:
    rank = RankId(instance="x")
    status = TransferStatus(request_id=5, rank=rank, chunk=0, last=True, outcome=Outcome.SUCCESS)
    reply = _ask(rig.prefill.endpoint, [encode_message(status)])
    assert "does not accept TransferStatus" in reply.reason and reply.request_id == 5
    init = TransferInit(request_id=6, rank=rank, indices={})
    reply = _ask(rig.prefill.endpoint, [encode_message(init)])
    assert "unknown decode peer" in reply.reason and reply.request_id == 6
    reply = _ask(rig.decode.endpoint, [encode_message(init)])
    assert "does not accept TransferInit" in reply.reason
    rig.handoff(rig.plan(2))
