"""Staging's slots and the copies in and out of them: the receiver's :class:`Arena` of
registered slots, the sender's :func:`gather` of a frame into one buffer and the
receiver's :func:`scatter` of a slot to its destinations (one numpy call per chunk)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable

import numpy as np

from kvhandoff.memory import piece_view
from kvhandoff.transport.framing.cut import Chunk
from kvhandoff.transport.framing.wire import Records
from kvhandoff.transport.regions import U8, RegionTable
from kvhandoff.transport.views import as_rows, take_into


def gather(chunks: list[Chunk], table: RegionTable, out: U8) -> int:
    """Copy the source bytes of ``chunks`` (validated against ``table``) into ``out``,
    in wire order; returns the bytes written."""
    pos = 0
    for c in chunks:
        n = c.nbytes
        if not n:
            continue
        view = piece_view(table.view(c.src_ptr), c.src_off, c.src_unit, c.count,
                          c.src_stride, c.length)
        dest = out[pos:pos + n].reshape(len(c.src_idx), c.count, c.length)
        take_into(as_rows(view), c.src_idx, as_rows(dest))
        pos += n
    return pos


def scatter(records: Records, table: RegionTable, src: U8) -> None:
    """Write ``src`` (the payload of ``records``, in wire order) to the destinations
    the records describe. The caller checked ``records.problem(table)`` first."""
    pos = 0
    for r in range(len(records)):
        ptr, unit, off, length, count, stride, idx = records.record(r)
        n = len(idx) * length * count
        if not n:
            continue
        view = piece_view(table.view(ptr), off, unit, count, stride, length)
        as_rows(view)[idx] = as_rows(src[pos:pos + n].reshape(len(idx), count, length))
        pos += n


class Arena:
    """``slots`` registered slots of ``slot_bytes``; leases slots to connections.
    Thread-safe. Freed slots go to the back of the queue (reused last); quarantined
    ones join it once their time has passed, checked when a lease is made (time is
    ``time.monotonic()``; nothing runs in between)."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.buf: U8 = np.zeros(slots * slot_bytes, np.uint8)  # pages appear when touched
        self.base = int(self.buf.ctypes.data)
        self._free: deque[int] = deque(range(slots))
        self._held: list[tuple[float, list[int]]] = []  # (release time, slots), in order
        self._lock = threading.Lock()

    def lease(self, want: int) -> list[int]:
        with self._lock:
            if self._held:
                now = time.monotonic()
                while self._held and self._held[0][0] <= now:
                    self._free.extend(self._held.pop(0)[1])
            return [self._free.popleft() for _ in range(min(want, len(self._free)))]

    def give_back(self, slots: Iterable[int]) -> None:
        """Slots no write can still reach: free at once."""
        with self._lock:
            self._free.extend(slots)

    def quarantine(self, slots: Iterable[int], seconds: float) -> None:
        """Slots a late engine write may still reach: free ``seconds`` from now."""
        held = list(slots)
        if not held:
            return
        with self._lock:
            until = time.monotonic() + seconds
            k = len(self._held)  # keep release order (periods may differ)
            while k and self._held[k - 1][0] > until:
                k -= 1
            self._held.insert(k, (until, held))

    @property
    def in_use(self) -> int:
        """Slots leased to senders or quarantined: not free for a new lease."""
        with self._lock:
            return self.slots - len(self._free)

    @property
    def quarantined(self) -> int:
        """Slots held back from the free list (including any whose time has passed but
        that no lease has released yet)."""
        with self._lock:
            return sum(len(s) for _, s in self._held)

    def slot(self, i: int) -> U8:
        return self.buf[i * self.slot_bytes:(i + 1) * self.slot_bytes]
