"""Per-component index lists of one request, computed by each side from its own tables.

Both prefill and decode call :func:`component_lists` with their own tables; the lists
pair position by position in the planner (their *values* differ: each side's page ids
and slots). The arithmetic is :mod:`kvhandoff.indices`' (sglang_facts §3.2):

==================  =====================================================================
component type      list
==================  =====================================================================
KV, MLA, NSA        pages of ``[prefix, n)`` (KV / MLA are sliced chunk by chunk)
SWA                 SWA pages of the window ``[page_floor(max(prefix, n - W)), n)`` (``W``:
                    :attr:`~kvhandoff.lab.engine.arch.Arch.swa_span`)
DSV4_SWA            the same on the DeepSeek-V4 SWA pool, plus the C4 compressor's live
                    positions (ring rows pair by position)
MAMBA, REQUEST_ROW  the request slot
AUX                 the request's aux row (leased apart)
REQUEST_ROW
DSV4_REQUEST        the request slot while C128 state is pending (``n % 128``), else none
==================  =====================================================================
"""

from __future__ import annotations

import numpy as np

from kvhandoff.indices import (
    compress_state_positions,
    mamba_slot,
    suffix_pages,
    swa_window_pages,
)
from kvhandoff.lab.engine.tables import ReqTable, Tables
from kvhandoff.lab.engine.transfer import ItemList
from kvhandoff.layout import Layout
from kvhandoff.state_types import StateType


def component_lists(
    layout: Layout, tables: Tables, req: ReqTable, *, n: int, prefix: int, window: int
) -> dict[str, ItemList]:
    """Every component's list for a request of ``n`` prompt tokens, ``prefix`` of which
    decode already holds."""
    row = tables.row_slots(req)
    slot = np.array([req.slot], dtype=np.int64)
    out: dict[str, ItemList] = {}
    for c in layout.components:
        t = c.type
        if t in (StateType.KV, StateType.MLA, StateType.NSA):
            out[c.name] = ItemList(items=suffix_pages(row, prefix, n, tables.page_size))
        elif t in (StateType.SWA, StateType.DSV4_SWA):
            sps = tables.swa_page_size or tables.page_size
            pages = swa_window_pages(row, n, window, sps, prefix, tables.full_to_swa)
            pos = compress_state_positions(n, 4) if t is StateType.DSV4_SWA else None
            out[c.name] = ItemList(items=pages, positions=pos)
        elif t in (StateType.MAMBA, StateType.SHORT_CONV):
            out[c.name] = ItemList(items=mamba_slot(req.slot))
        elif t is StateType.DSV4_REQUEST:
            out[c.name] = ItemList(items=slot if n % 128 else slot[:0])
        elif t is StateType.AUX:
            out[c.name] = ItemList(items=np.array([req.aux_row], dtype=np.int64))
        elif t is StateType.REQUEST_ROW:
            out[c.name] = ItemList(items=slot)
        else:
            raise ValueError(f"component {c.name!r}: the engine has no list for {t.value}")
    return out
