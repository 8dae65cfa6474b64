"""Chunked prefill: which destination pages each KV chunk fills. Pure.

The prefill engine hands its KV pages to ``Sender.send`` in sequence order, starting at
token 0, chunk by chunk. Decode's KV list covers only the tokens it lacks,
``[decode_prefix_len, seq_len)``. A :class:`KvCursor` (one per decode rank) pairs each
chunk with its slice of decode's list:

* **Page path** (equal page sizes, decode list starting at row 0): chunk page ``g``
  (counting from token 0) fills decode page ``g - decode_prefix_len / page_size``;
  pages below the prefix are dropped. Whole pages move, the last one possibly partial.
* **Row path** (page sizes differ): the cursor works in token rows, so it needs the
  request's token count (``Sender.init(num_tokens=...)``). Tokens
  ``[max(prefix, chunk start), chunk end)`` move; the planner re-pages them.

Counts are checked when both sides are known (:meth:`KvCursor.problem`), so a request
whose page counts disagree fails at bootstrap with both numbers, never mid-transfer.

:func:`chunk_request` is a chunk's whole planner request for one decode rank (the KV
slice, plus the aux row and the state components with the last chunk);
:func:`state_lists` checks what the engine gave for those state components.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kvhandoff.layout import Layout
from kvhandoff.plan.request import IndexArray, Indices, as_indices, index_range
from kvhandoff.protocol import IndexListMsg

StateLists = dict[str, tuple[IndexArray, int] | None]
"""The last chunk's state components: per name, ``(source items, first row)`` or None."""


@dataclass(frozen=True, slots=True)
class SourceList:
    """A prefill-side index list with a first token row (for re-paged TOKEN tensors)."""

    items: object
    first_row: int = 0


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class KvCursor:
    """Maps KV chunks onto one decode rank's KV destination list.

    Not thread-safe: its Sender calls it under the request's lock.
    """

    def __init__(self, *, component: str, dst_items: IndexArray, dst_first_row: int,
                 src_page: int, dst_page: int, prefix_len: int, num_pages: int,
                 num_tokens: int | None, repageable: bool) -> None:
        self.component = component
        self.dst = dst_items
        self.fr0 = dst_first_row
        self.ps, self.pd = src_page, dst_page
        self.prefix = prefix_len
        self.num_pages = num_pages
        self.num_tokens = num_tokens
        self.repageable = repageable
        self.by_rows = src_page != dst_page or dst_first_row != 0
        self.seen = 0  # pages handed to next() so far

    def _why_rows(self) -> str:
        """Why this chunking moves token rows: page sizes differ, or decode's list starts
        mid-page (its ``first_row``)."""
        if self.ps != self.pd:
            return f"page sizes differ (prefill {self.ps}, decode {self.pd})"
        return (f"decode's index list starts at token row {self.fr0} (its first_row), not "
                f"at a page boundary")

    def problem(self) -> str | None:
        """Why this chunking cannot work (page counts, prefix alignment), or None."""
        c, n = self.component, len(self.dst)
        if self.by_rows:
            why = self._why_rows()
            if not self.repageable:
                return (f"component {c!r}: {why}, and some of its tensors cannot be re-paged "
                        f"by token rows; " + ("run both sides with the same page size"
                                              if self.ps != self.pd else
                                              "decode must start at row 0 of a page"))
            if self.num_tokens is None:
                return (f"component {c!r}: {why}, so Sender.init needs num_tokens to move "
                        f"token rows")
            if self.prefix > self.num_tokens:
                return (f"decode prefix of {self.prefix} tokens exceeds the request's "
                        f"{self.num_tokens} tokens")
            if _ceil(self.num_tokens, self.ps) != self.num_pages:
                return (f"component {c!r}: {self.num_tokens} tokens need "
                        f"{_ceil(self.num_tokens, self.ps)} pages of {self.ps}, Sender.init "
                        f"announced {self.num_pages}")
            need = self.fr0 + self.num_tokens - self.prefix
            if n * self.pd < need:
                return (f"component {c!r}: decode gave {n} pages of {self.pd} tokens from row "
                        f"{self.fr0}, too few for the {self.num_tokens - self.prefix} tokens "
                        f"past its prefix of {self.prefix}")
            return None
        if self.prefix % self.ps:
            return (f"decode prefix of {self.prefix} tokens is not a whole number of "
                    f"{self.ps}-token pages")
        if self.num_tokens is not None and _ceil(self.num_tokens, self.ps) != self.num_pages:
            return (f"component {c!r}: {self.num_tokens} tokens need "
                    f"{_ceil(self.num_tokens, self.ps)} pages of {self.ps}, Sender.init "
                    f"announced {self.num_pages}")
        skip = self.prefix // self.ps
        if self.num_pages - skip != n:
            return (f"component {c!r}: prefill sends {self.num_pages} pages of which "
                    f"{min(skip, self.num_pages)} are inside decode's prefix of {self.prefix} "
                    f"tokens, leaving {max(0, self.num_pages - skip)}; decode allocated {n}")
        return None

    def next(self, pages: IndexArray, last: bool) -> Indices:
        """The planner indices of the next chunk. Raises ``ValueError`` when the chunk
        overruns the announced page count, or the last chunk falls short of it."""
        g0, g1 = self.seen, self.seen + len(pages)
        if g1 > self.num_pages:
            raise ValueError(f"component {self.component!r}: chunks now hold {g1} pages, more "
                             f"than the {self.num_pages} Sender.init announced")
        if last and g1 != self.num_pages:
            raise ValueError(f"component {self.component!r}: the last chunk ends at page {g1}, "
                             f"Sender.init announced {self.num_pages}")
        self.seen = g1
        if not self.by_rows:
            skip = self.prefix // self.ps
            cut = min(max(skip - g0, 0), len(pages))
            lo = g0 + cut - skip
            return Indices(pages[cut:], self.dst[lo:g1 - skip])
        assert self.num_tokens is not None  # problem() said so
        t0 = max(self.prefix, g0 * self.ps)
        t1 = min(g1 * self.ps, self.num_tokens)
        if t1 <= t0:
            empty = np.zeros(0, np.int64)
            return Indices(empty, empty)
        src = pages[t0 // self.ps - g0:_ceil(t1, self.ps) - g0]
        a = t0 - self.prefix + self.fr0
        b = t1 - self.prefix + self.fr0
        return Indices(src, self.dst[a // self.pd:_ceil(b, self.pd)],
                       src_first_row=t0 % self.ps, dst_first_row=a % self.pd,
                       num_rows=t1 - t0)


def chunk_request(layout: Layout, dst: Mapping[str, IndexListMsg | None], *,
                  kv: Indices | None, kv_name: str | None, aux_name: str | None,
                  aux_src: IndexArray | None, state: StateLists | None, last: bool
                  ) -> dict[str, Indices | None]:
    """The planner request of one chunk for one decode rank: ``kv`` (its cursor's slice,
    None without a cursor), and with the last chunk the aux row (``aux_src``, as a
    one-item list) and every state component. ``ValueError`` when the two sides disagree
    whether a component moves."""
    req: dict[str, Indices | None] = {}
    for c in layout.components:
        d = dst.get(c.name)
        if c.name == kv_name:
            if kv is not None or d is None:
                req[c.name] = kv
        elif c.name == aux_name:
            req[c.name] = None if (d is None or not last) else Indices(aux_src, d.array())
        elif not last:
            req[c.name] = None
        else:
            assert state is not None
            req[c.name] = _state_request(c.name, state.get(c.name), d)
    return req


def _state_request(name: str, src: tuple[IndexArray, int] | None,
                   dst: IndexListMsg | None) -> Indices | None:
    if (src is None) != (dst is None):
        have = "no list" if src is None else f"{len(src[0])} items"
        want = "no list" if dst is None else f"{dst.num_items} items"
        raise ValueError(f"component {name!r}: prefill sends {have}, decode "
                         f"expects {want}; both sides must agree whether it moves")
    if src is None or dst is None:
        return None
    return Indices(src[0], dst.array(), src_first_row=src[1], dst_first_row=dst.first_row,
                   num_rows=dst.num_rows, positions=dst.positions_array())


def state_lists(layout: Layout, names: tuple[str, ...],
                state: Mapping[str, object | None] | None, last: bool) -> StateLists | None:
    """Check and normalise what ``Sender.send`` was given for the state components:
    nothing before the last chunk, every one of ``names`` exactly with it (``ValueError``
    otherwise, naming what is unknown or missing)."""
    if not last:
        if state:
            raise ValueError("state components travel with the last chunk only")
        return None
    given = dict(state or {})
    unknown, missing = set(given) - set(names), set(names) - set(given)
    if unknown or missing:
        raise ValueError(f"the last chunk must name every state component exactly: "
                         f"unknown {sorted(unknown)}, missing {sorted(missing)} "
                         f"(use None for one that does not move)")
    out = {n: None if v is None else source_indices(v, f"state {n!r}")
           for n, v in given.items()}
    for n, v in out.items():
        if v is not None:
            check_items(layout, n, v[0], "prefill")
    return out


def source_indices(value: object, what: str) -> tuple[IndexArray, int]:
    """``(items, first_row)`` of a prefill state list (an array-like or a SourceList)."""
    if isinstance(value, SourceList):
        if value.first_row < 0:
            raise ValueError(f"{what}: first_row must be >= 0, got {value.first_row}")
        return as_indices(value.items, what), value.first_row
    return as_indices(value, what), 0


def check_items(layout: Layout, name: str, items: IndexArray, side: str) -> None:
    """Raise ``ValueError`` unless every item index of component ``name`` is inside every
    one of its tensors here: an engine bug caught at the call, not mid-request."""
    if not len(items):
        return
    lo, hi = index_range(items)
    cap = _capacity(layout, name)
    if lo < 0 or (cap is not None and hi >= cap):
        bad = lo if lo < 0 else hi
        raise ValueError(f"component {name!r}: {side} index {bad} is outside its tensors "
                         f"({cap or 0} items)")


@functools.lru_cache(maxsize=1024)
def _capacity(layout: Layout, name: str) -> int | None:
    """The fewest items any live tensor of component ``name`` holds (None: no tensor)."""
    caps = [t.capacity for t in layout.component(name).tensors if not t.elided]
    return min(caps) if caps else None
