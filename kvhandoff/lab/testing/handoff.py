"""Session test scenarios: who runs, what each request moves, and the bytes that must land.

Test support (used by ``tests/e2e``, ``tests/faults`` and the session benchmark), not by
the library. Everything here is deterministic, so a prefill process and a decode process
build the same layouts, requests and memory contents independently:

* :class:`Topology` / :class:`RequestPlan` / :class:`Scenario` — picklable descriptions.
* :class:`Arena` — host memory for one rank's layout, filled with seeded noise (allocation
  ``i`` of rank ``(side, dp, tp, pp)`` always holds the same bytes), optionally carved
  from a transport's :meth:`~kvhandoff.transport.base.Transport.allocate` (shm).
* :func:`layout_of` / :func:`request_of` — a rank's layout and a request's planner indices
  (from :func:`kvhandoff.lab.shapes.request_for`, with each request's decode pages and slots
  moved to a block of their own, :attr:`Topology.block_pages` pages each, so concurrent
  requests never share a destination byte).
* :func:`prefill_pages` — the KV pages the prefill engine hands to ``Sender.send``, from
  token 0 (pages inside decode's prefix are placeholders the Sender drops).
* :func:`stamp_prefill_aux` — what the prefill engine writes into its aux row.
* :class:`Verifier` — decode's memory after the run, checked byte for byte against the
  independent oracle (:func:`kvhandoff.lab.testing.oracle.expected_writes`) applied to a
  replica of every prefill rank's memory built in the decode process; every byte the
  oracle does not expect to change must still hold its initial noise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvhandoff.lab import shapes
from kvhandoff.lab.testing.oracle import expected_writes
from kvhandoff.layout import Layout
from kvhandoff.plan.request import Indices
from kvhandoff.protocol import IndexListMsg, RequestId
from kvhandoff.session.request import aux
from kvhandoff.session.request.receiver import route_dp
from kvhandoff.state_types import IndexKind, StateType, policy

U8 = npt.NDArray[np.uint8]
AUX = aux.AuxSpec()


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """The two deployments: model shape (its tiny version), parallelism, pages."""

    shape: str
    prefill_tp: int = 1
    prefill_pp: int = 1
    decode_tp: int = 1
    decode_pp: int = 1
    dp_size: int = 1  # prefill DP groups (each a full tp x pp set of ranks)
    prefill_page: int = 4
    decode_page: int = 4
    num_pages: int = 64
    num_slots: int = 8
    kv_heads: int | None = None  # override the tiny shape's KV heads (GQA cases)
    num_layers: int | None = None

    def model(self) -> shapes.ModelShape:
        s = shapes.tiny(shapes.get(self.shape), num_layers=self.num_layers)
        return dataclasses.replace(s, kv_heads=self.kv_heads) if self.kv_heads else s

    def prefill_ranks(self, dp: int | None = None) -> list[tuple[int, int, int]]:
        """``(dp, tp, pp)`` of every prefill rank (of one DP group)."""
        dps = range(self.dp_size) if dp is None else [dp]
        return [(d, t, p) for d in dps for p in range(self.prefill_pp)
                for t in range(self.prefill_tp)]

    @property
    def block_pages(self) -> int:
        """Decode pages each request block owns (page 0 is padding; block ``b`` holds
        pages ``b * block_pages + 1 ..``); the same for every request, so blocks never
        overlap."""
        return (self.num_pages - 1) // max(1, self.num_slots - 1)

    def decode_ranks(self) -> list[tuple[int, int]]:
        return [(t, p) for p in range(self.decode_pp) for t in range(self.decode_tp)]


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestPlan:
    """One request: its tokens, decode's prefix hit, how prefill chunks it."""

    rid: RequestId
    num_tokens: int
    prefix_len: int = 0
    chunk_pages: int = 0  # pages per chunk (0: everything in the last chunk)
    empty_last: bool = False  # the last chunk carries no pages (state and aux only)
    seed: int = 0
    block: int = 0  # which block of decode pages and slots the request owns (distinct!)
    dp_rank: int | None = None  # None: route_dp(rid, dp_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """A run: topology, requests, transport, session config overrides, and knobs the
    drivers in :mod:`kvhandoff.lab.testing.sides` use to inject faults."""

    topo: Topology
    requests: tuple[RequestPlan, ...]
    transport: str = "tcp"
    transport_options: Mapping[str, Any] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    verify: bool = True
    timeout: float = 60.0  # how long drivers wait for terminal statuses
    faults: Mapping[str, Any] = field(default_factory=dict)

    def dp_of(self, rp: RequestPlan) -> int:
        return rp.dp_rank if rp.dp_rank is not None else route_dp(rp.rid, self.topo.dp_size)


class Arena:
    """Seeded host memory for one rank; ``alloc(nbytes) -> ptr`` for ``layout_for``.

    ``allocate`` (e.g. ``transport.allocate``) provides the buffers when given; the noise
    is written into them either way."""

    def __init__(self, key: tuple[int, ...], allocate: Callable[[int], U8] | None = None) -> None:
        self.key = key
        self.bufs: list[U8] = []
        self._allocate = allocate

    def __call__(self, nbytes: int) -> int:
        buf = self._allocate(nbytes) if self._allocate is not None else np.empty(nbytes, np.uint8)
        buf[:] = self.initial(len(self.bufs), nbytes)
        self.bufs.append(buf)
        return int(buf.ctypes.data)

    def initial(self, i: int, nbytes: int) -> U8:
        """The bytes allocation ``i`` starts with."""
        return np.random.default_rng([*self.key, i]).integers(0, 256, nbytes, dtype=np.uint8)


PREFILL, DECODE = 0, 1


def layout_of(topo: Topology, side: int, tp: int, pp: int, alloc: Arena) -> Layout:
    """The layout of prefill (``side=0``) or decode (``side=1``) rank ``tp``/``pp``."""
    tp_size, pp_size = ((topo.prefill_tp, topo.prefill_pp) if side == PREFILL
                        else (topo.decode_tp, topo.decode_pp))
    page = topo.prefill_page if side == PREFILL else topo.decode_page
    return shapes.layout_for(topo.model(), tp_rank=tp, tp_size=tp_size, page_size=page,
                             num_pages=topo.num_pages, num_slots=topo.num_slots, pp_rank=pp,
                             pp_size=pp_size, alloc=alloc)


def arena_key(scn: Scenario, side: int, dp: int, tp: int, pp: int) -> tuple[int, ...]:
    return (scn.seed, side, dp, tp, pp)


def request_of(scn: Scenario, rp: RequestPlan, src: Layout, dst: Layout
               ) -> dict[str, Indices | None]:
    """The planner indices of request ``rp`` between prefill rank ``src`` and decode rank
    ``dst``: ``shapes.request_for`` with contiguous pages and slot ``block + 1``, then the
    decode side's pages moved to the request's own block."""
    topo = scn.topo
    model = topo.model()
    req = shapes.request_for(model, src, dst, rp.num_tokens, prefix_len=rp.prefix_len,
                             seed=rp.seed, contiguous=True, src_slot=rp.block + 1,
                             dst_slot=rp.block + 1)
    offset = rp.block * topo.block_pages
    types = {c.name: c.type for c in dst.components}
    out: dict[str, Indices | None] = {}
    for name, idx in req.items():
        if idx is None or policy(types[name]).index_kind is not IndexKind.PAGE:
            out[name] = idx
            continue
        if len(idx.dst) and int(idx.dst.max()) > topo.block_pages:
            raise ValueError(f"request {rp.rid!r}: component {name!r} needs "
                             f"{int(idx.dst.max())} decode pages, a block holds "
                             f"{topo.block_pages}; give the topology more pages")
        out[name] = Indices(idx.src, idx.dst + offset, src_first_row=idx.src_first_row,
                            dst_first_row=idx.dst_first_row, num_rows=idx.num_rows,
                            positions=idx.positions)
    return out


def kv_name(layout: Layout) -> str | None:
    for c in layout.components:
        if c.type in (StateType.KV, StateType.MLA):
            return c.name
    return None


def aux_name(layout: Layout) -> str | None:
    for c in layout.components:
        if c.type is StateType.AUX:
            return c.name
    return None


def prefill_pages(topo: Topology, rp: RequestPlan, req: Mapping[str, Indices | None],
                  kv: str | None) -> npt.NDArray[np.int64]:
    """The KV pages prefill hands over, from token 0: placeholders (page 0) for the pages
    inside decode's prefix, then the pages the request moves."""
    if kv is None:
        return np.zeros(0, np.int64)
    idx = req[kv]
    assert idx is not None
    head = rp.prefix_len // topo.prefill_page
    return np.concatenate([np.zeros(head, np.int64), idx.src])


def chunks_of(rp: RequestPlan, pages: npt.NDArray[np.int64]) -> list[npt.NDArray[np.int64]]:
    """How prefill splits its page list into chunks (the last may be empty)."""
    step = rp.chunk_pages or max(len(pages), 1)
    parts = [pages[i:i + step] for i in range(0, len(pages), step)] or [pages[:0]]
    if rp.empty_last:
        parts.append(pages[:0])
    return parts


def decode_lists(req: Mapping[str, Indices | None], dst: Layout
                 ) -> tuple[dict[str, object | None], int | None]:
    """What decode passes to ``Receiver.init``: every component's destination list (with
    row offsets and positions where the request has them) and the aux row."""
    out: dict[str, object | None] = {}
    row = None
    ax = aux_name(dst)
    for name, idx in req.items():
        if name == ax:
            assert idx is not None
            row = int(idx.dst[0])
            continue
        if idx is None:
            out[name] = None
        elif idx.dst_first_row or idx.num_rows is not None or idx.positions is not None:
            out[name] = IndexListMsg.of(idx.dst, first_row=idx.dst_first_row,
                                        num_rows=idx.num_rows, positions=idx.positions)
        else:
            out[name] = idx.dst
    return out, row


def prefill_state(req: Mapping[str, Indices | None], src: Layout) -> dict[str, object | None]:
    """The state components prefill passes with its last chunk."""
    from kvhandoff.session.request.chunks import SourceList
    skip = {kv_name(src), aux_name(src)}
    return {n: None if i is None else (SourceList(i.src, i.src_first_row) if i.src_first_row
                                       else i.src)
            for n, i in req.items() if n not in skip}


def first_token(rid: RequestId) -> int:
    return aux.request_guard(rid) % 50_000


def stamp_prefill_aux(row: U8, rid: RequestId) -> None:
    """What the prefill engine and its Sender write into the request's aux row."""
    AUX.pack(row, first_token=first_token(rid), first_logprob=-0.5)
    aux.stamp(row, rid)


class Verifier:
    """Checks a decode rank's memory against the oracle (see the module docstring)."""

    def __init__(self, scn: Scenario, tp: int, pp: int, dst: Layout, arena: Arena) -> None:
        self.scn, self.dst, self.arena = scn, dst, arena
        self.tp, self.pp = tp, pp
        self._replicas: dict[int, tuple[list[Layout], list[Arena]]] = {}

    def _sources(self, dp: int) -> tuple[list[Layout], list[Arena]]:
        if dp not in self._replicas:
            lays, arenas = [], []
            for _, t, p in self.scn.topo.prefill_ranks(dp):
                a = Arena(arena_key(self.scn, PREFILL, dp, t, p))
                lays.append(layout_of(self.scn.topo, PREFILL, t, p, a))
                arenas.append(a)
            self._replicas[dp] = (lays, arenas)
        return self._replicas[dp]

    def check(self, done: list[RequestPlan], failed: Sequence[RequestPlan] = ()) -> list[str]:
        """Problems found (empty: every expected byte landed, nothing else changed).

        ``done``: requests that succeeded (their bytes must match the oracle). ``failed``:
        requests that did not (their destination bytes and aux rows may hold anything)."""
        from kvhandoff.plan.execute import HostMemory
        from kvhandoff.session.request.views import TensorViews
        expected = [a.copy() for a in (self.arena.initial(i, len(b))
                                       for i, b in enumerate(self.arena.bufs))]
        problems = []
        for rp in done:
            lays, arenas = self._sources(self.scn.dp_of(rp))
            for lay in lays:
                ax = aux_name(lay)
                if ax is not None and lay.component(ax).tensors:
                    row = TensorViews(lay).row(lay.component(ax).tensors[0], rp.block + 1)
                    if row is not None:
                        stamp_prefill_aux(row, rp.rid)
            req = request_of(self.scn, rp, lays[0], self.dst)
            bm = expected_writes(lays, self.dst, req)
            src_mem = HostMemory([b for a in arenas for b in a.bufs])
            place(expected, self.arena.bufs, bm.dst, src_mem.read(bm.src))
        for rp in failed:
            lays, _ = self._sources(self.scn.dp_of(rp))
            req = request_of(self.scn, rp, lays[0], self.dst)
            free = expected_writes(lays, self.dst, req).dst
            ax = aux_name(self.dst)
            if ax is not None:
                t = self.dst.component(ax).tensors[0]
                row0 = t.ptr + (rp.block + 1) * t.item_stride
                free = np.concatenate([free, np.arange(row0, row0 + t.item_bytes)])
            # anything goes there: expect what is there
            place(expected, self.arena.bufs, free, HostMemory(self.arena.bufs).read(free))
        for i, (b, e) in enumerate(zip(self.arena.bufs, expected, strict=True)):
            bad = np.flatnonzero(b != e)
            if len(bad):
                problems.append(f"decode tp{self.tp} pp{self.pp} buffer {i}: {len(bad)} of "
                                f"{len(b)} bytes differ (first at offset {int(bad[0])})")
        return problems


def place(expected: list[np.ndarray], bufs: Sequence[np.ndarray], addrs: np.ndarray,
          values: np.ndarray) -> None:
    """Set the bytes at absolute addresses ``addrs`` (all inside ``bufs``) to ``values``
    in ``expected``, the per-buffer copies of ``bufs`` a verifier compares them with."""
    starts = np.array([int(b.ctypes.data) for b in bufs], np.int64)
    order = np.argsort(starts)
    pos = np.searchsorted(starts[order], addrs, side="right") - 1
    for k in np.unique(pos).tolist():
        i = int(order[k])
        m = pos == k
        expected[i][addrs[m] - starts[i]] = values[m]
