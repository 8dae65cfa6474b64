"""Pairing a request's index lists, per the component's policy, and expanding them to units.

Pure functions over read-only int64 arrays; nothing here mutates its inputs.
"""

from __future__ import annotations

import warnings

import numpy as np

from kvhandoff.errors import IndexLengthMismatch, PlanError, TrimWarning
from kvhandoff.plan.request import IndexArray, Indices
from kvhandoff.state_types import LengthPolicy, Policy


def pair_items(
    name: str, pol: Policy, idx: Indices, notes: list[str]
) -> tuple[IndexArray, IndexArray]:
    """Apply the length policy to ``idx.src`` / ``idx.dst``."""
    src, dst = idx.src, idx.dst
    if pol.max_items is not None and (len(src) > pol.max_items or len(dst) > pol.max_items):
        raise IndexLengthMismatch(
            f"component {name!r}: at most {pol.max_items} index per request, got "
            f"{len(src)} (prefill) and {len(dst)} (decode)"
        )
    if len(src) != len(dst):
        if pol.length is LengthPolicy.EXACT:
            raise IndexLengthMismatch(
                f"component {name!r} requires equal index lists (policy exact): prefill has "
                f"{len(src)}, decode has {len(dst)}"
            )
        n = min(len(src), len(dst))
        msg = (f"component {name!r}: prefill has {len(src)} indices, decode {len(dst)}; "
               f"kept the common prefix of {n} (policy trim)")
        warnings.warn(msg, TrimWarning, stacklevel=4)
        notes.append(msg)
        src, dst = src[:n], dst[:n]
    if not len(src) and not pol.may_be_empty and (len(idx.src) or len(idx.dst)):
        raise IndexLengthMismatch(f"component {name!r} needs an index on both sides")
    return src, dst


def check_unique(name: str, side: str, units: IndexArray) -> None:
    """No destination unit may be written twice.

    O(n) with a bincount over the index range when that range is small compared to
    the list (page and slot ids are); a sort otherwise."""
    n = len(units)
    if n < 2:
        return
    if n <= 32:  # a handful (a tiny request's pages): a set beats three numpy calls
        vals = units.tolist()
        if len(set(vals)) == n:
            return  # else the general path below finds and reports the repeats
    lo, hi = int(units.min()), int(units.max())
    if lo >= 0 and hi < 64 * len(units) + 4096:
        counts = np.bincount(units, minlength=0)
        if int(counts.max()) <= 1:
            return
        dup = np.flatnonzero(counts > 1)[:5].tolist()
    else:
        vals, counts = np.unique(units, return_counts=True)
        if len(vals) == len(units):
            return
        dup = vals[counts > 1][:5].tolist()
    raise PlanError(f"component {name!r}: {side} index list repeats {dup}; a byte would be "
                    f"written twice")


def token_units(
    name: str, pol: Policy, idx: Indices, s_rows: int, d_rows: int, notes: list[str]
) -> tuple[IndexArray, IndexArray]:
    """Token-row units for re-paging: row ``i`` of the chunk on each side."""
    fs, fd = idx.src_first_row, idx.dst_first_row
    cap_s = max(len(idx.src) * s_rows - fs, 0)
    cap_d = max(len(idx.dst) * d_rows - fd, 0)
    if idx.num_rows is not None:
        n = idx.num_rows
        if n > cap_s or n > cap_d:
            raise IndexLengthMismatch(
                f"component {name!r}: {n} token rows requested but prefill pages hold {cap_s} "
                f"and decode pages hold {cap_d} (pages of {s_rows} and {d_rows} rows, first rows "
                f"{fs} and {fd})"
            )
    elif cap_s != cap_d:
        if pol.length is LengthPolicy.EXACT:
            raise IndexLengthMismatch(
                f"component {name!r}: prefill pages hold {cap_s} token rows, decode pages "
                f"{cap_d} (page sizes {s_rows} vs {d_rows}); pass num_rows to say how many move"
            )
        n = min(cap_s, cap_d)
        msg = f"component {name!r}: kept the common {n} token rows of {cap_s} and {cap_d}"
        warnings.warn(msg, TrimWarning, stacklevel=4)
        notes.append(msg)
    else:
        n = cap_s
    i = np.arange(n, dtype=np.int64)
    return _rows(idx.src, i + fs, s_rows), _rows(idx.dst, i + fd, d_rows)


def _rows(items: IndexArray, flat_rows: IndexArray, rows: int) -> IndexArray:
    out: IndexArray = items[flat_rows // rows] * rows + flat_rows % rows
    return out


def ring_units(
    name: str, items_s: IndexArray, items_d: IndexArray, positions: IndexArray | None,
    s_rows: int, d_rows: int,
) -> tuple[IndexArray, IndexArray]:
    """Ring-row units by logical position: position ``p`` is row ``p % rows`` on each side."""
    if positions is None:
        raise PlanError(
            f"component {name!r}: ring sizes differ ({s_rows} prefill rows vs {d_rows} decode "
            f"rows); pass positions so rows pair by logical position"
        )
    if len(positions) > min(s_rows, d_rows) or (
        len(positions) and int(positions.min()) < 0
    ):
        raise PlanError(
            f"component {name!r}: {len(positions)} positions do not fit a ring of "
            f"{min(s_rows, d_rows)} rows (or a position is negative)"
        )
    for rows, side in ((s_rows, "prefill"), (d_rows, "decode")):
        if len(np.unique(positions % rows)) != len(positions):
            raise PlanError(f"component {name!r}: positions collide in the {side} ring of {rows}")
    src = (items_s[:, None] * s_rows + positions[None, :] % s_rows).ravel()
    dst = (items_d[:, None] * d_rows + positions[None, :] % d_rows).ravel()
    return src, dst
