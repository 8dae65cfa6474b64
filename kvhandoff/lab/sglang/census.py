"""What an SGLang PD server holds right now, read from inside its scheduler (lab only).

A fault test must show that nothing was leaked: once a failed request is gone, the
prefill server's KV pages, request slots and metadata rows (the "aux rows" a transfer
backend reads) are all free again, no request waits in any of its disaggregation queues,
and the transfer backend holds no request either. SGLang reports none of this over HTTP
(``/server_info`` has capacities, not what is in use), so the ``census`` shim
(:mod:`.shims`) adds a :class:`Census` to what the scheduler answers for
``/server_info`` (``internal_states[i]["lab_census"]``), and :func:`read` fetches it.

The figures are SGLang's own: ``pool_stats_observer`` (the one its idle leak check uses:
``kv_in_use`` is the KV slots neither free nor held by the radix cache as evictable, so
held by a request), the request-slot and metadata-row allocators, and the queue lengths.
``backend`` is the transfer backend's own view where it has one: for kvhandoff, its
agent's counters (:attr:`kvhandoff.session.rank.agent.Agent.stats`: ``live_requests``,
``early_inits`` ...).
"""

from __future__ import annotations

import json
import types
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KEY", "Census", "install", "read", "take"]

KEY = "lab_census"
"""Where the census sits in a scheduler's internal state."""


@dataclass(frozen=True, slots=True)
class Census:
    """One scheduler's holdings (see the module docstring); ``queues`` maps each of its
    disaggregation queues (and ``running``) to the requests in it; ``transport`` is the
    name of the transport the backend moves bytes with, where it says (kvhandoff)."""

    mode: str
    kv_in_use: int
    req_slots_in_use: int
    metadata_rows_in_use: int
    queues: Mapping[str, int]
    backend: Mapping[str, int] = field(default_factory=dict)
    transport: str | None = None

    @property
    def idle(self) -> bool:
        """Nothing held: no KV slot, request slot or metadata row in use, no request
        queued, and the transfer backend holds no request (when it says)."""
        return (self.kv_in_use == 0 and self.req_slots_in_use == 0
                and self.metadata_rows_in_use == 0 and not any(self.queues.values())
                and self.backend.get("live_requests", 0) == 0)


def _len(queue: Any) -> int:
    if queue is None:
        return 0
    return len(getattr(queue, "queue", queue))  # SGLang's queue objects wrap a list


def _queues(s: Any) -> dict[str, int]:
    running = getattr(s, "running_batch", None)
    return {
        "waiting": _len(getattr(s, "waiting_queue", None)),
        "running": 0 if running is None else len(getattr(running, "reqs", None) or ()),
        "prefill_bootstrap": _len(s.disagg_prefill_bootstrap_queue),
        "prefill_inflight": _len(s.disagg_prefill_inflight_queue),
        "decode_prealloc": _len(s.disagg_decode_prealloc_queue),
        "decode_transfer": _len(s.disagg_decode_transfer_queue),
    }


def _agent(s: Any) -> Any:
    queue = s.disagg_prefill_bootstrap_queue or s.disagg_decode_prealloc_queue
    manager = getattr(queue, "kv_manager", None)
    return getattr(manager, "agent", None)  # kvhandoff's manager; other backends: none


def _backend(agent: Any) -> dict[str, int]:
    stats = getattr(agent, "stats", None)
    return {str(k): int(v) for k, v in stats.items()} if isinstance(stats, Mapping) else {}


def take(scheduler: Any) -> Census:
    """The census of ``scheduler`` (SGLang's ``Scheduler``; called on its thread)."""
    s = scheduler
    pools = s.pool_stats_observer.get_pool_stats()
    rtp = s.req_to_token_pool
    slots = rtp.size + int(getattr(rtp, "pre_alloc_size", 0) or 0)
    meta = getattr(s, "req_to_metadata_buffer_idx_allocator", None)
    agent = _agent(s)
    transport = getattr(agent, "transport", None)
    return Census(
        mode=str(s.disaggregation_mode.value),
        kv_in_use=int(pools.full_num_used) + int(pools.swa_num_used or 0),
        req_slots_in_use=slots - len(rtp.free_slots),
        metadata_rows_in_use=0 if meta is None else int(meta.size - meta.available_size()),
        queues=_queues(s), backend=_backend(agent),
        transport=None if transport is None else str(transport.name))


def install(internal_state: types.ModuleType) -> None:
    """Wrap ``SchedulerInternalStateController.get_internal_state``
    (``sglang.srt.managers.scheduler_components.internal_state``) to add the census."""
    cls = internal_state.SchedulerInternalStateController
    get = cls.get_internal_state

    def get_internal_state(self: Any, recv_req: Any) -> Any:
        out = get(self, recv_req)
        c = take(self.scheduler)
        out.internal_state[KEY] = {
            "mode": c.mode, "kv_in_use": c.kv_in_use, "req_slots_in_use": c.req_slots_in_use,
            "metadata_rows_in_use": c.metadata_rows_in_use, "queues": dict(c.queues),
            "backend": dict(c.backend), "transport": c.transport}
        return out

    cls.get_internal_state = get_internal_state


def read(url: str, timeout: float = 30.0) -> Census:
    """The census of the (single) scheduler of the SGLang server at ``url``."""
    with urllib.request.urlopen(url.rstrip("/") + "/server_info", timeout=timeout) as resp:
        info = json.loads(resp.read())
    states = info.get("internal_states") or []
    if len(states) != 1 or KEY not in states[0]:
        raise ValueError(f"{url}/server_info has no {KEY!r} in one scheduler's state (is the "
                         f"census shim on? got {len(states)} states)")
    d = states[0][KEY]
    return Census(mode=str(d["mode"]), kv_in_use=int(d["kv_in_use"]),
                  req_slots_in_use=int(d["req_slots_in_use"]),
                  metadata_rows_in_use=int(d["metadata_rows_in_use"]),
                  queues={str(k): int(v) for k, v in d["queues"].items()},
                  backend={str(k): int(v) for k, v in d["backend"].items()},
                  transport=d.get("transport"))
