"""``format_plan``: a plan as a few human lines, for logs and debugging.

One header line (the ranks and the totals), one line per component in plan order, then
the planner's notes. It reads the plan's counts, never its index arrays, so it is cheap
enough for a debug log on every request (``str(plan)`` is this too)::

    plan P0→D0: 17 entries, 297 units, 4.8 MiB, 25 pieces, 18449 segments
      kv       4 entries    256 units     4.0 MiB    4 pieces  layers 3..7
      mamba    8 entries      8 units   268.0 KiB   16 pieces  layers 0..5
      aux        1 entry       1 unit       256 B     1 piece
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from dataclasses import dataclass
from typing import Protocol


class _Entry(Protocol):
    """What the formatter reads of one :class:`~kvhandoff.plan.model.TensorPlan`."""

    @property
    def component(self) -> str: ...
    @property
    def layer_id(self) -> int: ...
    @property
    def src_idx(self) -> Sized: ...
    @property
    def pieces(self) -> Sized: ...
    @property
    def nbytes(self) -> int: ...


class _Plan(Protocol):
    """What the formatter reads of a :class:`~kvhandoff.plan.model.Plan` (a protocol, so
    this module imports nothing of the planner and ``Plan.__str__`` can call it)."""

    @property
    def entries(self) -> Sequence[_Entry]: ...
    @property
    def src_tp_rank(self) -> int: ...
    @property
    def dst_tp_rank(self) -> int: ...
    @property
    def notes(self) -> Sequence[str]: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def num_units(self) -> int: ...
    @property
    def num_pieces(self) -> int: ...
    @property
    def num_segments(self) -> int: ...


def human_size(n: float) -> str:
    """``n`` bytes as B / KiB / MiB / GiB."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _count(n: int, word: str, plural: str = "") -> str:
    return f"{n} {word}" if n == 1 else f"{n} {plural or word + 's'}"


@dataclass(slots=True)
class _Component:
    entries: int = 0
    units: int = 0
    nbytes: int = 0
    pieces: int = 0
    low: int | None = None  # layer range, model layers only
    high: int | None = None

    def add_layer(self, layer: int) -> None:
        if layer < 0:  # NO_LAYER: aux rows, request rows
            return
        self.low = layer if self.low is None else min(self.low, layer)
        self.high = layer if self.high is None else max(self.high, layer)


def format_plan(plan: _Plan) -> str:
    """``plan`` in a few lines: the source → destination TP ranks and totals, then per
    component (in plan order) its entries, units, bytes, pieces and layer range, then
    the planner's notes. No trailing newline."""
    comps: dict[str, _Component] = {}
    for e in plan.entries:
        c = comps.setdefault(e.component, _Component())
        c.entries += 1
        c.units += len(e.src_idx)
        c.nbytes += e.nbytes
        c.pieces += len(e.pieces)
        c.add_layer(e.layer_id)
    lines = [f"plan P{plan.src_tp_rank}→D{plan.dst_tp_rank}: "
             f"{_count(len(plan.entries), 'entry', 'entries')}, "
             f"{_count(plan.num_units, 'unit')}, {human_size(plan.nbytes)}, "
             f"{_count(plan.num_pieces, 'piece')}, {_count(plan.num_segments, 'segment')}"]
    if not comps:
        lines[0] += " (nothing moves)"
    width = max((len(name) for name in comps), default=0)
    for name, c in comps.items():
        entries = _count(c.entries, "entry", "entries")
        line = (f"  {name:<{width}}  {entries:>11}  {_count(c.units, 'unit'):>11}  "
                f"{human_size(c.nbytes):>10}  {_count(c.pieces, 'piece'):>10}")
        if c.low is not None:
            line += f"  layer {c.low}" if c.low == c.high else f"  layers {c.low}..{c.high}"
        lines.append(line.rstrip())
    lines.extend(f"  note: {n}" for n in plan.notes)
    return "\n".join(lines)
