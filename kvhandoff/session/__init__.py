"""The session layer: control messages, rendezvous and per-request state machines.

Pure pieces (no sockets, threads only for waiting): :mod:`~kvhandoff.session.status`
(the status table and machine), :mod:`~kvhandoff.session.ranks` (which prefill ranks
feed which decode ranks, from the planner), :mod:`~kvhandoff.session.compat` (the
handshake's compatibility report). Wire messages live in :mod:`kvhandoff.protocol`.
"""

from kvhandoff.session.compat import answer_hello, handshake_report
from kvhandoff.session.ranks import (
    PrefillPeer,
    RankKey,
    bootstrap_peers,
    decode_ranks_for,
    expected_inits,
    expected_responses,
    peers_for,
    writes,
)
from kvhandoff.session.status import Event, StateMachine, Status, combine

__all__ = [
    "Event",
    "PrefillPeer",
    "RankKey",
    "StateMachine",
    "Status",
    "answer_hello",
    "bootstrap_peers",
    "combine",
    "decode_ranks_for",
    "expected_inits",
    "expected_responses",
    "handshake_report",
    "peers_for",
    "writes",
]
