"""Decode side of one request on one decode rank.

Call order (the engine's thread)::

    r = Receiver(agent, "10.0.0.3:8998", request_id)   # BOOTSTRAPPING: find prefill ranks
    r.init({"kv": pages, "mamba": [slot], "swa": window_pages, ...}, aux_row,
           decode_prefix_len=prefix)                 # sends the destination indices
    while r.poll() not in (Status.SUCCESS, Status.FAILED): ...
    # FAILED: r.error says why; reuse the destination pages only once r.released

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

Thread-safety: every method may be called from any thread (one lock per request).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvhandoff.errors import HandoffError
from kvhandoff.layout import Layout
from kvhandoff.observe import timeline as tl
from kvhandoff.plan import plan
from kvhandoff.plan.request import Indices
from kvhandoff.protocol import (
    Abort,
    IndexListMsg,
    Outcome,
    RankId,
    RequestId,
    TransferInit,
    TransferStatus,
)
from kvhandoff.session import aux
from kvhandoff.session.checksum import plan_digests
from kvhandoff.session.chunks import check_items
from kvhandoff.session.errors import (
    AgentClosed,
    AuxMismatch,
    ChecksumMismatch,
    PeerLost,
    RequestAborted,
    RequestRejected,
    RequestTimeout,
    SessionError,
    TransferFailed,
)
from kvhandoff.session.groups import GroupState, PrefillGroup
from kvhandoff.session.host import RankHost
from kvhandoff.session.request_side import RequestSide
from kvhandoff.session.status import Event, Status

log = logging.getLogger("kvhandoff.session.receiver")

_MAX_REHANDSHAKES = 2  # per request: "unknown decode peer" answered by a new handshake


def route_dp(request_id: RequestId, dp_size: int) -> int:
    """The prefill DP group a request goes to when none is given: ``id % dp_size`` for
    integer ids, a stable hash for strings. Prefill's router must use the same rule."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if isinstance(request_id, int):
        return request_id % dp_size
    h = hashlib.blake2b(str(request_id).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % dp_size


def bootstrap_url(addr: str) -> str:
    """``host:port`` or ``http://host:port`` as the bootstrap server's URL."""
    url = addr if "://" in addr else f"http://{addr}"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"bootstrap address {addr!r} is not host:port or http://host:port")
    return url.rstrip("/")


@dataclass(slots=True)
class _Writer:
    """A prefill rank this request's indices went to."""

    endpoint: str
    rank: RankId
    layout: Layout | None
    chunks: set[int] = field(default_factory=set)  # chunks it reported written
    last: int | None = None  # the chunk number its last status named
    acked: bool = False  # confirmed no write in flight after a failure
    verifying: int = 0  # checksum checks still running

    @property
    def done(self) -> bool:
        """Every chunk up to its last reported: nothing of ours in flight."""
        return self.last is not None and len(self.chunks) == self.last + 1

    def count(self, chunk: int, last: bool) -> str | None:
        """Record chunk ``chunk`` as written; a sentence if that cannot be. Statuses
        that travel in band (:mod:`~kvhandoff.session.notices`) may overtake one another,
        the last included: done once every chunk up to the last is in."""
        if chunk in self.chunks:
            return f"reported chunk {chunk} twice"
        if last:
            if self.last is not None:
                return f"reported a last chunk twice ({self.last}, then {chunk})"
            self.last = chunk
        self.chunks.add(chunk)
        if self.last is not None and max(self.chunks) > self.last:
            return f"reported chunk {max(self.chunks)} after its last chunk {self.last}"
        return None


class Receiver(RequestSide):
    """See the module docstring."""

    def __init__(self, agent: RankHost, bootstrap_addr: str, request_id: RequestId, *,
                 instance: str | None = None, dp_rank: int | None = None) -> None:
        super().__init__(agent, request_id, "decode")
        self.url = bootstrap_url(bootstrap_addr)
        self.instance = instance or agent.config.instance
        self._changed = self._created  # last progress, for the waiting/transfer timeouts
        self._group: PrefillGroup | None = None
        self._dp_rank = dp_rank
        self._init: TransferInit | None = None
        self._aux_row: int | None = None
        self._writers: dict[str, _Writer] = {}
        self._aux_since: float | None = None  # every writer done; waiting for the aux row
        self._released = threading.Event()
        self._release_reason = ""
        self._release_deadline: float | None = None
        self.events["rehandshake"] = 0
        self._resend: set[str] = set()  # prefill ranks to send the indices again, once handshaken
        agent.attach(self)
        self._find_group()

    # --- the engine's calls ------------------------------------------------------------

    def poll(self) -> Status:
        """The request's status on this rank now; never blocks."""
        with self._lock:
            if self._aux_since is not None and not self._sm.terminal:
                self._check_aux(time.monotonic())
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
            if self._init is not None:
                raise RuntimeError(f"Receiver {self.request_id!r}: init() called twice")
            self._init, self._aux_row = msg, aux_row
            if self._sm.terminal:
                return
            row = self._aux_view()
            if row is not None:
                aux.clear(row)
            self._maybe_send()

    @property
    def peers(self) -> list[str]:
        return [f"{w.rank.instance}/tp{w.rank.tp_rank}" for w in list(self._writers.values())]

    def abort(self, reason: str = "aborted by the decode engine") -> None:
        """Fail the request and tell every prefill rank to stop; idempotent. Watch
        :attr:`released` before reusing the destination pages."""
        with self._lock:
            self._fail(RequestAborted(f"request {self.request_id!r}: {reason}"))

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
            out[agent.aux_name] = IndexListMsg.of([aux_row])
        elif aux_row is not None:
            raise ValueError("aux_row given but the layout has no aux component")
        return TransferInit(request_id=self.request_id, rank=agent.rank_id, indices=out,
                            decode_prefix_len=prefix, expect_checksum=agent.config.checksum)

    def _aux_view(self) -> aux.U8 | None:
        t = self.agent.aux_tensor
        if t is None or self._aux_row is None:
            return None
        return self.agent.views.row(t, self._aux_row)

    # --- bootstrapping -------------------------------------------------------------------

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
                self._fail(group.error or TransferFailed("prefill lookup failed"))
            return
        self._use_group(route_dp(self.request_id, size))

    def _use_group(self, dp: int) -> None:
        groups = self.agent.groups
        with self._lock:
            self._dp_rank = dp
            if self._sm.terminal:
                return
            group = groups.get((self.url, self.instance, dp))
            self._group = group
        group.add_waiter(self._on_group)

    def _on_group(self, group: PrefillGroup) -> None:
        with self._lock:
            if group is not self._group or self._sm.terminal:
                return
            if group.state is GroupState.FAILED:
                assert group.error is not None
                self._fail(group.error)
            else:
                self._maybe_send()

    def _maybe_send(self) -> None:
        g = self._group
        if (self._init is None or g is None or g.state is not GroupState.READY
                or self._sm.state is not Status.BOOTSTRAPPING):
            return
        for r in g.ranks:
            self._writers[r.endpoint] = _Writer(r.endpoint, r.rank, r.layout)
        self.timeline.mark(tl.ASKED)
        for r in g.ranks:
            self.agent.post(r.endpoint, self._init)
        self._changed = time.monotonic()
        self._sm.fire(Event.BOOTSTRAPPED)

    # --- from the agent and its desk (their threads; not for the engine) ----------------

    def on_status(self, endpoint: str, msg: TransferStatus) -> None:
        with self._lock:
            w = self._writers.get(endpoint)
            if w is None or self._sm.terminal:
                return
            if msg.outcome is Outcome.FAILED:
                # it stops writing; its AbortAck (not this status) says nothing is in flight
                self._fail(TransferFailed(f"request {self.request_id!r}: prefill {msg.rank} "
                                          f"failed (chunk {msg.chunk}): {msg.reason}"))
                return
            problem = w.count(msg.chunk, msg.last)
            if problem is not None:
                self._fail(TransferFailed(f"request {self.request_id!r}: prefill {msg.rank} "
                                          f"{problem}"))
                return
            self._changed = time.monotonic()
            self.nbytes += msg.nbytes
            if self._init is not None and self._init.expect_checksum:
                if msg.checksums is None or msg.indices is None:
                    self._fail(ChecksumMismatch(
                        f"request {self.request_id!r}: checksums were asked for but prefill "
                        f"{msg.rank} sent none with chunk {msg.chunk}"))
                    return
                w.verifying += 1
                self.agent.spawn(lambda: self._verify(w, msg))
            if self._sm.state is Status.WAITING_FOR_INPUT:
                self._sm.fire(Event.CHUNK_DONE)
            self._maybe_succeed()

    def on_abort(self, who: str, reason: str) -> None:
        with self._lock:
            self._fail(RequestAborted(f"request {self.request_id!r} aborted by prefill {who}: "
                                      f"{reason}"))

    def on_abort_ack(self, endpoint: str) -> None:
        with self._lock:
            w = self._writers.get(endpoint)
            if w is not None:
                w.acked = True
                self._maybe_released()

    def on_rejected(self, endpoint: str, reason: str) -> None:
        with self._lock:
            if endpoint in self._writers:
                self._writers[endpoint].acked = True  # it refused: it never wrote
                self._fail(RequestRejected(f"request {self.request_id!r}: prefill {endpoint} "
                                           f"refused it: {reason}"))

    def on_unknown_peer(self, endpoint: str, reason: str) -> None:
        """A prefill rank answered our indices "unknown decode peer": it lost our
        handshake (it restarted). Handshake with the group again, then send the indices
        to that rank again — transparently, at most ``_MAX_REHANDSHAKES`` times per
        request; after that (or if it had already written for us) the request fails as
        rejected."""
        with self._lock:
            w = self._writers.get(endpoint)
            group = self._group
            if w is None or group is None or self._init is None or self._sm.terminal:
                return
            done = self.events["rehandshake"]
            if w.chunks or done >= _MAX_REHANDSHAKES:
                again = f" (after {done} new handshake(s))" if done else ""
                self.on_rejected(endpoint, reason + again)
                return
            self.events["rehandshake"] += 1
            self._resend.add(endpoint)
            group = self.agent.groups.get(group.key)  # the agent dropped the stale one
            self._group = group
            log.info("request %r: prefill %s forgot our handshake; handshaking again",
                     self.request_id, endpoint)
        group.add_waiter(self._on_regroup)

    def _on_regroup(self, group: PrefillGroup) -> None:
        with self._lock:
            if group is not self._group or self._sm.terminal or self._init is None:
                return
            if group.state is GroupState.FAILED:
                assert group.error is not None
                self._fail(group.error)
                return
            ranks = {r.endpoint: r for r in group.ranks}
            if set(ranks) != set(self._writers):
                self._fail(TransferFailed(
                    f"request {self.request_id!r}: after a new handshake the prefill group "
                    f"is {sorted(ranks)}, not the {sorted(self._writers)} the indices went "
                    f"to"))
                return
            resend, self._resend = self._resend, set()
            for ep in sorted(resend):
                w = self._writers[ep]
                w.rank, w.layout = ranks[ep].rank, ranks[ep].layout
                self.agent.post(ep, self._init)
            self._changed = time.monotonic()

    def on_peer_lost(self, endpoint: str, reason: str) -> None:
        with self._lock:
            w = self._writers.get(endpoint)
            if w is not None and not self._sm.terminal:
                self._fail(PeerLost(f"request {self.request_id!r}: prefill {w.rank}: {reason}"))

    def on_agent_closed(self) -> None:
        with self._lock:
            self._fail(AgentClosed(f"request {self.request_id!r}: the decode agent closed"))
            if not self._released.is_set():
                self._release("the agent closed; no write can be waited for any more")

    def peer_endpoints(self) -> set[str]:
        with self._lock:
            if self._released.is_set():
                return set()
            return {e for e, w in self._writers.items() if not (w.done or w.acked)}

    def on_tick(self, now: float) -> None:
        with self._lock:
            cfg = self.agent.config
            state = self._sm.state
            if state is Status.BOOTSTRAPPING and now - self._created > self._bootstrap_limit():
                what = "init() was never called" if self._init is None else \
                    "the prefill ranks were not found and handshaken"
                self._fail(RequestTimeout(f"request {self.request_id!r}: bootstrap_timeout "
                                          f"({cfg.bootstrap_timeout:g} s) passed; {what}"))
            elif state is Status.WAITING_FOR_INPUT and now - self._changed > cfg.waiting_timeout:
                self._fail(RequestTimeout(f"request {self.request_id!r}: no chunk from prefill "
                                          f"within waiting_timeout ({cfg.waiting_timeout:g} s)"))
            elif state is Status.TRANSFERRING and self._aux_since is not None:
                self._check_aux(now)
            elif state is Status.TRANSFERRING and now - self._changed > cfg.transfer_timeout:
                left = [str(w.rank) for w in self._writers.values() if not w.done]
                self._fail(RequestTimeout(
                    f"request {self.request_id!r}: no progress for transfer_timeout "
                    f"({cfg.transfer_timeout:g} s); still waiting for {', '.join(left)}"))
            if (self._sm.state is Status.FAILED and not self._released.is_set()
                    and self._release_deadline is not None and now > self._release_deadline):
                silent = [str(w.rank) for w in self._writers.values() if not (w.done or w.acked)]
                self._release(f"release_timeout ({cfg.release_timeout:g} s) passed without an "
                              f"AbortAck from {', '.join(silent)}; a late write was possible "
                              f"until now")

    def _bootstrap_limit(self) -> float:
        """bootstrap_timeout, plus a grace while the group is still connecting: its own
        deadline (no later than ours) ends it with the specific reason (server down,
        instance unknown, a rank rejected the handshake), which is the better message."""
        t = self.agent.config.bootstrap_timeout
        connecting = self._group is None or self._group.state is GroupState.CONNECTING
        return t + max(1.0, 0.25 * t) if connecting else t

    # --- success, checksums, aux (under the lock) --------------------------------------

    def _verify(self, w: _Writer, msg: TransferStatus) -> None:
        """Rebuild the chunk's plan and compare digests (worker thread)."""
        problem: SessionError | None = None
        try:
            assert msg.checksums is not None and msg.indices is not None
            if w.layout is None:
                raise ValueError("prefill sent no layout in its HelloAck")
            req: dict[str, Indices | None] = {c.name: None for c in self.agent.layout.components}
            for name, pim in msg.indices.items():
                if name not in req:
                    raise ValueError(f"checksum for unknown component {name!r}")
                req[name] = pim.to_indices()
            got = plan_digests(plan(w.layout, self.agent.layout, req), "dst", self.agent.views)
            bad = [f"component {n!r}: decode bytes crc32 {got[n]:#010x}, prefill sent "
                   f"{crc:#010x}" for n, crc in sorted(msg.checksums.items())
                   if n in got and got[n] != crc]
            if bad:
                problem = ChecksumMismatch(f"request {self.request_id!r} chunk {msg.chunk} from "
                                           f"prefill {w.rank}: " + "; ".join(bad))
        except (HandoffError, ValueError) as e:
            problem = ChecksumMismatch(f"request {self.request_id!r} chunk {msg.chunk} from "
                                       f"prefill {w.rank}: cannot check: {e}")
        with self._lock:
            w.verifying -= 1
            if problem is not None:
                self.events["checksum_mismatch"] += 1
                self._fail(problem)
            else:
                self._maybe_succeed()

    def _maybe_succeed(self) -> None:
        if self._sm.terminal or not self._writers:
            return
        if all(w.done and not w.verifying for w in self._writers.values()):
            self._aux_since = self._aux_since or time.monotonic()
            self._check_aux(time.monotonic())

    def _check_aux(self, now: float) -> None:
        assert self._aux_since is not None
        row = self._aux_view()
        state, detail = (aux.AuxState.OK, "") if row is None else aux.check(row, self.request_id)
        if state is aux.AuxState.OK:
            self.timeline.mark(tl.LANDED)
            self._sm.fire(Event.ALL_DONE)
            self._release("the request succeeded")
        elif state is not aux.AuxState.EMPTY:
            self._fail(AuxMismatch(f"request {self.request_id!r}: aux row {self._aux_row} "
                                   f"{state.value}: {detail}"))
        elif now - self._aux_since > self.agent.config.transfer_timeout:
            self._fail(AuxMismatch(
                f"request {self.request_id!r}: every prefill rank reported success but aux row "
                f"{self._aux_row} never showed the request's guard "
                f"(transfer_timeout {self.agent.config.transfer_timeout:g} s): {detail}"))

    # --- failure and release (under the lock) -------------------------------------------

    def _fail(self, error: SessionError) -> None:
        if not self._mark_failed(error):
            return
        for ep, w in self._writers.items():
            if not (w.done or w.acked):
                self.agent.post(ep, Abort(request_id=self.request_id, rank=self.agent.rank_id,
                                          reason=str(error)[:2000]))
        self._release_deadline = time.monotonic() + self.agent.config.release_timeout
        self._maybe_released()

    def _maybe_released(self) -> None:
        if self._released.is_set() or self._sm.state is not Status.FAILED:
            return
        if all(w.done or w.acked for w in self._writers.values()):
            self._release("every prefill rank confirmed no write in flight" if self._writers
                          else "no prefill rank was sent the indices")

    def _release(self, reason: str) -> None:
        if self._released.is_set():
            return
        self._release_reason = reason
        self._released.set()
        self.agent.finished(self)
