"""Staging's shared pieces: its configuration, the control protocol's constants, and
what either side needs to know of a plan or a peer's table (see the package docstring)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from kvhandoff.layout import MemoryKind
from kvhandoff.plan.model import Plan
from kvhandoff.transport.framing.served import MAX_PER_HOST
from kvhandoff.transport.framing.wire import Header, Kind
from kvhandoff.transport.regions import U8, RegionTable
from kvhandoff.transport.views import unit_contiguous

JOB = struct.Struct("<qq")  # job id, slot index (-1: a whole-plan CHECK)
MAX_REPLY = 4096
BYE = Header(Kind.BYE, 0, 0, 0, 0).pack()
FRAME_S = 0.25  # how long a close lets a control frame being written finish (for BYE)
QUARANTINE_FLOOR = 30.0
"""The least default quarantine, in seconds (see :class:`StagingConfig`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StagingConfig:
    """When and how an engine adapter stages (keyword-only; frozen).

    A plan is staged when it has at least ``min_segments`` (estimated, coalesced)
    segments averaging under ``below`` bytes. ``slot_bytes``: one engine write (and one
    frame); ``slots``: the receiving arena (``slots × slot_bytes`` of virtual memory,
    touched only when used); ``slots_per_peer``: slots leased to one sender, i.e. how
    many frames it keeps in flight. ``enabled=False`` turns staging off both ways.

    ``quarantine``: seconds the slots of a sender that went away without a BYE stay out
    of the free list (see the module docstring); None: ``max(io_timeout, 30 s)``. The
    receiver cannot see the sender's engine, only that its control connection ended; a
    write posted before that can still land afterwards: the sender itself waits up to
    ``io_timeout`` for a write before giving up on it, an abandoned ``close`` leaves the
    engine's teardown running past ``close_timeout`` (5 s by default), and engines
    retransmit or drain a dead peer's connection for seconds. The default is a generous
    bound on that lateness, not a proof; 0 turns the quarantine off.

    ``max_connections_per_host``: control connections the receiver holds from one source
    address (each sending peer holds one); extras are refused with a logged reason."""

    enabled: bool = True
    below: int = 64 << 10
    min_segments: int = 64
    slot_bytes: int = 4 << 20
    slots: int = 16
    slots_per_peer: int = 4
    quarantine: float | None = None
    max_connections_per_host: int = MAX_PER_HOST

    def __post_init__(self) -> None:
        if (self.below < 1 or self.min_segments < 1 or self.slot_bytes < 4096
                or self.slots < 1 or self.slots_per_peer < 1
                or self.max_connections_per_host < 1
                or (self.quarantine is not None and not self.quarantine >= 0)):
            raise ValueError(f"invalid staging config: {self}")

    def quarantine_for(self, io_timeout: float) -> float:
        """The quarantine in seconds, with the default resolved against ``io_timeout``."""
        if self.quarantine is not None:
            return self.quarantine
        return max(io_timeout, QUARANTINE_FLOOR)

    def too_coarse(self, nbytes: int, segments: int) -> bool:
        """Whether ``nbytes`` in ``segments`` segments are not worth staging: fewer
        than ``min_segments``, or averaging ``below`` bytes or more. More segments never
        make a plan coarser, so an upper bound on its count can rule it out early."""
        return segments < self.min_segments or nbytes >= self.below * segments


def estimate_segments(plan: Plan) -> int:
    """An upper bound on the plan's coalesced segment count, without expanding it:
    whole-unit entries count their runs of consecutive indices; other entries one
    segment per unit for pieces contiguous on both sides, else one per row."""
    total = 0
    for e in plan.entries:
        n = len(e.src_idx)
        if not n:
            continue
        if e.whole_units:
            s, d = e.src_idx, e.dst_idx
            total += 1 + int(np.count_nonzero((np.diff(s) != 1) | (np.diff(d) != 1)))
            continue
        for _so, _do, ln, cnt, ss, ds in e.pieces.tolist():
            if ln and cnt:
                joint = unit_contiguous(cnt, ss, ln) and unit_contiguous(cnt, ds, ln)
                total += n * (1 if joint else cnt)
    return total


def host_regions(table: RegionTable) -> RegionTable:
    """The host-memory regions of an advertised table (what staging may scatter to)."""
    empty: U8 = np.zeros(0, np.uint8)
    return RegionTable((r, empty) for r in table.regions if r.memory is MemoryKind.HOST)
