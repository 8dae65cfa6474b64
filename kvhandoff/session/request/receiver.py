"""Decode side of one request on one decode rank.

Call order (the engine's thread)::

    r = Receiver(agent, "10.0.0.3:8998", request_id, key=key)   # BOOTSTRAPPING
    r.init({"kv": pages, "mamba": [slot], "swa": window_pages, ...}, aux_row,
           decode_prefix_len=prefix)                 # sends the destination indices
    while r.poll() not in (Status.SUCCESS, Status.FAILED): ...
    # FAILED: r.error says why; reuse the destination pages only once r.released

``key``: the request's :class:`~kvhandoff.binding.RequestKey`, the one its Senders got:
the indices then carry the proof that the request was routed to this rank (prefill
refuses indices without it for a request with a key).

``init`` may be called at once: the indices go out as soon as the prefill group is
handshaken (the handshake runs once per prefill rank and is shared by every request).
``indices`` names every component of the layout except the aux component (whose row is
``aux_row``): a destination index list (array-like or
:class:`~kvhandoff.protocol.IndexListMsg` for row offsets and ring positions), or None
when that component does not move for this request. The KV list covers the tokens
decode lacks: ``[decode_prefix_len, seq_len)`` (possibly empty: a full prefix hit).

Statuses: BOOTSTRAPPING → WAITING_FOR_INPUT (indices sent to every prefill rank) →
TRANSFERRING (a chunk status arrived) → SUCCESS only when every prefill rank reported its
last chunk, every checksum (if asked for) matched, and the aux row holds this request's
guard. FAILED on a rejected handshake, a timeout, a lost peer, a prefill failure, an
abort, a checksum or aux mismatch — :attr:`error` says which, naming ranks and values.

No stale writes: after a failure the prefill ranks are sent an ``Abort``;
:attr:`released` turns true only when each rank that got our indices confirmed that none
of its writes is in flight (``AbortAck``, or its last chunk had completed), or when
``release_timeout`` passed (then :attr:`release_reason` says so). Until then a late write
may still land in the destination pages: do not reuse them.

Every decision above lives in :class:`~kvhandoff.session.request.recv_core.RecvCore` (sans I/O);
this class is its shell: it finds the prefill group, holds the lock, feeds the core events
and carries out its effects (post, clear and read the aux guard, verify checksums on a
worker, handshake again, release).

Thread-safety: every method may be called from any thread (one lock per request).
"""

from __future__ import annotations

import functools
import hashlib
import time
import urllib.parse
from collections.abc import Callable, Mapping

from kvhandoff.binding import RequestKey
from kvhandoff.errors import HandoffError
from kvhandoff.layout import Layout
from kvhandoff.plan import plan
from kvhandoff.plan.request import Indices
from kvhandoff.protocol import IndexListMsg, RequestId, TransferInit, TransferStatus
from kvhandoff.session.errors import SessionError, TransferFailed
from kvhandoff.session.peers.prefill_groups import GroupState, PrefillGroup, PrefillRank
from kvhandoff.session.request import aux
from kvhandoff.session.request.checksum import plan_digests
from kvhandoff.session.request.chunks import check_items
from kvhandoff.session.request.host import DecodeHost
from kvhandoff.session.request.recv_core import (
    CheckGuard,
    ClearGuard,
    RecvCore,
    Rehandshake,
    Release,
    Verify,
)
from kvhandoff.session.request.side import RequestSide
from kvhandoff.session.request.status import Latch, Status


def route_dp(request_id: RequestId, dp_size: int) -> int:
    """The prefill DP group a request goes to when none is given: ``id % dp_size`` for
    integer ids, a stable hash for strings. Prefill's router must use the same rule."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if isinstance(request_id, int):
        return request_id % dp_size
    h = hashlib.blake2b(str(request_id).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % dp_size


@functools.lru_cache(maxsize=256)  # every Receiver asks, of a few addresses
def bootstrap_url(addr: str) -> str:
    """``host:port`` or ``http://host:port`` as the bootstrap server's URL."""
    url = addr if "://" in addr else f"http://{addr}"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"bootstrap address {addr!r} is not host:port or http://host:port")
    return url.rstrip("/")


class Receiver(RequestSide):
    """See the module docstring."""

    _core: RecvCore
    agent: DecodeHost

    def __init__(self, agent: DecodeHost, bootstrap_addr: str, request_id: RequestId, *,
                 key: RequestKey | None = None, instance: str | None = None,
                 dp_rank: int | None = None) -> None:
        super().__init__(agent, request_id, "decode")
        self._key = key
        self._core = RecvCore(request_id=request_id, facts=agent, created=self._created)
        self.url = bootstrap_url(bootstrap_addr)
        self.instance = instance or agent.config.instance
        self._group: PrefillGroup | None = None
        self._regroup: PrefillGroup | None = None  # asked for by Rehandshake, not yet waited on
        self._dp_rank = dp_rank
        self._released = Latch()
        self._release_reason = ""
        agent.attach(self)
        self._find_group()

    # --- the engine's calls ------------------------------------------------------------

    def poll(self) -> Status:
        """The request's status on this rank now; never blocks."""
        with self._lock:
            self._do(self._core.poll())
        return self._sm.state

    @property
    def released(self) -> bool:
        """The destination pages may be reused: no prefill write can land in them any more."""
        return self._released.is_set()

    @property
    def release_reason(self) -> str:
        return self._release_reason

    def wait_released(self, timeout: float) -> bool:
        return self._released.wait(timeout)

    @property
    def dp_rank(self) -> int | None:
        return self._dp_rank

    def init(self, indices: Mapping[str, object | None], aux_row: int | None = None, *,
             decode_prefix_len: int = 0) -> None:
        """Give the destination of every component (see the module docstring) and send it
        to the prefill ranks as soon as they are handshaken. Raises ``ValueError`` for a
        malformed or incomplete set of lists, ``RuntimeError`` when called twice."""
        msg = self._build(indices, aux_row, decode_prefix_len)
        with self._lock:
            self._do(self._core.init(msg, aux_row, time.monotonic(), self._ready_ranks()))

    @property
    def peers(self) -> list[str]:
        return [f"{w.rank.instance}/tp{w.rank.tp_rank}"
                for w in list(self._core.writers.values())]

    def abort(self, reason: str = "aborted by the decode engine") -> None:
        """Fail the request and tell every prefill rank to stop; idempotent. Watch
        :attr:`released` before reusing the destination pages."""
        with self._lock:
            self._do(self._core.abort(reason, time.monotonic()))

    def _build(self, indices: Mapping[str, object | None], aux_row: int | None,
               prefix: int) -> TransferInit:
        agent = self.agent
        if prefix < 0:
            raise ValueError(f"decode_prefix_len must be >= 0, got {prefix}")
        names = {c.name for c in agent.layout.components} - {agent.aux_name}
        unknown, missing = set(indices) - names, names - set(indices)
        if unknown or missing:
            raise ValueError(f"init must name every component but {agent.aux_name!r} exactly: "
                             f"unknown {sorted(unknown)}, missing {sorted(missing)} "
                             f"(use None for one that does not move)")
        out: dict[str, IndexListMsg | None] = {}
        for name, v in indices.items():
            msg = v if v is None or isinstance(v, IndexListMsg) else IndexListMsg.of(v)
            if msg is not None:
                check_items(agent.layout, name, msg.array(), "decode")
            out[name] = msg
        if agent.aux_name is not None:
            t = agent.aux_tensor
            if aux_row is None or t is None or not 0 <= aux_row < t.capacity:
                raise ValueError(f"aux_row must be a row of the aux tensor "
                                 f"(0..{t.capacity - 1 if t else -1}), got {aux_row}")
            out[agent.aux_name] = IndexListMsg.one(aux_row)
        elif aux_row is not None:
            raise ValueError("aux_row given but the layout has no aux component")
        proof = None if self._key is None else self._key.prove(
            self.request_id, agent.rank_id, agent.endpoint, agent.transport_endpoint)
        return TransferInit(request_id=self.request_id, rank=agent.rank_id, indices=out,
                            decode_prefix_len=prefix, expect_checksum=agent.config.checksum,
                            proof=proof)

    def _aux_view(self) -> aux.U8 | None:
        t, row = self.agent.aux_tensor, self._core.aux_row
        if t is None or row is None:
            return None
        return self.agent.views.row(t, row)

    # --- finding the prefill group ---------------------------------------------------------

    def _find_group(self) -> None:
        groups = self.agent.groups
        dp = self._dp_rank
        if dp is None:
            size = groups.dp_size(self.url, self.instance)
            if size is None:  # learn the DP size from group 0's lookup, then route
                groups.get((self.url, self.instance, 0)).add_waiter(self._on_probe)
                return
            dp = route_dp(self.request_id, size)
        self._use_group(dp)

    def _on_probe(self, group: PrefillGroup) -> None:
        size = self.agent.groups.dp_size(self.url, self.instance)
        if size is None:
            with self._lock:
                error = group.error or TransferFailed("prefill lookup failed")
                self._do(self._core.group_failed(error, time.monotonic()))
            return
        self._use_group(route_dp(self.request_id, size))

    def _use_group(self, dp: int) -> None:
        groups = self.agent.groups
        with self._lock:
            self._dp_rank = dp
            if self._core.terminal:
                return
            group = groups.get((self.url, self.instance, dp))
            self._group = group
        group.add_waiter(self._on_group)

    def _ready_ranks(self) -> tuple[PrefillRank, ...] | None:
        g = self._group
        return g.ranks if g is not None and g.state is GroupState.READY else None

    def _on_group(self, group: PrefillGroup) -> None:
        self._group_settled(group, self._core.group_ready, self._core.group_failed)

    def _on_regroup(self, group: PrefillGroup) -> None:
        self._group_settled(group, self._core.regroup, self._core.regroup_failed)

    def _group_settled(self, group: PrefillGroup,
                       ready: Callable[[tuple[PrefillRank, ...], float], list[object]],
                       failed: Callable[[SessionError, float], list[object]]) -> None:
        """A group waiter: the group this request uses is READY (the core's ``ready``
        gets its ranks) or FAILED (``failed`` gets its error; a core already final
        ignores it). A group the request has since left is ignored."""
        with self._lock:
            if group is not self._group:
                return
            now = time.monotonic()
            if group.state is GroupState.FAILED:
                assert group.error is not None
                self._do(failed(group.error, now))
            else:
                self._do(ready(group.ranks, now))

    # --- from the agent and its desk (their threads; not for the engine) ----------------

    def on_status(self, endpoint: str, msg: TransferStatus) -> None:
        with self._lock:
            self._do(self._core.chunk_status(endpoint, msg, time.monotonic()))

    def on_abort(self, who: str, reason: str) -> None:
        with self._lock:
            self._do(self._core.prefill_aborted(who, reason, time.monotonic()))

    def on_abort_ack(self, endpoint: str) -> None:
        with self._lock:
            self._do(self._core.abort_ack(endpoint))

    def on_rejected(self, endpoint: str, reason: str) -> None:
        with self._lock:
            self._do(self._core.rejected(endpoint, reason, time.monotonic()))

    def on_unknown_peer(self, endpoint: str, reason: str) -> None:
        """A prefill rank answered our indices "unknown decode peer": it lost our
        handshake (it restarted). Handshake with the group again, then send the indices
        to that rank again — transparently, at most ``MAX_REHANDSHAKES`` times per
        request; after that (or if it had already written for us) the request fails as
        rejected."""
        with self._lock:
            self._do(self._core.unknown_peer(endpoint, reason, time.monotonic()))
            group, self._regroup = self._regroup, None
        if group is not None:
            group.add_waiter(self._on_regroup)

    def on_peer_lost(self, endpoint: str, reason: str) -> None:
        with self._lock:
            self._do(self._core.peer_lost(endpoint, reason, time.monotonic()))

    def on_agent_closed(self) -> None:
        with self._lock:
            self._do(self._core.agent_closed(time.monotonic()))

    def peer_endpoints(self) -> set[str]:
        with self._lock:
            return self._core.peer_endpoints()

    def on_tick(self, now: float) -> None:
        # every live request is ticked every few ms: one that has no timer due (nearly
        # all) is passed over without its lock (tick_due is safe without it)
        if not self._core.tick_due(now):
            return
        with self._lock:
            g = self._group
            connecting = g is None or g.state is GroupState.CONNECTING
            self._do(self._core.tick(now, connecting))

    # --- the core's effects (under the lock) ---------------------------------------------

    def _carry_out(self, effect: object) -> list[object]:
        match effect:
            case ClearGuard():
                row = self._aux_view()
                if row is not None:
                    aux.clear(row)
            case CheckGuard():
                row = self._aux_view()
                state, detail = (aux.AuxState.OK, "") if row is None else \
                    aux.check(row, self.request_id)
                return self._core.guard(state, detail, time.monotonic())
            case Verify(endpoint=endpoint, msg=msg, layout=layout):
                self.agent.spawn(lambda: self._verify(endpoint, msg, layout))
            case Rehandshake():
                assert self._group is not None
                # the agent dropped the stale group: this is a fresh one
                self._group = self._regroup = self.agent.groups.get(self._group.key)
            case Release(reason=reason):
                self._release_reason = reason
                self._released.set()
                self.agent.finished(self)
            case _:
                return super()._carry_out(effect)
        return []

    def _verify(self, endpoint: str, msg: TransferStatus, layout: Layout | None) -> None:
        """Rebuild the chunk's plan and digest the destination bytes (worker thread)."""
        got: dict[str, int] | None = None
        cannot: str | None = None
        try:
            assert msg.checksums is not None and msg.indices is not None
            if layout is None:
                raise ValueError("prefill sent no layout in its HelloAck")
            req: dict[str, Indices | None] = {c.name: None for c in self.agent.layout.components}
            for name, pim in msg.indices.items():
                if name not in req:
                    raise ValueError(f"checksum for unknown component {name!r}")
                req[name] = pim.to_indices()
            got = plan_digests(plan(layout, self.agent.layout, req), "dst", self.agent.views)
        except (HandoffError, ValueError) as e:
            cannot = str(e)
        with self._lock:
            self._do(self._core.verified(endpoint, msg, got, cannot, time.monotonic()))
