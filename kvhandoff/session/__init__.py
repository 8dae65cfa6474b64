"""The session layer: agents, per-request senders and receivers, and their control plane.

Per rank, an :class:`Agent` (a :class:`PrefillAgent` or a :class:`DecodeAgent`) owns the
layout, the transport and the control socket; per request, prefill runs a :class:`Sender`
and decode a :class:`Receiver`, each a state machine (:class:`Status`) that fails with a
typed :class:`SessionError` naming why.

The package exports what an engine calls: the agent, the two request sides, their
config, statuses and errors, and :func:`route_dp`. Everything else is imported from its
module. Pure pieces (no sockets, threads only for waiting):
:mod:`~kvhandoff.session.request.status` (the status table and machine),
:mod:`~kvhandoff.session.request.send_core` / :mod:`~kvhandoff.session.request.recv_core` (the
request
logic as event-in, effects-out cores), :mod:`~kvhandoff.session.peers.mapping` (which prefill
ranks feed which decode ranks, from the planner), :mod:`~kvhandoff.session.peers.compat` (the
handshake's compatibility report), :mod:`~kvhandoff.session.request.chunks` (KV chunk slicing),
:mod:`~kvhandoff.session.request.aux` (aux rows and their arrival guard). Wire messages live in
:mod:`kvhandoff.protocol`.
"""

from kvhandoff.session.config import SessionConfig
from kvhandoff.session.errors import (
    AgentClosed,
    AuxMismatch,
    BootstrapFailed,
    ChecksumMismatch,
    HandshakeError,
    PeerLost,
    RequestAborted,
    RequestRejected,
    RequestTimeout,
    SessionError,
    TransferFailed,
)
from kvhandoff.session.rank.agent import (
    Agent,
    DecodeAgent,
    PrefillAgent,
    Role,
    as_decode,
    as_prefill,
)
from kvhandoff.session.request.receiver import Receiver, route_dp
from kvhandoff.session.request.sender import Sender
from kvhandoff.session.request.status import Status

__all__ = [
    "Agent",
    "AgentClosed",
    "AuxMismatch",
    "BootstrapFailed",
    "ChecksumMismatch",
    "DecodeAgent",
    "HandshakeError",
    "PeerLost",
    "PrefillAgent",
    "Receiver",
    "RequestAborted",
    "RequestRejected",
    "RequestTimeout",
    "Role",
    "Sender",
    "SessionConfig",
    "SessionError",
    "Status",
    "TransferFailed",
    "as_decode",
    "as_prefill",
    "route_dp",
]
