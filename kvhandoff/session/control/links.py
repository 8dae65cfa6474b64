"""Whether each peer's control connection is up, as ZeroMQ knows it: the proof of life
that tells a busy peer from a dead one.

Every DEALER we dial a peer with sends ZMTP heartbeats (``ZMQ_HEARTBEAT_IVL``), and the
peer's libzmq I/O thread answers them: C code that needs no GIL and waits for none of the
peer's Python work, so a peer whose interpreter is starved (CPU hogs, a long handler,
a busy engine) still answers. A dead process's connection resets at once; a frozen one
(stopped, or its host gone) stops answering and libzmq drops the connection after
``ZMQ_HEARTBEAT_TIMEOUT``. A socket monitor per DEALER reports both, and every
reconnection: a link is *up* from a ZMTP handshake until the next disconnection.

:mod:`~kvhandoff.session.rank.liveness.book` then declares a peer lost for silence only
while its link is down (or, as a backstop, after a much longer silence): a peer that
answers at the transport level is alive, however slowly it answers us.

Thread-safety: :func:`heartbeat` runs on whichever thread opens the DEALER (under the
channel's dealer lock); the monitor sockets, and :func:`link_up`, belong to the
channel's I/O thread.
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
         | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_EVENTS_PER_POLL = 64  # monitor events read per link per poll: bounded work per tick


def heartbeat(sock: zmq.Socket[bytes], *, interval: float, timeout: float
              ) -> zmq.Socket[bytes]:
    """Make ``sock`` (a DEALER, before its ``connect``, so no event is missed) send ZMTP
    heartbeats every ``interval`` seconds and drop its connection when nothing answers
    within ``timeout``; returns the monitor socket that reports its link's changes."""
    ivl_ms = max(1, int(interval * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(ivl_ms, int(timeout * 1000)))
    mon: zmq.Socket[bytes] = sock.get_monitor_socket(_UP | _DOWN)
    return mon


def link_up(monitor: zmq.Socket[bytes], up: bool) -> bool:
    """A link's state after its monitor's pending events (read non-blocking, bounded),
    ``up`` before them."""
    for _ in range(_EVENTS_PER_POLL):
        try:
            event = int(recv_monitor_message(monitor, zmq.NOBLOCK)["event"])
        except zmq.ZMQError:  # zmq.Again: nothing more (or closed under us)
            return up
        if event & _UP:
            up = True
        elif event & _DOWN:
            up = False
    return up
