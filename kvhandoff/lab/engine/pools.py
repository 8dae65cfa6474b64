"""One TP rank's pools: the rank's Layout backed by real host memory.

:func:`rank_layout` asks :func:`kvhandoff.lab.shapes.layout_for` for the rank's layout
(the same builder the library's golden shapes use, so engine pools and library shapes
cannot drift apart) and :class:`RankPools` allocates every tensor for real, rewriting
the layout's addresses. The one deviation from ``layout_for``: DeepSeek-V4's C128
request state is kept *offline* (a ring of 128 ``[kv | gate]`` rows per request, what
the HF compressor buffers) instead of sglang's online ``(max, sum, kv)`` row, which
is a different algorithm's state and cannot be rebuilt from HF's buffer exactly.

Each tensor is viewed as **units**: a token row of a page (KV, SWA, latent, indexer
pages), a compressed row, a ring row, or a whole slot item. Units are what the
engine writes and reads; items are what the planner moves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvhandoff.lab.shapes import LayerKind, ModelShape, layout_for
from kvhandoff.layout import Component, Layout, RowKind, TensorSpec
from kvhandoff.plan.execute import HostMemory
from kvhandoff.state_types import StateType

PAGE_TYPES = (StateType.KV, StateType.MLA, StateType.NSA)
"""Components indexed by full-pool pages."""
WINDOW_TYPES = (StateType.SWA, StateType.DSV4_SWA)
"""Components indexed by sliding-window pool pages."""
CHUNKED_TYPES = (StateType.KV, StateType.MLA)
"""Components that move chunk by chunk during prefill; every other one moves once,
with the last chunk."""
C128_RING = 128


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PoolConfig:
    """Pool sizes of one instance (every rank of it)."""

    page_size: int
    num_pages: int
    num_slots: int
    swa_page_size: int | None = None  # DeepSeek-V4 SWA pool page; SWA models use page_size
    num_swa_pages: int = 0


def rank_layout(shape: ModelShape, pools: PoolConfig, *, tp_rank: int, tp_size: int) -> Layout:
    """The layout TP rank ``tp_rank`` of ``tp_size`` registers (fake addresses)."""
    layout = layout_for(
        shape, tp_rank=tp_rank, tp_size=tp_size, page_size=pools.page_size,
        num_pages=pools.num_pages, num_slots=pools.num_slots,
        num_swa_pages=pools.num_swa_pages or None, swa_page_size=pools.swa_page_size,
    )
    if not shape.has(LayerKind.DSV4_C128):
        return layout
    row = 2 * shape.dsv4_head_dim * 4  # [kv | gate], fp32
    comps = []
    for c in layout.components:
        if c.name == "c128_state":
            c = dataclasses.replace(c, tensors=tuple(
                dataclasses.replace(t, item_bytes=C128_RING * row,
                                    nbytes=C128_RING * row * pools.num_slots,
                                    rows=C128_RING, row_kind=RowKind.RING)
                for t in c.tensors))
        comps.append(c)
    return dataclasses.replace(layout, components=tuple(comps), regions=())


def units_per_item(t: TensorSpec, comp: Component, page_size: int) -> int:
    """How many units one item of ``t`` holds (token/ring rows; opaque indexer pages
    hold ``page_size`` token rows; slots are one unit)."""
    if t.row_kind is not RowKind.ITEM:
        return t.rows
    return page_size if comp.type in PAGE_TYPES else 1


Allocate = Callable[[int], npt.NDArray[np.uint8]]
"""Returns a zeroed, C-contiguous uint8 buffer of at least the given number of bytes."""

_ALIGN = 64  # bytes between tensors in a rank's block


def _zeros(nbytes: int) -> npt.NDArray[np.uint8]:
    return np.zeros(nbytes, dtype=np.uint8)


class RankPools:
    """Every tensor of one rank's layout, allocated (zeroed) in host memory: one block
    from ``allocate`` (``numpy.zeros`` by default), each tensor at a 64-byte boundary.

    ``layout`` carries the real addresses; ``memory`` is what the in-process executor
    (and a transport) reads and writes. Not thread-safe.
    """

    def __init__(self, layout: Layout, allocate: Allocate = _zeros) -> None:
        self._specs: dict[tuple[str, str, int], tuple[Component, TensorSpec]] = {}
        self._bufs: dict[tuple[str, str, int], npt.NDArray[np.uint8]] = {}
        self._place(layout, allocate)

    def relocate(self, allocate: Allocate) -> None:
        """Move every tensor into one new block from ``allocate`` (e.g. a transport's
        ``allocate``, whose destinations peers can map), keeping the contents. ``layout``
        and ``memory`` change: relocate before registering the layout anywhere."""
        old = self._bufs
        self._place(self.layout, allocate)
        for key, buf in old.items():
            self._bufs[key][:] = buf

    def _place(self, layout: Layout, allocate: Allocate) -> None:
        offsets: list[int] = []
        total = 0
        for c in layout.components:
            for t in c.tensors:
                offsets.append(total)
                total += -(-t.nbytes // _ALIGN) * _ALIGN
        block = allocate(max(total, 1))
        if block.dtype != np.uint8 or block.ndim != 1 or len(block) < total or \
                not block.flags.c_contiguous:
            raise ValueError(f"rank {layout.tp_rank}: allocate({total}) returned "
                             f"{block.dtype} {block.shape}, not a contiguous uint8 buffer "
                             f"of {total} bytes")
        self.memory = HostMemory()
        self._bufs = {}
        comps = []
        at = iter(offsets)
        for c in layout.components:
            tensors = []
            for t in c.tensors:
                off = next(at)
                buf = block[off:off + t.nbytes]
                t = dataclasses.replace(t, ptr=self.memory.add(buf) if t.nbytes else 0)
                self._bufs[(c.name, t.name, t.layer_id)] = buf
                tensors.append(t)
            comps.append(dataclasses.replace(c, tensors=tuple(tensors)))
        self.layout = dataclasses.replace(layout, components=tuple(comps), regions=())
        self._specs = {(c.name, t.name, t.layer_id): (c, t)
                       for c in self.layout.components for t in c.tensors}

    def spec(self, key: tuple[str, str, int]) -> tuple[Component, TensorSpec]:
        return self._specs[key]

    def units(self, key: tuple[str, str, int]) -> npt.NDArray[np.uint8]:
        """A writable ``[num_units, unit_bytes]`` view of tensor ``key``."""
        comp, t = self._specs[key]
        per = units_per_item(t, comp, self.layout.page_size)
        return self._bufs[key].reshape(t.capacity * per, t.item_bytes // per)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self._bufs.values())
