"""An agent's counters (:attr:`~kvhandoff.session.rank.agent.Agent.stats`), read off its parts.

A pure function over what the agent holds: the control channel's message counts
(``received``, ``sent``, ``malformed``, ``unauthenticated``, always present, and any
other it keeps), the role's desk (:meth:`~kvhandoff.session.rank.desk.Desk.counters`:
handshaken peers, statuses received in band, messages from an endpoint that is not the
request's peer, indices refused as not the request's decode's), its live requests, the
peer watch (suspects) and the transport (staging slots in use). Every counter is always
present: one of the other role, or of a part the agent does not have (it failed to
start), reads 0.
"""

from __future__ import annotations

from kvhandoff.session.rank.desk import Desk
from kvhandoff.session.rank.io import RankIO
from kvhandoff.session.rank.liveness.watch import PeerWatch

#: the desks' counters, both roles': each reads 0 on an agent of the other role
ROLE_COUNTERS = ("decode_peers", "early_inits", "in_band_statuses", "prefill_peers",
                 "not_request_peer", "refused_claims")


def agent_stats(desk: Desk | None, io: RankIO | None, watch: PeerWatch) -> dict[str, int]:
    """The counters of an agent with ``desk``, ``io`` (None: not made) and ``watch``."""
    out = dict.fromkeys(("received", "sent", "malformed", "unauthenticated"), 0)
    out.update(io.control.stats if io is not None else {})
    out["live_requests"] = len(desk.live()) if desk is not None else 0
    out.update(dict.fromkeys(ROLE_COUNTERS, 0))
    out.update(desk.counters() if desk is not None else {})
    out["suspect_peers"] = watch.suspects  # a write to them was lost; being probed
    out["staging_slots"] = io.transport.staging_slots_in_use if io else 0
    return out
