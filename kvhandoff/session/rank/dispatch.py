"""Where an agent's control I/O thread sends what it hears: heartbeats first, then the desk.

:func:`deliver` hands every control message to the agent's
:class:`~kvhandoff.session.rank.liveness.heartbeats.Heartbeats` (any message is news of its sender;
heartbeats are answered there) and every other one to the role's desk. An
``ErrorReply`` is logged and never answered (agents must not trade errors forever); any
other message the desk does not take is answered with an ``ErrorReply`` naming it.

The I/O thread's two other events concern one role each, so each is a method of that
role's agent class (:mod:`~kvhandoff.session.rank.agent`), not a question asked here.

Everything here runs on the control I/O thread.
"""

from __future__ import annotations

import logging

from kvhandoff.protocol import ErrorReply, Message
from kvhandoff.session.control.channel import ControlChannel, Origin
from kvhandoff.session.rank.desk import Desk
from kvhandoff.session.rank.liveness.heartbeats import Heartbeats
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

