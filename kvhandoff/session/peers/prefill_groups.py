"""Decode side: find a prefill DP group's ranks and handshake with each, once, shared.

A :class:`PrefillGroup` is one (bootstrap url, prefill instance, DP group) as seen by one
decode rank: the prefill ranks it needs (:func:`~kvhandoff.session.peers.mapping.bootstrap_peers`),
each with its control endpoint, its answer to our ``Hello`` and its layout. Every
Receiver routed to that group shares it. Connecting runs on a worker thread:

1. look the instance up on the bootstrap server until every rank registered (bounded by
   ``bootstrap_timeout``; an unreachable server is retried within that time too);
2. send ``Hello`` to each candidate rank and wait for every ``HelloAck``/``HelloReject``
   (or until one of them answers with something that fails authentication: it does not
   hold our deployment secret, :meth:`PrefillGroups.refuse`; no use waiting out the
   timeout).

The group ends READY, or FAILED with a :class:`~kvhandoff.session.errors.SessionError`
naming every problem (a rejected handshake lists each rank's reasons). A failed group is
forgotten at once, so the next Receiver tries again (prefill may have been fixed); a
ready group is forgotten when one of its ranks is lost.

Thread-safety: everything is safe from any thread; waiter callbacks run on the thread
that finished the group (a worker), outside the groups' locks.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvhandoff.bootstrap.client import (
    BootstrapRejected,
    BootstrapTimeout,
    BootstrapUnavailable,
    InstanceInfo,
    RankFilter,
    RankRecord,
    lookup,
)
from kvhandoff.errors import LayoutMismatch
from kvhandoff.layout import Layout
from kvhandoff.protocol import (
    Hello,
    HelloAck,
    HelloReject,
    ProtocolError,
    RankId,
    layout_from_msg,
)
from kvhandoff.session.errors import BootstrapFailed, HandshakeError, SessionError
from kvhandoff.session.peers.mapping import bootstrap_peers

_POLL_S = (0.02, 0.5)  # bootstrap lookup retry interval: first, and cap
_STOP_POLL_S = 0.1  # how soon a handshake wait notices the agent closing


class GroupState(enum.StrEnum):
    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class PrefillRank:
    """One prefill rank of a ready group."""

    endpoint: str  # its control endpoint
    rank: RankId
    writes: bool  # the planner has it write into this decode rank
    layout: Layout | None  # its layout (from HelloAck; needed for checksum checks)


GroupKey = tuple[str, str, int]
"""(bootstrap url, prefill instance, DP group)."""

Waiter = Callable[["PrefillGroup"], None]


class PrefillGroup:
    """One prefill DP group as seen by this decode rank. See the module docstring."""

    def __init__(self, key: GroupKey) -> None:
        self.key = key
        self.url, self.instance, self.dp_rank = key
        self._cond = threading.Condition()
        self.state = GroupState.CONNECTING
        self.error: SessionError | None = None
        self.ranks: tuple[PrefillRank, ...] = ()
        self.dp_size = 0
        self._replies: dict[str, HelloAck | HelloReject] = {}
        self._refused: dict[str, str] = {}  # endpoint → why its answer was not authentic
        self._pending: frozenset[str] = frozenset()
        self._waiters: list[Waiter] = []

    def __repr__(self) -> str:
        return f"<PrefillGroup {self.instance!r}@{self.url} dp {self.dp_rank}: {self.state.value}>"

    @property
    def endpoints(self) -> frozenset[str]:
        with self._cond:
            return frozenset(r.endpoint for r in self.ranks) | self._pending

    def add_waiter(self, waiter: Waiter) -> None:
        """Call ``waiter(self)`` once the group is READY or FAILED (at once if it is)."""
        with self._cond:
            if self.state is GroupState.CONNECTING:
                self._waiters.append(waiter)
                return
        waiter(self)

    def wait(self, timeout: float) -> GroupState:
        with self._cond:
            self._cond.wait_for(lambda: self.state is not GroupState.CONNECTING, timeout)
            return self.state

    def _reply(self, endpoint: str, msg: HelloAck | HelloReject) -> bool:
        with self._cond:
            if endpoint not in self._pending or endpoint in self._replies:
                return False
            self._replies[endpoint] = msg
            self._cond.notify_all()
            return True

    def _refuse(self, endpoint: str, reason: str) -> bool:
        with self._cond:
            if endpoint not in self._pending or endpoint in self._replies \
                    or endpoint in self._refused:
                return False
            self._refused[endpoint] = reason
            self._cond.notify_all()
            return True

    def _finish(self, ranks: tuple[PrefillRank, ...] | None, error: SessionError | None) -> None:
        with self._cond:
            if self.state is not GroupState.CONNECTING:
                return
            if error is None and ranks is not None:
                self.state, self.ranks = GroupState.READY, ranks
            else:
                self.state, self.error = GroupState.FAILED, error
            self._pending = frozenset()
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        for w in waiters:
            w(self)


class PrefillGroups:
    """The decode rank's table of prefill groups; see the module docstring.

    ``hello`` is this rank's Hello (built once by the agent); ``send`` queues a control
    message; ``spawn`` runs a blocking job on a worker thread; ``stop`` is set when the
    agent closes (jobs give up at once)."""

    def __init__(self, *, hello: Hello, timeout: float, send: Callable[[str, Hello], None],
                 spawn: Callable[[Callable[[], None]], None], stop: threading.Event,
                 on_setup: Callable[[float, float], None] | None = None) -> None:
        self._hello = hello
        self._on_setup = on_setup  # (lookup s, handshake s) of each group that connected
        self._timeout = timeout
        self._send = send
        self._spawn = spawn
        self._stop = stop
        self._lock = threading.Lock()
        self._groups: dict[GroupKey, PrefillGroup] = {}
        self._dp_sizes: dict[tuple[str, str], int] = {}

    def dp_size(self, url: str, instance: str) -> int | None:
        """The DP size of an instance, once any group of it has looked it up."""
        with self._lock:
            return self._dp_sizes.get((url, instance))

    def get(self, key: GroupKey) -> PrefillGroup:
        """The group for ``key``, connecting it in the background if it is new."""
        with self._lock:
            group = self._groups.get(key)
            if group is not None:
                return group
            group = PrefillGroup(key)
            self._groups[key] = group
        self._spawn(lambda: self._connect(group))
        return group

    def on_reply(self, endpoint: str, msg: HelloAck | HelloReject) -> bool:
        """Deliver a handshake answer (I/O thread). False if no group waits for it."""
        with self._lock:
            groups = list(self._groups.values())
        return any(g._reply(endpoint, msg) for g in groups)

    def refuse(self, endpoint: str, reason: str) -> bool:
        """The prefill rank at ``endpoint`` answered with something that failed
        authentication (I/O thread): a handshake waiting for it fails now, naming
        ``reason``. False if none waits for it."""
        with self._lock:
            groups = list(self._groups.values())
        return any([g._refuse(endpoint, reason) for g in groups])

    def drop_endpoint(self, endpoint: str, *, ready_only: bool = False) -> list[PrefillGroup]:
        """Forget every group that uses ``endpoint`` (its rank is lost or forgot us);
        with ``ready_only``, only those that finished their handshake (one still
        connecting handshakes with the rank as it is now)."""
        with self._lock:
            gone = [k for k, g in self._groups.items() if endpoint in g.endpoints
                    and not (ready_only and g.state is GroupState.CONNECTING)]
            return [self._groups.pop(k) for k in gone]

    def groups(self) -> list[PrefillGroup]:
        with self._lock:
            return list(self._groups.values())

    # --- the connect job (worker thread) ---------------------------------------------

    def _connect(self, group: PrefillGroup) -> None:
        t0 = time.monotonic()
        deadline = t0 + self._timeout
        try:
            info = self._lookup(group, deadline)
            t1 = time.monotonic()
            ranks = self._handshake(group, info, deadline)
        except SessionError as e:
            self._forget(group)
            group._finish(None, e)
            return
        if self._on_setup is not None:
            self._on_setup(t1 - t0, time.monotonic() - t1)
        group._finish(ranks, None)

    def _forget(self, group: PrefillGroup) -> None:
        with self._lock:
            if self._groups.get(group.key) is group:
                del self._groups[group.key]

    def _lookup(self, group: PrefillGroup, deadline: float) -> InstanceInfo:
        what = f"prefill instance {group.instance!r} at {group.url}"
        flt = RankFilter(dp_rank=group.dp_rank)
        delay, last = _POLL_S[0], "no answer yet"
        for _ in range(int(self._timeout / _POLL_S[0]) + 2):  # bounded in count and time
            if self._stop.is_set():
                raise BootstrapFailed(f"{what}: the agent closed during the lookup")
            left = deadline - time.monotonic()
            try:
                info = lookup(group.url, group.instance, filters=flt, wait_timeout=0,
                              timeout=max(0.1, min(2.0, left)))
            except (BootstrapTimeout, BootstrapUnavailable) as e:
                last = str(e)
            except BootstrapRejected as e:
                raise BootstrapFailed(f"{what}: {e}") from e
            else:
                with self._lock:
                    self._dp_sizes[(group.url, group.instance)] = info.dp_size
                return info
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._stop.wait(min(delay, left))
            delay = min(delay * 2, _POLL_S[1])
        raise BootstrapFailed(f"{what}: not found within bootstrap_timeout "
                              f"({self._timeout:g} s); last answer: {last}")

    def _handshake(self, group: PrefillGroup, info: InstanceInfo, deadline: float
                   ) -> tuple[PrefillRank, ...]:
        me = self._hello.rank
        dp = group.dp_rank
        if not 0 <= dp < info.dp_size:
            raise BootstrapFailed(f"request routed to prefill DP group {dp}, but instance "
                                  f"{info.instance!r} has {info.dp_size} DP group(s)")
        try:
            keys = bootstrap_peers(dp_rank=dp, src_tp_size=info.tp_size,
                                   src_pp_size=info.pp_size, dst_tp_rank=me.tp_rank,
                                   dst_tp_size=me.tp_size, dst_pp_rank=me.pp_rank,
                                   dst_pp_size=me.pp_size)
        except LayoutMismatch as e:
            raise HandshakeError(e.problems, peer=f"instance {info.instance!r}") from e
        records = [info.rank(dp_rank=k.dp_rank, tp_rank=k.tp_rank, pp_rank=k.pp_rank)
                   for k in keys]
        endpoints = [r.control_endpoint for r in records]
        with group._cond:
            group.dp_size = info.dp_size
            group._pending = frozenset(endpoints)
        for ep in endpoints:
            self._send(ep, self._hello)
        replies, refused = self._await_replies(group, endpoints, deadline)
        if self._stop.is_set():
            raise BootstrapFailed(f"instance {info.instance!r}: the agent closed during the "
                                  f"handshake")
        if refused:
            raise HandshakeError([f"prefill {rec.where()}: {refused[rec.control_endpoint]}"
                                  for rec in records if rec.control_endpoint in refused],
                                 peer=f"instance {info.instance!r}")
        missing = [f"{rec.where()} at {rec.control_endpoint}" for rec in records
                   if rec.control_endpoint not in replies]
        if missing:
            raise HandshakeError(
                [f"no answer to Hello within bootstrap_timeout ({self._timeout:g} s) from "
                 f"{m}" for m in missing], peer=f"instance {info.instance!r}")
        return _ranks_of(records, replies, f"instance {info.instance!r} DP group {dp}")

    def _await_replies(self, group: PrefillGroup, endpoints: list[str], deadline: float
                       ) -> tuple[dict[str, HelloAck | HelloReject], dict[str, str]]:
        """Wait until every endpoint answered the Hello, one was refused, the agent
        stops or ``deadline``; returns the replies and refusals by endpoint so far."""
        with group._cond:
            # until the deadline (bootstrap_timeout): a reply notifies at once, a stop is
            # seen within _STOP_POLL_S
            while (any(ep not in group._replies for ep in endpoints)
                   and not group._refused and not self._stop.is_set()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                group._cond.wait(min(left, _STOP_POLL_S))
            return dict(group._replies), dict(group._refused)


def _ranks_of(records: list[RankRecord], replies: dict[str, HelloAck | HelloReject], peer: str
              ) -> tuple[PrefillRank, ...]:
    """The handshaken prefill ranks of ``records`` from their ``replies``; a
    :class:`HandshakeError` naming every rank that rejected the Hello or sent a layout
    that does not decode (``peer``: the group, for the message)."""
    problems: list[str] = []
    out = []
    for rec in records:
        reply = replies[rec.control_endpoint]
        if isinstance(reply, HelloReject):
            problems += [f"prefill {reply.rank}: {p}" for p in reply.problems]
            continue
        layout = None
        if reply.layout is not None:
            try:
                layout = layout_from_msg(reply.layout)
            except ProtocolError as e:
                problems.append(f"prefill {reply.rank}: {e}")
                continue
        out.append(PrefillRank(rec.control_endpoint, reply.rank, reply.writes, layout))
    if problems:
        raise HandshakeError(problems, peer=peer)
    return tuple(out)
