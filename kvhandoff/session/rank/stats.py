"""An agent's counters (:attr:`~kvhandoff.session.rank.agent.Agent.stats`), read off its parts.

A pure function over what the agent holds: the control channel's message counts
(``received``, ``sent``, ``malformed``, ``unauthenticated``, always present, and any
other it keeps), the role's desk (live requests, handshaken peers, statuses received
in band, messages from an endpoint that is not the request's peer, indices refused as
not the request's decode's), the peer watch
(suspects) and the transport (staging slots in use). A counter of the other role, or of
a part the agent does not have (it failed to start), reads 0.
"""

from __future__ import annotations

from kvhandoff.session.peers.prefill_groups import GroupState
from kvhandoff.session.rank.decode_desk import DecodeDesk
from kvhandoff.session.rank.io import RankIO
from kvhandoff.session.rank.liveness.watch import PeerWatch
from kvhandoff.session.rank.prefill_desk import PrefillDesk


def agent_stats(desk: PrefillDesk | DecodeDesk | None, io: RankIO | None,
                watch: PeerWatch) -> dict[str, int]:
    """The counters of an agent with ``desk``, ``io`` (None: not made) and ``watch``."""
    out = dict.fromkeys(("received", "sent", "malformed", "unauthenticated"), 0)
    out.update(io.control.stats if io is not None else {})
    out["live_requests"] = len(desk.live()) if desk is not None else 0
    out["decode_peers"] = len(desk.peers) if isinstance(desk, PrefillDesk) else 0
    # prefill: requests whose decode indices are in, waiting for their Sender
    out["early_inits"] = len(desk.backlog.inits) if isinstance(desk, PrefillDesk) else 0
    out["in_band_statuses"] = desk.in_band if isinstance(desk, DecodeDesk) else 0
    out["prefill_peers"] = sum(len(g.ranks) for g in desk.groups.groups()
                               if g.state is GroupState.READY) \
        if isinstance(desk, DecodeDesk) else 0
    out["suspect_peers"] = watch.suspects  # a write to them was lost; being probed
    # request-scoped messages from an endpoint that is not that request's peer
    out["not_request_peer"] = desk.not_request_peer if desk is not None else 0
    # prefill: indices refused as not the request's decode's (kvhandoff.binding)
    out["refused_claims"] = desk.refused_claims if isinstance(desk, PrefillDesk) else 0
    out["staging_slots"] = io.transport.staging_slots_in_use if io else 0
    return out
