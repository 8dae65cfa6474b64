"""The bytes a soak request moves: a fill derived from the request id, and where it lands.

Pure (numpy only). Both sides of a soak describe the same :class:`Geometry` and agree,
without talking, on

* :func:`indices` — a request's planner indices: its own block of pages and its own slot
  on each side (``block_pages`` pages and slot ``block + 1``), so concurrent requests never
  share a source or a destination byte;
* :func:`byte_map` — the independent oracle's (:func:`kvhandoff.lab.testing.oracle.
  expected_writes`) map from every destination byte to its source byte, computed on *fake*
  layouts (:func:`fake_layouts`: the addresses :class:`~kvhandoff.lab.shapes.FakeAllocator`
  hands out), the same in every process;
* :func:`fill` — the byte a source address holds for a request: a hash of the request's
  key and the fake address. Prefill writes it before sending; decode recomputes it to check
  a ``SUCCESS`` request's bytes, so the checker needs no copy of prefill's memory.

:class:`MirrorArena` is a rank's real memory, allocated in the same order and sizes as the
fake layout, so fake addresses translate to real bytes (:meth:`MirrorArena.read` /
:meth:`MirrorArena.write`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvhandoff.lab import shapes
from kvhandoff.lab.testing.handoff import stamp_prefill_aux
from kvhandoff.lab.testing.oracle import ByteMap, expected_writes
from kvhandoff.layout import Layout
from kvhandoff.plan.request import Indices
from kvhandoff.state_types import IndexKind, StateType, policy

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True, slots=True, kw_only=True)
class Geometry:
    """The model shape (its tiny version), TP sizes and page blocks of every soak rank."""

    shape: str = "qwen3_next"
    prefill_tp: int = 2
    decode_tp: int = 1
    page_size: int = 4
    blocks: int = 12  # requests one agent holds at once
    block_pages: int = 10  # pages per block: a request has at most block_pages * page_size tokens

    @property
    def num_pages(self) -> int:
        return self.blocks * self.block_pages + 1  # page 0 is padding

    @property
    def max_tokens(self) -> int:
        return self.block_pages * self.page_size

    def tp(self, side: str) -> int:
        return self.prefill_tp if side == PREFILL else self.decode_tp

    def layout(self, side: str, tp_rank: int, alloc: Callable[[int], int] | None = None
               ) -> Layout:
        """Rank ``tp_rank`` of ``side``'s layout; fake addresses unless ``alloc`` is given."""
        return shapes.layout_for(shapes.tiny(shapes.get(self.shape)), tp_rank=tp_rank,
                                 tp_size=self.tp(side), page_size=self.page_size,
                                 num_pages=self.num_pages, num_slots=self.blocks + 1,
                                 alloc=alloc)

    def fake_base(self, side: str, tp_rank: int) -> int:
        """Where :func:`~kvhandoff.lab.shapes.layout_for`'s default allocator starts."""
        return (1 << 44) + (tp_rank << 38)


@functools.lru_cache(maxsize=8)
def fake_layouts(geo: Geometry) -> tuple[tuple[Layout, ...], Layout]:
    """Every prefill rank's fake layout and decode rank 0's (the soak's decode is TP 1 or
    checks rank 0 only)."""
    srcs = tuple(geo.layout(PREFILL, t) for t in range(geo.prefill_tp))
    return srcs, geo.layout(DECODE, 0)


def indices(geo: Geometry, num_tokens: int, prefill_block: int, decode_block: int
            ) -> dict[str, Indices | None]:
    """The request's indices: pages ``1..n`` and slot 1 moved into each side's block."""
    if not 0 < num_tokens <= geo.max_tokens:
        raise ValueError(f"num_tokens {num_tokens} is outside 1..{geo.max_tokens}")
    for side, b in ((PREFILL, prefill_block), (DECODE, decode_block)):
        if not 0 <= b < geo.blocks:
            raise ValueError(f"{side} block {b} is outside 0..{geo.blocks - 1}")
    srcs, dst = fake_layouts(geo)
    req = shapes.request_for(shapes.tiny(shapes.get(geo.shape)), srcs[0], dst, num_tokens,
                             contiguous=True, src_slot=prefill_block + 1,
                             dst_slot=decode_block + 1)
    kinds = {c.name: policy(c.type).index_kind for c in dst.components}
    out: dict[str, Indices | None] = {}
    for name, idx in req.items():
        if idx is None or kinds[name] is not IndexKind.PAGE:
            out[name] = idx
            continue
        out[name] = Indices(idx.src + prefill_block * geo.block_pages,
                            idx.dst + decode_block * geo.block_pages,
                            src_first_row=idx.src_first_row, dst_first_row=idx.dst_first_row,
                            num_rows=idx.num_rows, positions=idx.positions)
    return out


def byte_map(geo: Geometry, req: dict[str, Indices | None]) -> ByteMap:
    """The oracle's map of the request on the fake layouts."""
    srcs, dst = fake_layouts(geo)
    return expected_writes(srcs, dst, req)


def request_key(rid: str) -> int:
    """A 64-bit key of the request id (two ids never share a fill, short of a collision)."""
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little")


def fill(key: int, src_addrs: I64) -> U8:
    """The byte each fake source address holds for the request with ``key`` (splitmix64)."""
    x = src_addrs.astype(np.uint64) ^ np.uint64(key)
    x = x * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(31)
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    return (x >> np.uint64(56)).astype(np.uint8)


def aux_addresses(geo: Geometry, bm: ByteMap) -> tuple[npt.NDArray[np.bool_], I64]:
    """Which entries of ``bm`` write decode's aux row, and their offsets in the row."""
    _, dst = fake_layouts(geo)
    mask = np.zeros(len(bm), np.bool_)
    offs = np.zeros(len(bm), np.int64)
    for c in dst.components:
        if c.type is not StateType.AUX:
            continue
        for t in c.tensors:
            stride = t.item_stride or t.item_bytes
            inside = (bm.dst >= t.ptr) & (bm.dst < t.ptr + t.capacity * stride)
            mask |= inside
            offs[inside] = (bm.dst[inside] - t.ptr) % stride
    return mask, offs


def expected(geo: Geometry, rid: str, bm: ByteMap) -> U8:
    """What decode must hold at ``bm.dst`` once the request succeeded: the fill, except
    the aux row, which prefill's engine packs and its Sender stamps over the fill."""
    want = fill(request_key(rid), bm.src)
    mask, offs = aux_addresses(geo, bm)
    if mask.any():
        row = np.zeros(int(offs[mask].max()) + 1, np.uint8)
        row[offs[mask]] = want[mask]
        stamp_prefill_aux(row, rid)
        want[mask] = row[offs[mask]]
    return want


class MirrorArena:
    """A rank's real memory, shadowing :class:`~kvhandoff.lab.shapes.FakeAllocator`: the
    ``i``-th allocation gets a real buffer *and* the fake address the fake layout gave it,
    so fake addresses from :func:`byte_map` translate to real bytes.

    ``allocate`` (e.g. a transport's ``allocate``) provides the buffers when given.
    """

    def __init__(self, fake_base: int, allocate: Callable[[int], U8] | None = None) -> None:
        self._fake = shapes.FakeAllocator(base=fake_base)
        self._allocate = allocate
        self.bufs: list[U8] = []
        self._starts: list[int] = []

    def __call__(self, nbytes: int) -> int:
        buf = self._allocate(nbytes) if self._allocate is not None else np.empty(nbytes,
                                                                                   np.uint8)
        buf[:] = 0
        self.bufs.append(buf)
        self._starts.append(self._fake(nbytes))
        return int(buf.ctypes.data)

    def fake(self, real_ptr: int) -> int:
        """The fake address of the allocation that starts at ``real_ptr``."""
        for start, buf in zip(self._starts, self.bufs, strict=True):
            if int(buf.ctypes.data) == real_ptr:
                return start
        raise ValueError(f"no allocation of this arena starts at {real_ptr:#x}")

    def _locate(self, addrs: I64) -> tuple[I64, I64]:
        starts = np.asarray(self._starts, np.int64)
        pos = np.searchsorted(starts, addrs, side="right") - 1
        offs = addrs - starts[np.maximum(pos, 0)]
        sizes = np.asarray([len(b) for b in self.bufs], np.int64)
        if len(addrs) and ((pos < 0).any() or (offs >= sizes[np.maximum(pos, 0)]).any()):
            raise ValueError("fake address outside this arena's allocations")
        return pos, offs

    def read(self, addrs: I64) -> U8:
        pos, offs = self._locate(addrs)
        out = np.empty(len(addrs), np.uint8)
        for i in np.unique(pos).tolist():
            m = pos == i
            out[m] = self.bufs[i][offs[m]]
        return out

    def write(self, addrs: I64, values: U8) -> None:
        pos, offs = self._locate(addrs)
        for i in np.unique(pos).tolist():
            m = pos == i
            self.bufs[i][offs[m]] = values[m]
