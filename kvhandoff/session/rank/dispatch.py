"""Where an agent's control I/O thread sends what it hears: heartbeats first, then the desk.

:func:`deliver` hands every control message to the agent's
:class:`~kvhandoff.session.rank.liveness.heartbeats.Heartbeats` (any message is news of its sender;
heartbeats are answered there) and every other one to the role's desk. An
``ErrorReply`` is logged and never answered (agents must not trade errors forever); any
other message the desk does not take is answered with an ``ErrorReply`` naming it.

The I/O thread's two other events concern one role each: at the end of a burst of
messages prefill submits the writes it batched (:func:`drained`); when a peer this rank
dialed fails authentication, decode fails the handshake waiting for it
(:func:`unauthenticated`).

Everything here runs on the control I/O thread.
"""

from __future__ import annotations

import logging

from kvhandoff.protocol import ErrorReply, Message
from kvhandoff.session.control.channel import ControlChannel, Origin
from kvhandoff.session.rank.decode_desk import DecodeDesk
from kvhandoff.session.rank.liveness.heartbeats import Desk, Heartbeats
from kvhandoff.session.rank.prefill_desk import PrefillDesk
from kvhandoff.session.request.host import Role

log = logging.getLogger("kvhandoff.session.rank.agent")  # the agent's voice: one logger per agent


def deliver(origin: Origin, msg: Message, *, beats: Heartbeats, desk: Desk | None,
            control: ControlChannel | None, role: Role, name: str) -> None:
    """Hand ``msg`` from ``origin`` to ``beats``, else ``desk``; answer what neither
    takes on ``control`` (the agent ``name``, of ``role``)."""
    if beats.on_message(origin, msg):
        return
    if isinstance(msg, ErrorReply):  # never answered: agents must not trade errors forever
        log.warning("agent %s: %s answered with an error: %s", name, origin,
                    msg.reason[:500])
    taken = desk is not None and desk.on_message(origin, msg)
    if not (taken or isinstance(msg, ErrorReply)) and control is not None:
        control.reply(origin, ErrorReply(
            reason=f"a {role.value} agent does not accept {type(msg).__name__}"
                   + ("" if origin.endpoint else " from an unnamed client"),
            request_id=getattr(msg, "request_id", None)))


def drained(desk: Desk | None) -> None:
    """Every message that was ready has been handled: prefill submits the writes they
    produced, batched (:mod:`~kvhandoff.session.control.write_batch`)."""
    if isinstance(desk, PrefillDesk):
        desk.writes.flush()


def unauthenticated(desk: Desk | None, endpoint: str, reason: str) -> None:
    """A peer we dialed answered with something that failed authentication (it does
    not hold our secret): a handshake waiting for it fails now, with ``reason``."""
    if isinstance(desk, DecodeDesk):
        desk.groups.refuse(endpoint, reason)
