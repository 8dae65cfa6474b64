"""The session layer: agents, per-request senders and receivers, and their control plane.

Per rank, an :class:`Agent` owns the layout, the transport and the control socket; per
request, prefill runs a :class:`Sender` and decode a :class:`Receiver`, each a state
machine (:class:`Status`) that fails with a typed :class:`SessionError` naming why.

Pure pieces (no sockets, threads only for waiting): :mod:`~kvhandoff.session.status`
(the status table and machine), :mod:`~kvhandoff.session.ranks` (which prefill ranks
feed which decode ranks, from the planner), :mod:`~kvhandoff.session.compat` (the
handshake's compatibility report), :mod:`~kvhandoff.session.chunks` (KV chunk slicing),
:mod:`~kvhandoff.session.aux` (aux rows and their arrival guard). Wire messages live in
:mod:`kvhandoff.protocol`.
"""

from kvhandoff.session.agent import Agent, Role
from kvhandoff.session.aux import AuxRecord, AuxSpec, AuxState, request_guard
from kvhandoff.session.chunks import SourceList
from kvhandoff.session.compat import answer_hello, handshake_report
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
from kvhandoff.session.ranks import (
    PrefillPeer,
    RankKey,
    bootstrap_peers,
    decode_candidates,
    decode_ranks_for,
    expected_inits,
    expected_responses,
    peers_for,
    writes,
)
from kvhandoff.session.receiver import Receiver, route_dp
from kvhandoff.session.sender import Sender
from kvhandoff.session.status import Event, StateMachine, Status, combine

__all__ = [
    "Agent",
    "AgentClosed",
    "AuxMismatch",
    "AuxRecord",
    "AuxSpec",
    "AuxState",
    "BootstrapFailed",
    "ChecksumMismatch",
    "Event",
    "HandshakeError",
    "PeerLost",
    "PrefillPeer",
    "RankKey",
    "Receiver",
    "RequestAborted",
    "RequestRejected",
    "RequestTimeout",
    "Role",
    "Sender",
    "SessionConfig",
    "SessionError",
    "SourceList",
    "StateMachine",
    "Status",
    "TransferFailed",
    "answer_hello",
    "bootstrap_peers",
    "combine",
    "decode_candidates",
    "decode_ranks_for",
    "expected_inits",
    "expected_responses",
    "handshake_report",
    "peers_for",
    "request_guard",
    "route_dp",
    "writes",
]
