"""The one seam between the engine and the way bytes travel.

The engine drives a :class:`Transfer` in the order of kvhandoff's session layer (and of
sglang's disaggregation), one call per rank:

* decode, per rank: :meth:`Transfer.open` with that rank's destination list of every
  component and the decode-side prefix length (``Receiver.init``; sglang's
  ``TransferInfo``);
* prefill, per rank: :meth:`Transfer.start` announcing the prompt's page count and the
  aux row, answered with decode's prefix length (``Sender.init`` then
  ``Sender.decode_prefix_len``); then :meth:`Transfer.send` per chunk with the chunk's
  KV pages, always counted from token 0 (the transfer drops pages decode already holds);
  the last chunk also carries every other component's source list (``Sender.send``);
* prefill, per rank: :meth:`Transfer.settle` before freeing the request's pages;
* decode: :meth:`Transfer.wait` until every prefill rank's last chunk landed.

:class:`LocalTransfer` does it in-process with the planner and the numpy executor
(``plan`` + ``execute`` for every prefill rank × decode rank pair; the planner elects
one writer per destination byte). A session-backed transfer maps each method onto
``Sender`` / ``Receiver`` calls.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvhandoff.errors import HandshakeError, PlanError
from kvhandoff.lab.engine.alloc import IdArray
from kvhandoff.lab.engine.pools import CHUNKED_TYPES
from kvhandoff.layout import Layout
from kvhandoff.plan import Indices, plan
from kvhandoff.plan.execute import HostMemory, execute
from kvhandoff.plan.request import Request
from kvhandoff.protocol import PROTOCOL_VERSION
from kvhandoff.session.peers.compat import handshake_report


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemList:
    """One side's index list of one component (``positions``: logical positions of ring
    rows, so rings of different sizes pair by position)."""

    items: IdArray
    positions: IdArray | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    """What one prefill rank sends for one chunk of one request."""

    pages: IdArray  # KV pages of the chunk, in sequence order, continuing from token 0
    last: bool
    state: Mapping[str, ItemList] | None = None  # every non-chunked component, last chunk


@dataclass(slots=True)
class TransferReport:
    """What landed for one request."""

    bytes_by_component: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    chunks: int = 0
    plans: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_component.values())


class Endpoint(Protocol):
    """A rank as a transfer sees it: its registered layout and memory."""

    layout: Layout
    memory: HostMemory


@runtime_checkable
class Relocatable(Endpoint, Protocol):
    """An endpoint whose memory can move (:meth:`RankPools.relocate`), for transports
    whose destinations must come from their own ``allocate`` (shm)."""

    def relocate(self, allocate: Callable[[int], npt.NDArray[np.uint8]]) -> None:
        """Move every buffer into memory from ``allocate``, keeping the contents."""


class DecodeTransfer(Protocol):
    """The decode half of a :class:`Transfer` (what a decode process holds)."""

    def open(self, rid: int, decode_rank: int, lists: Mapping[str, ItemList],
             prefix_len: int) -> None:
        """Decode rank ``decode_rank`` expects request ``rid`` into ``lists``, holding its
        first ``prefix_len`` tokens already."""

    def wait(self, rid: int) -> TransferReport:
        """Block until every prefill rank's last chunk of ``rid`` landed; forget ``rid``."""


class PrefillTransfer(Protocol):
    """The prefill half of a :class:`Transfer` (what a prefill process holds)."""

    def start(self, rid: int, prefill_rank: int, num_pages: int, aux_row: int) -> int:
        """Prefill rank ``prefill_rank`` announces ``rid`` (``num_pages`` KV pages from
        token 0, its aux row); returns decode's prefix length, once known."""

    def send(self, rid: int, prefill_rank: int, chunk: Chunk) -> None:
        """Prefill rank ``prefill_rank`` sends ``chunk`` (may return before it lands)."""

    def settle(self, rid: int, prefill_rank: int) -> None:
        """Block until no write of ``rid`` from ``prefill_rank`` reads source memory any
        more (``Sender.wait_settled``): only then may prefill free the request's pages."""


class Transfer(DecodeTransfer, PrefillTransfer, Protocol):
    """Both halves, for one process (:class:`LocalTransfer`, ``SessionLink``)."""


def handshake(prefill: Sequence[Endpoint], decode: Sequence[Endpoint]) -> None:
    """Check every (prefill rank, decode rank) pair as the session handshake does
    (:func:`~kvhandoff.session.peers.compat.handshake_report`, both sides on one in-process
    transport), so an in-process run refuses at start-up exactly what a real deployment
    would. Raises :class:`~kvhandoff.errors.HandshakeError` listing every problem, naming
    the first failing pair."""
    for p, src in enumerate(prefill):
        for d, dst in enumerate(decode):
            problems = handshake_report(src.layout, dst.layout, prefill_transport="memory",
                                        decode_transport="memory",
                                        protocol_version=PROTOCOL_VERSION)
            if problems:
                raise HandshakeError(problems, peer=f"prefill rank {p} (decode rank {d})")


@dataclass(slots=True)
class _Request:
    targets: dict[int, tuple[Mapping[str, ItemList], int]] = field(default_factory=dict)
    cursor: dict[int, int] = field(default_factory=dict)  # prefill rank -> pages handed
    done: set[int] = field(default_factory=set)
    report: TransferReport = field(default_factory=TransferReport)


class LocalTransfer:
    """In-process transfer: plan + execute from every prefill rank into every decode rank.

    Synchronous (``send`` returns after the bytes landed); not thread-safe. With
    ``plan_only`` it plans and counts every pair but moves nothing: what the planner
    would move, to compare another transfer's bytes with (run it beside that one).
    """

    def __init__(self, prefill: Sequence[Endpoint], decode: Sequence[Endpoint], *,
                 plan_only: bool = False) -> None:
        self.prefill, self.decode = list(prefill), list(decode)
        self.plan_only = plan_only
        self._reqs: dict[int, _Request] = {}

    def open(self, rid: int, decode_rank: int, lists: Mapping[str, ItemList],
             prefix_len: int) -> None:
        self._reqs.setdefault(rid, _Request()).targets[decode_rank] = (lists, prefix_len)

    def start(self, rid: int, prefill_rank: int, num_pages: int, aux_row: int) -> int:
        r = self._reqs[rid]
        if len(r.targets) != len(self.decode):
            raise PlanError(f"request {rid}: {len(r.targets)} of {len(self.decode)} decode "
                            f"ranks opened it")
        prefixes = {p for _, p in r.targets.values()}
        if len(prefixes) != 1:
            raise PlanError(f"request {rid}: decode ranks disagree on the prefix ({prefixes})")
        r.cursor[prefill_rank] = 0
        return prefixes.pop()

    def send(self, rid: int, prefill_rank: int, chunk: Chunk) -> None:
        r = self._reqs[rid]
        src = self.prefill[prefill_rank]
        first = r.cursor[prefill_rank]
        r.cursor[prefill_rank] = first + len(chunk.pages)
        for d, (lists, prefix) in sorted(r.targets.items()):
            dst = self.decode[d]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                p = plan(src.layout, dst.layout,
                         _request(src.layout, chunk, first, prefix // src.layout.page_size,
                                  lists))
            r.report.notes += [str(w.message) for w in caught]
            if not self.plan_only:
                execute(p, src.memory, dst.memory)
            for e in p.entries:
                r.report.bytes_by_component[e.component] += e.nbytes
            r.report.plans += 1
        r.report.chunks += prefill_rank == 0
        if chunk.last:
            r.done.add(prefill_rank)

    def settle(self, rid: int, prefill_rank: int) -> None:
        """Nothing to wait for: ``send`` copied synchronously."""

    def wait(self, rid: int) -> TransferReport:
        r = self._reqs[rid]
        if len(r.done) != len(self.prefill):
            missing = sorted(set(range(len(self.prefill))) - r.done)
            raise PlanError(f"request {rid}: prefill ranks {missing} never sent a last chunk")
        del self._reqs[rid]
        r.report.bytes_by_component = dict(r.report.bytes_by_component)
        return r.report


def _request(layout: Layout, chunk: Chunk, first: int, prefix_pages: int,
             lists: Mapping[str, ItemList]) -> Request:
    """The planner request pairing ``chunk`` (pages ``first ..`` from token 0) with one
    decode rank's ``lists`` (KV pages from ``prefix_pages``)."""
    skip = max(0, prefix_pages - first)  # pages decode already holds
    pages = chunk.pages[skip:]
    offset = first + skip - prefix_pages
    req: dict[str, Indices | None] = {}
    for c in layout.components:
        dst = lists[c.name]
        if c.type in CHUNKED_TYPES:
            end = offset + len(pages)
            if end > len(dst.items):
                raise PlanError(f"component {c.name!r}: chunk pages {offset}..{end} run past "
                                f"decode's {len(dst.items)} pages")
            req[c.name] = Indices(pages, dst.items[offset:end])
        elif chunk.last:
            if chunk.state is None or c.name not in chunk.state:
                raise PlanError(f"last chunk carries no source list for component {c.name!r}")
            s = chunk.state[c.name]
            pos = s.positions if s.positions is not None else dst.positions
            req[c.name] = Indices(s.items, dst.items, positions=pos)
        else:
            req[c.name] = None
    return req
