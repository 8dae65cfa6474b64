"""What the engine adapters (``mooncake``, ``nixl``) share.

* :class:`EngineEndpoint`: the bytes one side hands the other, versioned, carrying the
  engine address and the table of regions the side registered, so the *initiator*
  refuses a write outside the peer's memory before the engine sees it.
* :func:`engine_segments`: a plan as the fewest ``(src, dst, length)`` requests that
  each lie inside one registered region on both sides (engines address memory
  region by region; RDMA keys and NIXL descriptors cannot span two).
* :class:`Progress`: polls an engine with backoff sleeps, from a daemon thread or
  from the thread waiting on a handle; an idle transport uses no CPU and a busy one
  never spins a core.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from kvhandoff.layout import MemoryKind, Region
from kvhandoff.plan.model import Plan, Segments
from kvhandoff.transport.base import Handle, TransferState
from kvhandoff.transport.errors import ConnectError
from kvhandoff.transport.regions import RegionTable

log = logging.getLogger("kvhandoff.transport")

ENDPOINT_VERSION = 1
_NOBUF = np.zeros(0, np.uint8)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineEndpoint:
    """What a peer needs to reach and address an engine transport.

    ``address`` is the engine's own name for the side (Mooncake session
    ``host:port``, NIXL agent name); ``blob`` is opaque engine metadata (NIXL's agent
    metadata); ``regions`` are ``(ptr, nbytes, memory)`` of every registered block
    at the time :meth:`Transport.endpoint` was called."""

    kind: str
    address: str
    regions: tuple[tuple[int, int, str], ...]
    options: tuple[tuple[str, str], ...] = ()
    blob: bytes = b""
    version: int = ENDPOINT_VERSION

    def encode(self) -> bytes:
        return json.dumps({
            "kind": self.kind,
            "version": self.version,
            "address": self.address,
            "regions": [list(r) for r in self.regions],
            "options": dict(self.options),
            "blob": base64.b64encode(self.blob).decode("ascii"),
        }, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, kind: str) -> EngineEndpoint:
        """Parse and validate; raises :class:`ConnectError` naming what is wrong."""
        try:
            d = json.loads(data)
            ep = cls(
                kind=str(d["kind"]),
                version=int(d["version"]),
                address=str(d["address"]),
                regions=tuple((int(p), int(n), str(MemoryKind(m)))
                              for p, n, m in d["regions"]),
                options=tuple(sorted((str(k), str(v)) for k, v in d["options"].items())),
                blob=base64.b64decode(d["blob"], validate=True),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConnectError(f"not a {kind} transport endpoint: {bytes(data[:80])!r}") from e
        if ep.kind != kind:
            raise ConnectError(f"endpoint is for the {ep.kind!r} transport, not {kind!r}")
        if ep.version != ENDPOINT_VERSION:
            raise ConnectError(
                f"{kind} endpoint version {ep.version}; this kvhandoff speaks {ENDPOINT_VERSION}")
        if any(p < 0 or n < 0 for p, n, _ in ep.regions):
            raise ConnectError(f"{kind} endpoint advertises a negative region: {ep.regions}")
        return ep

    def table(self) -> RegionTable:
        """The advertised regions as a table (bounds checks only: no views)."""
        try:
            return RegionTable((Region(ptr=p, nbytes=n, memory=MemoryKind(m)), _NOBUF)
                               for p, n, m in self.regions)
        except ValueError as e:  # overlapping regions: a malformed endpoint
            raise ConnectError(f"{self.kind} endpoint {self.address}: {e}") from e


def add_regions(table: RegionTable, regions: Iterable[Region]) -> RegionTable:
    """``table`` plus ``regions`` (any memory kind), for bounds checks only."""
    return table.with_regions((r, _NOBUF) for r in regions)


def describe_regions(regions: Iterable[Region]) -> tuple[tuple[int, int, str], ...]:
    return tuple((r.ptr, r.nbytes, str(r.memory)) for r in regions)


def _inside(addr: np.ndarray, length: np.ndarray, table: RegionTable) -> np.ndarray:
    """Per segment: does ``[addr, addr+length)`` lie inside one region of ``table``?"""
    if not len(table):
        return np.zeros(len(addr), bool)
    starts = np.array([r.ptr for r in table.regions], np.int64)
    ends = starts + np.array([r.nbytes for r in table.regions], np.int64)
    i = np.searchsorted(starts, addr, side="right") - 1
    ok: np.ndarray = (i >= 0) & (addr + length <= ends[np.maximum(i, 0)])
    return ok


def engine_segments(plan: Plan, src: RegionTable, dst: RegionTable) -> Segments:
    """The plan's bytes as coalesced, non-empty segments, each inside one region on
    both sides. The caller has already bounds-checked both sides of the plan (so every
    tensor's segments lie in one region each side).

    Coalescing across tensors (a layer's K and V contiguous on both sides) is kept
    unless a merged segment would straddle two adjacent registered regions."""
    parts = [e.runs() if e.whole_units else e.segments().coalesce() for e in plan.entries]
    segs = parts[0] if len(parts) == 1 else Segments.concat(parts)
    if len(parts) > 1:
        merged = segs.coalesce()
        if len(merged) == len(segs) or (_inside(merged.src, merged.length, src).all()
                                        and _inside(merged.dst, merged.length, dst).all()):
            segs = merged
    keep = segs.length > 0
    if not keep.all():
        segs = Segments(segs.src[keep], segs.dst[keep], segs.length[keep])
    return segs


class Progress:
    """Drives an engine that needs polling, without spinning a core.

    ``step() -> (progressed, busy)`` polls the engine once (thread-safe; it takes the
    transport's lock): ``busy`` means work is still in flight. A daemon thread calls it
    while work is in flight, sleeping ``min_sleep`` after a round that made progress
    and growing by half up to ``max_sleep`` after one that did not; with nothing in
    flight it blocks on a condition until :meth:`kick` (an idle transport uses no CPU).
    While a caller is in :meth:`wait`, that caller polls instead (a completion is seen
    without a thread hand-off) and the thread stands back. If ``step`` raises,
    ``on_crash(exc)`` fails every pending handle and the thread exits, loudly.
    """

    def __init__(self, name: str, step: Callable[[], tuple[bool, bool]],
                 on_crash: Callable[[BaseException], None], *,
                 min_sleep: float = 20e-6, max_sleep: float = 1e-3, spin: float = 200e-6) -> None:
        self._step = step
        self._on_crash = on_crash
        self._min, self._max, self._spin = min_sleep, max_sleep, spin
        self._cond = threading.Condition(threading.Lock())
        self._kicked = False
        self._stopping = False
        self._waiters = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def kick(self) -> None:
        """New work: poll now (wakes an idle or backing-off thread)."""
        with self._cond:
            self._kicked = True
            self._cond.notify()

    def wait(self, handle: Handle, timeout: float) -> TransferState:
        """Poll from this thread until ``handle`` is final or ``timeout`` passes:
        back-to-back for the first ``spin`` seconds (a sleep costs ~100 µs on a VM),
        then with the same backoff as the thread."""
        start = time.monotonic()
        deadline = start + max(0.0, timeout)
        delay = self._min
        with self._cond:
            self._waiters += 1
        try:
            while handle.state is TransferState.PENDING and not self._stopping:
                progressed, _ = self._step()
                now = time.monotonic()
                if handle.state is not TransferState.PENDING or now >= deadline:
                    break
                if now - start < self._spin:
                    time.sleep(0)
                    continue
                delay = self._min if progressed else min(delay * 1.5, self._max)
                time.sleep(min(delay, deadline - now))
        finally:
            with self._cond:
                self._waiters -= 1
                self._kicked = True  # the thread resumes polling what is left
                self._cond.notify()
        if handle.state is TransferState.PENDING and self._stopping:
            return handle.wait(max(0.0, deadline - time.monotonic()))
        return handle.state

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        delay, busy = self._min, False
        try:
            while True:
                with self._cond:
                    if (busy or self._waiters) and not self._kicked:
                        self._cond.wait(delay if not self._waiters else self._max)
                    while not busy and not self._kicked and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                    kicked, self._kicked = self._kicked, False
                    if self._waiters and not kicked:
                        continue  # a waiter is polling
                progressed, busy = self._step()
                delay = self._min if (progressed or kicked) else min(delay * 1.5, self._max)
        except BaseException as e:  # report, never die silently
            log.exception("transport progress thread %s crashed", self._thread.name)
            self._on_crash(e)
