"""The integration kit: what every engine adapter needs from kvhandoff, once.

An adapter (``kvhandoff.integrations.vllm``, ``kvhandoff.integrations.sglang``) only
translates its engine's API; everything else comes from here or from the model modules
(:mod:`kvhandoff.layout`, :mod:`kvhandoff.state_types`, :mod:`kvhandoff.indices`,
:mod:`kvhandoff.sharding`, :mod:`kvhandoff.errors`), never from a private module (a test
pins both this face and what the adapters import).

Opening a rank (:mod:`.rank`)
    ``placement`` decides where the engine's memory is registered (:class:`How`: in
    place, a host mirror, or relocated into the transport's memory); ``open_transport``
    makes a rank's transport keyed by the deployment secret; ``open_rank`` the agent.
Requests (the session layer)
    ``Agent``, a factory of ``PrefillAgent`` / ``DecodeAgent`` (``as_prefill`` /
    ``as_decode`` narrow one whose role is a run-time value), ``Role``, ``Sender`` (takes
    a prefill agent), ``Receiver`` (a decode one), ``Status``, ``SessionConfig``,
    ``bootstrap_url``, ``route_dp``; ``AuxSpec``, the aux-row format, and ``AuxRows`` /
    ``AuxPool``, the pool a request leases its row from (with its memory).
Outcomes (:mod:`.outcomes`)
    ``outcome`` (a side's row of ``OUTCOMES``: :class:`Outcome`, SGLang's ``KVPoll``,
    vLLM's finished/failed set), ``kvpoll``, ``quiet``.
Figures (:mod:`kvhandoff.observe.figures`)
    ``figures`` / ``measure``: a handoff's :class:`Figures`, measured once; ``record``
    and ``HANDOFF_SERIES`` (each a :class:`Series`, prefix ``kvhandoff_``) put them into
    any Prometheus registry.
Hooks (:mod:`.hooks`)
    ``HandoffHook``, ``load_hook``: the one place test rigs attach.
Rendezvous (:mod:`.registry`)
    ``registry_app``: kvhandoff's registry, for an engine's own HTTP server to host.
Odds and ends
    ``Transport``, ``CUDA_STAGED_ONLY`` (transports that move host memory only),
    ``coalesce_runs`` (sorted ids as runs), ``HandshakeError``, ``LeaseExpired``,
    ``LocalProtocolError``.
"""

from kvhandoff.binding import RequestKey
from kvhandoff.errors import HandshakeError, LeaseExpired, LocalProtocolError
from kvhandoff.integrations.hooks import HandoffHook, load_hook
from kvhandoff.integrations.outcomes import (
    KVPOLL,
    OUTCOMES,
    Outcome,
    Row,
    kvpoll,
    outcome,
    quiet,
)
from kvhandoff.integrations.rank import How, Placement, open_rank, open_transport, placement
from kvhandoff.integrations.registry import registry_app
from kvhandoff.observe.figures import SUCCESS, Figures, figures, measure
from kvhandoff.observe.metrics import HANDOFF_SERIES, Series, record
from kvhandoff.plan.runs import runs as coalesce_runs
from kvhandoff.session.config import SessionConfig
from kvhandoff.session.rank.agent import (
    Agent,
    DecodeAgent,
    PrefillAgent,
    Role,
    as_decode,
    as_prefill,
)
from kvhandoff.session.request.aux import AuxPool, AuxRows, AuxSpec
from kvhandoff.session.request.receiver import Receiver, bootstrap_url, route_dp
from kvhandoff.session.request.sender import Sender
from kvhandoff.session.request.status import Status
from kvhandoff.transport.base import Transport
from kvhandoff.transport.registry import CUDA_STAGED_ONLY

__all__ = [
    "CUDA_STAGED_ONLY",
    "HANDOFF_SERIES",
    "KVPOLL",
    "OUTCOMES",
    "SUCCESS",
    "Agent",
    "AuxPool",
    "AuxRows",
    "AuxSpec",
    "DecodeAgent",
    "Figures",
    "HandoffHook",
    "HandshakeError",
    "How",
    "LeaseExpired",
    "LocalProtocolError",
    "Outcome",
    "Placement",
    "PrefillAgent",
    "Receiver",
    "RequestKey",
    "Role",
    "Row",
    "Sender",
    "Series",
    "SessionConfig",
    "Status",
    "Transport",
    "as_decode",
    "as_prefill",
    "bootstrap_url",
    "coalesce_runs",
    "figures",
    "kvpoll",
    "load_hook",
    "measure",
    "open_rank",
    "open_transport",
    "outcome",
    "placement",
    "quiet",
    "record",
    "registry_app",
    "route_dp",
]
