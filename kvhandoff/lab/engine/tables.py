"""Page tables of one engine instance: which pages, SWA pages and slot a request holds.

Every TP rank of an instance shares these tables (one scheduler decides, every rank's
pools follow), so page ids and slots are rank-independent, as in sglang.

* Full pages hold ``page_size`` token positions each; a request's ``pages[i]`` holds
  positions ``[i*page_size, (i+1)*page_size)``. Token slot of position ``p`` is
  ``pages[p // page_size] * page_size + p % page_size``.
* The sliding-window pool has its own pages of ``swa_page_size`` tokens, allocated in
  lock-step with the positions they hold (one *group* per SWA page) and recorded in the
  instance-wide ``full_to_swa`` token mapping, exactly what
  :func:`kvhandoff.indices.swa_window_pages` translates through. Groups that fall out of
  the window are evicted (their SWA page freed, mapping reset to -1).
* One request slot per request indexes every per-request pool (Mamba state, request
  rows, request-scoped compression state); its aux row is leased apart, from the
  library's one aux-row pool (:class:`~kvhandoff.integrations.AuxRows`), as sglang leases
  a metadata-buffer row apart from the request slot.

A request's first ``borrowed`` pages may belong to the decode prefix cache; releasing
the request never frees those.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvhandoff.integrations import AuxRows
from kvhandoff.lab.engine.alloc import AllocatorError, FreeList, IdArray

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class ReqTable:
    """One request's entries in the instance tables."""

    slot: int
    aux_row: int = 0
    pages: IdArray = field(default_factory=lambda: _EMPTY.copy())
    borrowed: int = 0  # leading pages owned by the prefix cache
    swa_groups: IdArray = field(default_factory=lambda: _EMPTY.copy())  # -1: none

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class Tables:
    """Allocators and mappings of one instance (prefill or decode)."""

    def __init__(
        self, *, page_size: int, num_pages: int, num_slots: int,
        swa_page_size: int | None = None, num_swa_pages: int = 0, seed: int = 0,
    ) -> None:
        self.page_size = page_size
        self.pages = FreeList("pages", num_pages, seed=seed)
        self.slots = FreeList("slots", num_slots, seed=seed + 1)
        self.aux = AuxRows(num_slots)
        self.swa_page_size = swa_page_size
        self.swa = (FreeList("swa pages", num_swa_pages, seed=seed + 2)
                    if swa_page_size else None)
        self.full_to_swa = np.full(num_pages * page_size, -1, dtype=np.int64)

    # -- lifecycle -----------------------------------------------------------------------
    def new_request(self, prefix_pages: IdArray | None = None) -> ReqTable:
        """A request with its slot, starting on ``prefix_pages`` (borrowed, not owned)."""
        pages = _EMPTY.copy() if prefix_pages is None else np.asarray(prefix_pages, np.int64)
        slot = int(self.slots.alloc(1)[0])
        row = self.aux.take()
        if row is None:
            self.slots.free([slot])
            raise AllocatorError(f"aux rows: all {self.aux.num_rows} are leased")
        return ReqTable(slot=slot, aux_row=row, pages=pages.copy(), borrowed=len(pages))

    def extend(self, req: ReqTable, num_tokens: int) -> None:
        """Own enough pages for positions ``[0, num_tokens)``."""
        need = -(-num_tokens // self.page_size) - req.num_pages
        if need > 0:
            req.pages = np.concatenate([req.pages, self.pages.alloc(need)])

    def release(self, req: ReqTable, *, keep: IdArray | None = None) -> None:
        """Free everything ``req`` owns except the pages in ``keep`` (taken over by the
        prefix cache); borrowed pages are never freed. The table is emptied."""
        self.evict_swa(req, 1 << 62)
        owned = req.pages[req.borrowed:]
        if keep is not None and len(keep):
            owned = owned[~np.isin(owned, keep)]
        self.pages.free(owned)
        self.slots.free([req.slot])
        self.aux.give(req.aux_row)
        req.pages, req.borrowed, req.slot = _EMPTY.copy(), 0, 0

    def leaks(self) -> dict[str, int]:
        """Ids still allocated, per pool (all zero when every request was released)."""
        out = {"pages": self.pages.num_used, "slots": self.slots.num_used,
               "aux rows": self.aux.in_use}
        if self.swa is not None:
            out["swa pages"] = self.swa.num_used
        return out

    # -- addressing ----------------------------------------------------------------------
    def token_slots(self, req: ReqTable, start: int, stop: int) -> IdArray:
        """Full-pool token slots of positions ``[start, stop)``."""
        pos = np.arange(start, stop, dtype=np.int64)
        out: IdArray = req.pages[pos // self.page_size] * self.page_size + pos % self.page_size
        return out

    def slots_of(self, req: ReqTable, positions: IdArray) -> IdArray:
        """Full-pool token slots of arbitrary ``positions``."""
        pos = np.asarray(positions, dtype=np.int64)
        out: IdArray = req.pages[pos // self.page_size] * self.page_size + pos % self.page_size
        return out

    def row_slots(self, req: ReqTable) -> IdArray:
        """The request's whole row of the token→slot table (every position its pages hold)."""
        return self.token_slots(req, 0, req.num_pages * self.page_size)

    def swa_slots(self, positions: IdArray, req: ReqTable) -> IdArray:
        """SWA-pool token slots of ``positions`` (-1 where none is mapped)."""
        out: IdArray = self.full_to_swa[self.slots_of(req, positions)]
        return out

    # -- sliding-window pool -------------------------------------------------------------
    def map_swa(self, req: ReqTable, start: int, stop: int) -> None:
        """Give every SWA group touching positions ``[start, stop)`` an SWA page."""
        if self.swa is None or stop <= start:
            return
        sps = self._sps
        lo, hi = start // sps, -(-stop // sps)
        if len(req.swa_groups) < hi:
            req.swa_groups = np.concatenate(
                [req.swa_groups, np.full(hi - len(req.swa_groups), -1, dtype=np.int64)])
        groups = np.arange(lo, hi, dtype=np.int64)
        new = groups[req.swa_groups[groups] < 0]
        if not len(new):
            return
        swa_pages = self.swa.alloc(len(new))
        req.swa_groups[new] = swa_pages
        pos = (new[:, None] * sps + np.arange(sps)).ravel()
        full = req.pages[pos // self.page_size] * self.page_size + pos % self.page_size
        self.full_to_swa[full] = np.repeat(swa_pages, sps) * sps + pos % sps

    def evict_swa(self, req: ReqTable, before: int) -> None:
        """Free the SWA groups that lie wholly below position ``before``."""
        if self.swa is None or not len(req.swa_groups):
            return
        sps = self._sps
        upto = min(max(before, 0) // sps, len(req.swa_groups))
        groups = np.flatnonzero(req.swa_groups[:upto] >= 0)
        if not len(groups):
            return
        pos = (groups[:, None] * sps + np.arange(sps)).ravel()
        full = req.pages[pos // self.page_size] * self.page_size + pos % self.page_size
        self.full_to_swa[full] = -1
        self.swa.free(req.swa_groups[groups])
        req.swa_groups[groups] = -1

    @property
    def _sps(self) -> int:
        assert self.swa_page_size is not None
        return self.swa_page_size
