"""Decode side of one request, sans I/O: events in, effects out.

:class:`~kvhandoff.session.request.receiver.Receiver` is the shell: it finds the prefill group,
holds the lock, feeds these events (with the time, where a rule needs it) and carries
out the effects. The rules:

* **Bootstrapping.** Once ``init`` gave the indices and the group is ready, they are
  posted to every prefill rank of the group: BOOTSTRAPPED (WAITING_FOR_INPUT).
* **Statuses.** Each writer reports every chunk once, its last one once, nothing after
  it; a FAILED status fails the request. With checksums asked for, every chunk is
  verified (``Verify``, answered ``verified``) before it counts towards success.
* **Success** needs every writer done (every chunk up to its last), no check running,
  and the aux guard (``CheckGuard``, answered ``guard``) holding this request's stamp;
  an empty guard is waited for up to ``transfer_timeout``.
* **Re-handshake.** A writer that forgot our handshake ("unknown decode peer") and has
  not written yet: handshake again (``Rehandshake``), then resend the indices to it
  (``regroup``), at most ``MAX_REHANDSHAKES`` times; else the request is rejected.
* **Timeouts** (``tick``): bootstrap, waiting for the first chunk, no progress.
* **Failure** (first one wins): every writer not done and not acknowledged gets an
  ``Abort``. **Release** (``Release``): when every writer is done or acknowledged, when
  the request succeeded, or when ``release_timeout`` passed after the failure.

Effects (besides ``Post``/``Fire``/``Fail``/``Mark``): ``ClearGuard``, ``CheckGuard``,
``Verify``, ``Rehandshake``, ``Release``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvhandoff.layout import Layout
from kvhandoff.observe import timeline as tl
from kvhandoff.protocol import Abort, Outcome, RankId, RequestId, TransferInit, TransferStatus
from kvhandoff.session.config import SessionConfig
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
from kvhandoff.session.request.aux import AuxState
from kvhandoff.session.request.core import CoreBase, Mark, Post, RankFacts
from kvhandoff.session.request.status import Event, Status

log = logging.getLogger("kvhandoff.session.request.receiver")

MAX_REHANDSHAKES = 2  # per request: "unknown decode peer" answered by a new handshake


class RankEntry(Protocol):
    """One prefill rank of a ready group (``groups.PrefillRank`` is one)."""

    @property
    def endpoint(self) -> str: ...

    @property
    def rank(self) -> RankId: ...

    @property
    def layout(self) -> Layout | None: ...


@dataclass(frozen=True, slots=True)
class ClearGuard:
    """Clear the aux row before any write can land in it."""


@dataclass(frozen=True, slots=True)
class CheckGuard:
    """Read the aux row now (answer: ``guard``)."""


@dataclass(frozen=True, slots=True)
class Verify:
    """Digest the destination bytes of ``msg``'s chunk, off the lock (answer: ``verified``)."""

    endpoint: str
    msg: TransferStatus
    layout: Layout | None  # the prefill rank's (None: its HelloAck sent none)


@dataclass(frozen=True, slots=True)
class Rehandshake:
    """Handshake with the group again (answer: ``regroup`` / ``regroup_failed``)."""


@dataclass(frozen=True, slots=True)
class Release:
    reason: str


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
        that travel in band (:mod:`~kvhandoff.session.rank.notices`) may overtake one another,
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


class RecvCore(CoreBase):
    """See the module docstring. Every event returns the effects to carry out, in order."""

    def __init__(self, *, request_id: RequestId, facts: RankFacts, created: float) -> None:
        super().__init__(request_id=request_id, facts=facts, created=created)
        self.init_msg: TransferInit | None = None
        self.aux_row: int | None = None
        self._ranks: tuple[RankEntry, ...] | None = None  # the ready group's
        self.writers: dict[str, _Writer] = {}
        self._changed = created  # last progress, for the waiting/transfer timeouts
        self._guard_since: float | None = None  # every writer done; waiting for the guard
        self._resend: set[str] = set()  # writers to send the indices again, once regrouped
        self._release_deadline: float | None = None
        self.released = False
        self.events["rehandshake"] = 0

    # --- queries ---------------------------------------------------------------------

    @property
    def config(self) -> SessionConfig:
        return self._facts.config

    def peer_endpoints(self) -> set[str]:
        if self.released:
            return set()
        return {e for e, w in self.writers.items() if not (w.done or w.acked)}

    # --- the engine's events -----------------------------------------------------------

    def init(self, msg: TransferInit, aux_row: int | None, now: float,
             ranks: Iterable[RankEntry] | None) -> list[object]:
        """The indices; ``ranks``: the group's, if it is ready now. Raises
        ``RuntimeError`` when called twice."""
        if self.init_msg is not None:
            raise RuntimeError(f"Receiver {self.request_id!r}: init() called twice")
        self.init_msg, self.aux_row = msg, aux_row
        if not self.terminal:
            if aux_row is not None:
                self._emit(ClearGuard())
            if ranks is not None:
                self._ranks = tuple(ranks)
            self._maybe_send(now)
        return self._take()

    def abort(self, reason: str, now: float) -> list[object]:
        self._fail(RequestAborted(f"request {self.request_id!r}: {reason}"), now)
        return self._take()

    def poll(self) -> list[object]:
        """The engine polls: look at the guard again if success waits on it."""
        if self._guard_since is not None and not self.terminal:
            self._emit(CheckGuard())
        return self._take()

    # --- the group's events ------------------------------------------------------------

    def group_ready(self, ranks: Iterable[RankEntry], now: float) -> list[object]:
        if not self.terminal:
            self._ranks = tuple(ranks)
            self._maybe_send(now)
        return self._take()

    def group_failed(self, error: SessionError, now: float) -> list[object]:
        """The group could not be found or handshaken (or the lookup failed)."""
        self._fail(error, now)
        return self._take()

    def regroup(self, ranks: Iterable[RankEntry], now: float) -> list[object]:
        """The new handshake after ``Rehandshake`` is done: resend the indices."""
        if self.terminal or self.init_msg is None:
            return []
        found = {r.endpoint: r for r in ranks}
        if set(found) != set(self.writers):
            self._fail(TransferFailed(
                f"request {self.request_id!r}: after a new handshake the prefill group "
                f"is {sorted(found)}, not the {sorted(self.writers)} the indices went "
                f"to"), now)
            return self._take()
        resend, self._resend = self._resend, set()
        for ep in sorted(resend):
            w = self.writers[ep]
            w.rank, w.layout = found[ep].rank, found[ep].layout
            self._emit(Post(ep, self.init_msg))
        self._changed = now
        return self._take()

    def regroup_failed(self, error: SessionError, now: float) -> list[object]:
        if not self.terminal and self.init_msg is not None:
            self._fail(error, now)
        return self._take()

    # --- prefill's events ----------------------------------------------------------------

    def chunk_status(self, endpoint: str, msg: TransferStatus, now: float) -> list[object]:
        w = self.writers.get(endpoint)
        if w is None or self.terminal:
            return []
        if msg.outcome is Outcome.FAILED:
            # it stops writing; its AbortAck (not this status) says nothing is in flight
            self._fail(TransferFailed(f"request {self.request_id!r}: prefill {msg.rank} "
                                      f"failed (chunk {msg.chunk}): {msg.reason}"), now)
            return self._take()
        problem = w.count(msg.chunk, msg.last)
        if problem is not None:
            self._fail(TransferFailed(f"request {self.request_id!r}: prefill {msg.rank} "
                                      f"{problem}"), now)
            return self._take()
        self._changed = now
        self.nbytes += msg.nbytes
        if self.init_msg is not None and self.init_msg.expect_checksum:
            if msg.checksums is None or msg.indices is None:
                self._fail(ChecksumMismatch(
                    f"request {self.request_id!r}: checksums were asked for but prefill "
                    f"{msg.rank} sent none with chunk {msg.chunk}"), now)
                return self._take()
            w.verifying += 1
            self._emit(Verify(endpoint, msg, w.layout))
        if self.status is Status.WAITING_FOR_INPUT:
            self._fire(Event.CHUNK_DONE)
        self._maybe_succeed(now)
        return self._take()

    def verified(self, endpoint: str, msg: TransferStatus, got: dict[str, int] | None,
                 cannot: str | None, now: float) -> list[object]:
        """A ``Verify`` ended: ``got`` the destination digests, or ``cannot`` say why not."""
        w = self.writers[endpoint]
        w.verifying -= 1
        where = f"request {self.request_id!r} chunk {msg.chunk} from prefill {w.rank}"
        bad = [] if got is None else [
            f"component {n!r}: decode bytes crc32 {got[n]:#010x}, prefill sent {crc:#010x}"
            for n, crc in sorted((msg.checksums or {}).items()) if n in got and got[n] != crc]
        if cannot is not None or bad:
            self.events["checksum_mismatch"] += 1
            self._fail(ChecksumMismatch(f"{where}: cannot check: {cannot}" if cannot is not None
                                        else f"{where}: " + "; ".join(bad)), now)
        else:
            self._maybe_succeed(now)
        return self._take()

    def guard(self, state: AuxState, detail: str, now: float) -> list[object]:
        """The aux row, read for a ``CheckGuard`` (``OK`` also when there is none)."""
        if self.terminal or self._guard_since is None:
            return []
        if state is AuxState.OK:
            self._emit(Mark(tl.LANDED))
            self._fire(Event.ALL_DONE)
            self._release("the request succeeded")
        elif state is not AuxState.EMPTY:
            self._fail(AuxMismatch(f"request {self.request_id!r}: aux row {self.aux_row} "
                                   f"{state.value}: {detail}"), now)
        elif now - self._guard_since > self.config.transfer_timeout:
            self._fail(AuxMismatch(
                f"request {self.request_id!r}: every prefill rank reported success but aux row "
                f"{self.aux_row} never showed the request's guard "
                f"(transfer_timeout {self.config.transfer_timeout:g} s): {detail}"), now)
        return self._take()

    def prefill_aborted(self, who: str, reason: str, now: float) -> list[object]:
        self._fail(RequestAborted(f"request {self.request_id!r} aborted by prefill {who}: "
                                  f"{reason}"), now)
        return self._take()

    def abort_ack(self, endpoint: str) -> list[object]:
        w = self.writers.get(endpoint)
        if w is not None:
            w.acked = True
            self._maybe_released()
        return self._take()

    def rejected(self, endpoint: str, reason: str, now: float) -> list[object]:
        if endpoint in self.writers:
            self.writers[endpoint].acked = True  # it refused: it never wrote
            self._fail(RequestRejected(f"request {self.request_id!r}: prefill {endpoint} "
                                       f"refused it: {reason}"), now)
        return self._take()

    def unknown_peer(self, endpoint: str, reason: str, now: float) -> list[object]:
        """A writer answered our indices "unknown decode peer": it lost our handshake."""
        w = self.writers.get(endpoint)
        if w is None or self.init_msg is None or self.terminal:
            return []
        done = self.events["rehandshake"]
        if w.chunks or done >= MAX_REHANDSHAKES:
            again = f" (after {done} new handshake(s))" if done else ""
            return self.rejected(endpoint, reason + again, now)
        self.events["rehandshake"] += 1
        self._resend.add(endpoint)
        log.info("request %r: prefill %s forgot our handshake; handshaking again",
                 self.request_id, endpoint)
        self._emit(Rehandshake())
        return self._take()

    # --- the rank's events ---------------------------------------------------------------

    def peer_lost(self, endpoint: str, reason: str, now: float) -> list[object]:
        w = self.writers.get(endpoint)
        if w is not None and not self.terminal:
            self._fail(PeerLost(f"request {self.request_id!r}: prefill {w.rank}: {reason}"), now)
        return self._take()

    def agent_closed(self, now: float) -> list[object]:
        self._fail(AgentClosed(f"request {self.request_id!r}: the decode agent closed"), now)
        self._release("the agent closed; no write can be waited for any more")
        return self._take()

    def tick_due(self, now: float) -> bool:
        """Whether :meth:`tick` may have anything to do at ``now``. Safe without the
        shell's lock: it reads the last progress time, then the status, then the guard
        wait, in that order; an older progress time or an earlier status only makes the
        answer True more often, and a guard wait read after the status is as fresh as
        the status, so a stale answer is at worst a True that :meth:`tick` then finds has
        nothing to do."""
        changed = self._changed  # first: see the docstring
        state = self.status
        cfg = self.config
        if state is Status.BOOTSTRAPPING:  # its limit is never below bootstrap_timeout
            return now - self.created > cfg.bootstrap_timeout
        if state is Status.WAITING_FOR_INPUT:
            return now - changed > cfg.waiting_timeout
        if state is Status.TRANSFERRING:
            return self._guard_since is not None or now - changed > cfg.transfer_timeout
        return state is not Status.SUCCESS  # FAILED: the release deadline

    def tick(self, now: float, connecting: bool) -> list[object]:
        """Timers; ``connecting``: the group is still being found and handshaken."""
        cfg, state = self.config, self.status
        if state is Status.BOOTSTRAPPING and now - self.created > self._bootstrap_limit(
                connecting):
            what = "init() was never called" if self.init_msg is None else \
                "the prefill ranks were not found and handshaken"
            self._fail(RequestTimeout(f"request {self.request_id!r}: bootstrap_timeout "
                                      f"({cfg.bootstrap_timeout:g} s) passed; {what}"), now)
        elif state is Status.WAITING_FOR_INPUT and now - self._changed > cfg.waiting_timeout:
            self._fail(RequestTimeout(f"request {self.request_id!r}: no chunk from prefill "
                                      f"within waiting_timeout ({cfg.waiting_timeout:g} s)"), now)
        elif state is Status.TRANSFERRING and self._guard_since is not None:
            self._emit(CheckGuard())
        elif state is Status.TRANSFERRING and now - self._changed > cfg.transfer_timeout:
            left = [str(w.rank) for w in self.writers.values() if not w.done]
            self._fail(RequestTimeout(
                f"request {self.request_id!r}: no progress for transfer_timeout "
                f"({cfg.transfer_timeout:g} s); still waiting for {', '.join(left)}"), now)
        if (self.status is Status.FAILED and self._release_deadline is not None
                and now > self._release_deadline):
            silent = [str(w.rank) for w in self.writers.values() if not (w.done or w.acked)]
            self._release(f"release_timeout ({cfg.release_timeout:g} s) passed without an "
                          f"AbortAck from {', '.join(silent)}; a late write was possible "
                          f"until now")
        return self._take()

    # --- the rules (each appends effects) -------------------------------------------------

    def _bootstrap_limit(self, connecting: bool) -> float:
        """bootstrap_timeout, plus a grace while the group is still connecting: its own
        deadline (no later than ours) ends it with the specific reason (server down,
        instance unknown, a rank rejected the handshake), which is the better message."""
        t = self.config.bootstrap_timeout
        return t + max(1.0, 0.25 * t) if connecting else t

    def _maybe_send(self, now: float) -> None:
        if (self.init_msg is None or self._ranks is None
                or self.status is not Status.BOOTSTRAPPING):
            return
        for r in self._ranks:
            self.writers[r.endpoint] = _Writer(r.endpoint, r.rank, r.layout)
        self._emit(Mark(tl.ASKED))
        for r in self._ranks:
            self._emit(Post(r.endpoint, self.init_msg))
        self._changed = now
        self._fire(Event.BOOTSTRAPPED)

    def _maybe_succeed(self, now: float) -> None:
        if self.terminal or not self.writers:
            return
        if all(w.done and not w.verifying for w in self.writers.values()):
            self._guard_since = self._guard_since or now
            self._emit(CheckGuard())

    def _fail(self, error: SessionError, now: float) -> None:
        if not self._mark_failed(error):
            return
        for ep, w in self.writers.items():
            if not (w.done or w.acked):
                self._emit(Post(ep, Abort(request_id=self.request_id, rank=self.rank,
                                          reason=str(error)[:2000])))
        self._release_deadline = now + self.config.release_timeout
        self._maybe_released()

    def _maybe_released(self) -> None:
        if self.released or self.status is not Status.FAILED:
            return
        if all(w.done or w.acked for w in self.writers.values()):
            self._release("every prefill rank confirmed no write in flight" if self.writers
                          else "no prefill rank was sent the indices")

    def _release(self, reason: str) -> None:
        if not self.released:
            self.released = True
            self._emit(Release(reason))
