"""An agent's control channel ticks and hears from the moment it opens, before the agent
has handed it to its heartbeats: a slow start (a loaded machine, a process short of
descriptors) logged ``AssertionError`` tracebacks from the tick handler, which failed
``tests/security/test_descriptor_flood.py`` now and then. Until the channel is set,
heartbeats do nothing and drop what they would have answered."""

from __future__ import annotations

import time

from kvhandoff.protocol import ErrorReply, Heartbeat, HeartbeatAck
from kvhandoff.session.config import SessionConfig
from kvhandoff.session.control.channel import Origin
from kvhandoff.session.rank.liveness.heartbeats import Heartbeats


def test_heartbeats_wait_for_their_channel() -> None:
    posted: list[object] = []
    beats = Heartbeats(SessionConfig(), name="starting", post=lambda ep, m: posted.append(m))
    origin = Origin(endpoint="tcp://127.0.0.1:1", identity=None)
    beats.tick(time.monotonic(), None)  # used to raise AssertionError
    assert beats.on_message(origin, Heartbeat(seq=1, sender="tcp://127.0.0.1:1"))
    assert beats.on_message(origin, HeartbeatAck(seq=1, sender="tcp://127.0.0.1:1"))
    assert not beats.on_message(origin, ErrorReply(reason="x"))  # not a heartbeat: passed on
    assert posted == []
