"""Index helpers an engine calls to turn its own page tables into planner index lists.

Each side of a handoff computes its index lists from its **own** tables (its request
row, its page size, its slots); the lists are then paired position by position by the
planner (:class:`kvhandoff.plan.Indices`). These helpers encode the arithmetic that both
sides must get exactly right:

* token slots → page ids (:func:`pages_from_slots`), with the page-major contiguity the
  conversion relies on checked rather than assumed;
* how many tokens have KV at the last prefill chunk (:func:`prefill_seq_len`): never the
  sampled token, or a page-aligned prompt grows a phantom page (SGLang #27004);
* the suffix past a decode-side prefix hit (:func:`suffix_pages`), the sliding window
  (:func:`swa_window_start`, :func:`swa_window_pages`), ring rows
  (:func:`ring_positions`, :func:`ring_rows`), the Mamba slot (:func:`mamba_slot`),
  DeepSeek-V4 request-scoped compression state (:func:`dsv4_request_state_rows`), the DSA
  tail ring (:func:`dsa_tail_segments`) and chunked-prefill page slices
  (:func:`chunk_pages`).

Contract shared by every function: inputs are never written (arrays are read, and every
returned array is a fresh int64 array that aliases no input); the work is vectorised
numpy; bad input raises :class:`kvhandoff.errors.PlanError` with a message naming the
offending values.
"""

from __future__ import annotations

import operator
from typing import NamedTuple, SupportsIndex

import numpy as np
import numpy.typing as npt

from kvhandoff.errors import PlanError

IndexArray = npt.NDArray[np.int64]

__all__ = [
    "ChunkPages",
    "IndexArray",
    "chunk_pages",
    "compress_state_positions",
    "dsa_tail_segments",
    "dsv4_compress_ring_size",
    "dsv4_ratio2_state_rows",
    "dsv4_request_state_rows",
    "mamba_slot",
    "num_pages",
    "pages_from_slots",
    "prefill_seq_len",
    "ring_positions",
    "ring_rows",
    "suffix_pages",
    "swa_window_pages",
    "swa_window_start",
    "token_pages",
]


# ---------------------------------------------------------------------------------------
# validation helpers


def _int(name: str, value: object, *, minimum: int = 0) -> int:
    """``value`` as a Python int >= ``minimum`` (bools and non-integers are refused)."""
    if isinstance(value, bool | np.bool_):
        raise PlanError(f"{name} must be an integer, got the bool {value!r}")
    if not isinstance(value, SupportsIndex):
        raise PlanError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    try:
        out = operator.index(value)
    except TypeError:
        raise PlanError(
            f"{name} must be an integer, got {value!r} ({type(value).__name__})"
        ) from None
    if out < minimum:
        raise PlanError(f"{name} must be >= {minimum}, got {out}")
    return out


def _array(name: str, values: npt.ArrayLike) -> IndexArray:
    """A 1-D int64 array of non-negative indices read from ``values`` (always a new array)."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise PlanError(f"{name} must be a 1-D index list, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise PlanError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.size and np.issubdtype(arr.dtype, np.unsignedinteger) and (
        int(arr.max()) > np.iinfo(np.int64).max
    ):
        raise PlanError(f"{name} holds {int(arr.max())}, beyond the int64 range")
    out: IndexArray = arr.astype(np.int64, copy=True)
    if out.size and int(out.min()) < 0:
        bad = int(np.flatnonzero(out < 0)[0])
        raise PlanError(f"{name}[{bad}] is {int(out[bad])}; indices must be >= 0")
    return out


def _floor(n: int, page_size: int) -> int:
    return n - n % page_size


def _span(name: str, row: IndexArray, start: int, stop: int) -> None:
    """``row`` must hold positions ``[start, stop)`` with ``start <= stop``."""
    if start > stop:
        raise PlanError(f"{name}: start {start} is past end {stop}")
    if stop > len(row):
        raise PlanError(
            f"{name}: needs token positions up to {stop} but the request row holds only "
            f"{len(row)} slots"
        )


def _to_pages(slots: IndexArray, page_size: int, what: str) -> IndexArray:
    """Page ids of a validated, non-negative int64 slot array (see pages_from_slots)."""
    n = len(slots)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    firsts = slots[::page_size]
    misaligned = np.flatnonzero(firsts % page_size)
    if misaligned.size:
        i = int(misaligned[0]) * page_size
        raise PlanError(
            f"{what}: position {i} starts a page but holds slot {int(slots[i])}, which is "
            f"not a multiple of page_size {page_size} (the list must start at a page "
            f"boundary and keep each page's tokens together)"
        )
    offsets = np.arange(n, dtype=np.int64)
    expected = np.repeat(firsts, page_size)[:n] + offsets % page_size
    wrong = np.flatnonzero(slots != expected)
    if wrong.size:
        i = int(wrong[0])
        raise PlanError(
            f"{what}: not page-major contiguous at position {i}: slot {int(slots[i])}, "
            f"expected {int(expected[i])} (page_size {page_size}, page starting at slot "
            f"{int(expected[i - i % page_size])})"
        )
    pages: IndexArray = firsts // page_size
    if len(pages) > 1:
        uniq, counts = np.unique(pages, return_counts=True)
        if len(uniq) != len(pages):
            dup = uniq[counts > 1][:5].tolist()
            raise PlanError(f"{what}: page(s) {dup} appear more than once")
    return pages


# ---------------------------------------------------------------------------------------
# pages and lengths


def pages_from_slots(slots: npt.ArrayLike, page_size: int) -> IndexArray:
    """Page ids of a token-slot list: ``slots[::page_size] // page_size``.

    Contract: ``slots`` is 1-D, integer, non-negative, starts at a page boundary and is
    page-major contiguous (the tokens at positions ``k*page_size .. k*page_size+page_size-1``
    are consecutive slots of one page, beginning at that page's first slot); only the last
    page may be partial. No page may appear twice. The conversion's assumptions are checked
    (vectorised), not trusted: a violation raises ``PlanError`` naming the first bad
    position and slot. Returns a new int64 array, one entry per (possibly partial) page.
    """
    page = _int("page_size", page_size, minimum=1)
    return _to_pages(_array("slots", slots), page, "slots")


def num_pages(num_tokens: int, page_size: int) -> int:
    """Pages needed for ``num_tokens`` tokens: ``ceil(num_tokens / page_size)``.

    Contract: ``num_tokens >= 0``, ``page_size >= 1``; otherwise ``PlanError``.
    """
    n = _int("num_tokens", num_tokens)
    page = _int("page_size", page_size, minimum=1)
    return -(-n // page)


def prefill_seq_len(prompt_len: int, extend_end: int) -> int:
    """Tokens whose KV exists on prefill at the last chunk: ``min(extend_end, prompt_len)``.

    Contract: the result never counts the token sampled at the end of prefill (its KV is
    not written yet). Counting it (``len(fill_ids)``) adds a phantom page whenever the
    prompt is page-aligned, so prefill's lists outgrow decode's (SGLang #27004). Both
    arguments must be >= 0.
    """
    p = _int("prompt_len", prompt_len)
    e = _int("extend_end", extend_end)
    return min(e, p)


def suffix_pages(
    token_slots: npt.ArrayLike, prefix_len: int, seq_len: int, page_size: int
) -> IndexArray:
    """Pages holding token positions ``[prefix_len, seq_len)`` of one request.

    ``token_slots`` is the request's row of the token→slot table (it may be longer than
    ``seq_len``). Contract: ``0 <= prefix_len <= seq_len <= len(token_slots)`` and
    ``prefix_len`` is a multiple of ``page_size`` (a decode prefix hit is page-aligned);
    the slots of that span must satisfy :func:`pages_from_slots`. ``prefix_len=0`` gives
    all pages (QSA compressed-K, dense KV, block scales).
    """
    page = _int("page_size", page_size, minimum=1)
    start = _int("prefix_len", prefix_len)
    stop = _int("seq_len", seq_len)
    row = _array("token_slots", token_slots)
    _span("suffix_pages", row, start, stop)
    if start % page:
        raise PlanError(
            f"suffix_pages: prefix_len {start} is not a multiple of page_size {page}"
        )
    return _to_pages(row[start:stop], page, f"token_slots[{start}:{stop}]")


# ---------------------------------------------------------------------------------------
# sliding window


def swa_window_start(
    seq_len: int, window: int, page_size: int, decode_prefix_len: int = 0
) -> int:
    """First token position of the sliding window that moves, floored to a page.

    ``floor_to_page(max(decode_prefix_len, seq_len - window, 0))``. Positions below
    ``decode_prefix_len`` are already on decode (its prefix hit) and are not sent; the
    page floor makes the span page-aligned so it converts to whole pages (full and SWA
    pages are allocated in lock-step). Contract: ``window >= 1``, ``page_size >= 1``,
    ``0 <= decode_prefix_len <= seq_len``.
    """
    n = _int("seq_len", seq_len)
    w = _int("window", window, minimum=1)
    page = _int("page_size", page_size, minimum=1)
    prefix = _int("decode_prefix_len", decode_prefix_len)
    if prefix > n:
        raise PlanError(f"decode_prefix_len {prefix} is past seq_len {n}")
    return _floor(max(prefix, n - w, 0), page)


def token_pages(start: int, end: int, page_size: int, *, window: int = 0) -> range:
    """Positions in a request's page list of the pages holding tokens ``[start, end)``:
    ``range(start // page_size, ceil(end / page_size))``. With a sliding ``window`` only
    the window moves: the span starts at :func:`swa_window_start` (``start`` then being
    the decode prefix). Both sides of a handoff pick their pages by the same token range,
    so their lists pair one for one.

    Contract: ``0 <= start <= end``, ``page_size >= 1``, ``window >= 0``; otherwise
    ``PlanError``.
    """
    page = _int("page_size", page_size, minimum=1)
    first = _int("start", start)
    stop = _int("end", end)
    if first > stop:
        raise PlanError(f"token_pages: start {first} is past end {stop}")
    if _int("window", window):
        first = swa_window_start(stop, window, page, first)
    if first == stop:  # no token: no page, even mid-page
        return range(first // page, first // page)
    return range(first // page, num_pages(stop, page))


def swa_window_pages(
    token_slots: npt.ArrayLike,
    seq_len: int,
    window: int,
    page_size: int,
    decode_prefix_len: int = 0,
    full_to_swa: npt.ArrayLike | None = None,
) -> IndexArray:
    """SWA page ids of the window ``[swa_window_start(...), seq_len)`` of one request.

    ``token_slots`` is the request's row of the (full-pool) token→slot table. When
    ``full_to_swa`` is given, each full slot ``s`` is first translated to the SWA slot
    ``full_to_swa[s]`` (the allocator's full→SWA mapping); every looked-up entry must be a
    valid (non-negative) SWA slot. The (translated) slots must then satisfy
    :func:`pages_from_slots`. The result has ``ceil((seq_len - start) / page_size)``
    entries on both sides of a handoff as long as both agree on ``seq_len``, ``window`` and
    the prefix. Contract as :func:`swa_window_start`, plus ``seq_len <= len(token_slots)``.
    """
    page = _int("page_size", page_size, minimum=1)
    start = swa_window_start(seq_len, window, page, decode_prefix_len)
    stop = _int("seq_len", seq_len)
    row = _array("token_slots", token_slots)
    _span("swa_window_pages", row, start, stop)
    slots = row[start:stop]
    what = f"token_slots[{start}:{stop}]"
    if full_to_swa is not None:
        mapping = np.asarray(full_to_swa)
        if mapping.ndim != 1 or (mapping.size and not np.issubdtype(mapping.dtype, np.integer)):
            raise PlanError(
                f"full_to_swa must be a 1-D integer array, got shape {mapping.shape} "
                f"dtype {mapping.dtype}"
            )
        if slots.size and int(slots.max()) >= len(mapping):
            bad = int(np.flatnonzero(slots >= len(mapping))[0])
            raise PlanError(
                f"full slot {int(slots[bad])} (token position {start + bad}) is outside "
                f"full_to_swa of length {len(mapping)}"
            )
        swa = mapping[slots].astype(np.int64)
        if swa.size and int(swa.min()) < 0:
            bad = int(np.flatnonzero(swa < 0)[0])
            raise PlanError(
                f"full slot {int(slots[bad])} (token position {start + bad}) maps to SWA "
                f"slot {int(swa[bad])}: it has no SWA slot"
            )
        slots, what = swa, f"full_to_swa[{what}]"
    return _to_pages(slots, page, what)


# ---------------------------------------------------------------------------------------
# rings and slots


def ring_positions(seq_len: int, window: int) -> IndexArray:
    """The last ``window`` logical positions: ``arange(max(0, seq_len - window), seq_len)``.

    Used for ring-buffered state (DSv4 unified SWA ring): not page-aligned and not bounded
    by a decode prefix. Contract: ``seq_len >= 0``, ``window >= 0``.
    """
    n = _int("seq_len", seq_len)
    w = _int("window", window)
    return np.arange(max(0, n - w), n, dtype=np.int64)


def ring_rows(slot: int, positions: npt.ArrayLike, ring_size: int) -> IndexArray:
    """Ring rows of logical ``positions`` in request ``slot``'s ring: ``slot*ring + pos % ring``.

    Contract: ``slot >= 0``, ``ring_size >= 1``, ``positions`` 1-D non-negative integers
    that fall on distinct rows (no two positions congruent mod ``ring_size``: a ring row
    holds one position; a list spanning more than the ring would copy overwritten rows).
    """
    s = _int("slot", slot)
    ring = _int("ring_size", ring_size, minimum=1)
    pos = _array("positions", positions)
    offs = pos % ring
    if len(offs) > ring or len(np.unique(offs)) != len(offs):
        raise PlanError(
            f"ring_rows: {len(pos)} positions (from {int(pos.min())} to {int(pos.max())}) "
            f"collide in a ring of {ring} rows; at most one position per row"
        )
    out: IndexArray = s * ring + offs
    return out


def mamba_slot(slot: npt.ArrayLike) -> IndexArray:
    """The one-element int64 index list ``[slot]`` of a request's Mamba (recurrent) state.

    Accepts a Python/numpy integer or a one-element integer array (e.g. a mapping lookup
    moved to host). Contract: exactly one non-negative integer; otherwise ``PlanError``.
    """
    arr = np.asarray(slot)
    if arr.size != 1 or arr.ndim > 1:
        raise PlanError(f"mamba slot must be a single index, got shape {arr.shape}")
    if isinstance(slot, bool | np.bool_) or not np.issubdtype(arr.dtype, np.integer):
        raise PlanError(f"mamba slot must be an integer, got {slot!r} (dtype {arr.dtype})")
    return _array("mamba slot", arr.reshape(1))


def compress_state_positions(seq_len: int, ratio: int) -> IndexArray:
    """Logical positions a ratio-``ratio`` compressor's state still needs after ``seq_len``.

    ``arange(max(0, seq_len - (seq_len % ratio + ratio)), seq_len)``: the pending
    (not yet compressed) tokens plus one full group. Pair them with :func:`ring_rows` (or
    pass them as ``Indices.positions``) so rings of different sizes (e.g. C4 rings of 8
    and 16 under speculative decoding) interoperate by logical position. Contract:
    ``seq_len >= 0``, ``ratio >= 1``.
    """
    n = _int("seq_len", seq_len)
    r = _int("ratio", ratio, minimum=1)
    return np.arange(max(0, n - (n % r + r)), n, dtype=np.int64)


def dsv4_compress_ring_size(ratio: int, *, num_draft_tokens: int = 0, online: bool = False) -> int:
    """DeepSeek-V4 compress-state ring size for a compression ratio.

    =================  ========  =============================================
    ratio              no spec   speculative (``num_draft_tokens > 0``)
    =================  ========  =============================================
    4 (C4)             8         16
    128, offline       128       256
    128, online        1         1
    2                  2         ``1 << (num_draft_tokens + 1).bit_length()``
    =================  ========  =============================================

    Contract: ``ratio`` is one of 2, 4, 128 (``online`` only with 128); anything else
    raises ``PlanError``. Prefill and decode can differ (speculation doubles rings), which
    is why ring state pairs rows by logical position.
    """
    r = _int("ratio", ratio, minimum=1)
    d = _int("num_draft_tokens", num_draft_tokens)
    if online and r != 128:
        raise PlanError(f"online compression exists only for ratio 128, got ratio {r}")
    if r == 128:
        return 1 if online else (256 if d else 128)
    if r == 4:
        return 16 if d else 8
    if r == 2:
        return 1 << (d + 1).bit_length() if d else 2
    raise PlanError(f"no DeepSeek-V4 compress-state ring for ratio {r} (known: 2, 4, 128)")


def dsv4_ratio2_state_rows(slot: int, seq_len: int) -> IndexArray:
    """DeepSeek-V4(.1) ratio-2 pending-pair state: ``[slot]`` if ``seq_len`` is odd, else ``[]``.

    One item is a request's whole ring, so the index is the request slot. An even length
    leaves nothing pending. Contract: ``slot >= 0``, ``seq_len >= 0``.
    """
    s = _int("slot", slot)
    n = _int("seq_len", seq_len)
    return np.array([s] if n % 2 else [], dtype=np.int64)


def dsv4_request_state_rows(
    slot: int, seq_len: int, ratio: int, ring: int, online: bool
) -> IndexArray:
    """Items of DeepSeek-V4 request-scoped compression state pending after ``seq_len`` tokens.

    * ``seq_len == 0`` or ``seq_len % ratio == 0`` → ``[]`` (nothing pending);
    * ``online`` (C128 online: one max/sum/kv row per request) → ``[slot]``;
    * offline (one item = ``ratio`` raw rows; a request owns ``ring // ratio`` items) →
      ``[slot * (ring // ratio) + ((seq_len - 1) % ring) // ratio]``;
    * ``ratio == 2`` → :func:`dsv4_ratio2_state_rows` (one item is the whole ring).

    ``seq_len`` is the prompt length (prefill's ``c128_seq_len``). Contract: ``slot >= 0``,
    ``seq_len >= 0``, ``ratio >= 1``, ``ring >= 1``; offline needs ``ring`` a positive
    multiple of ``ratio``.
    """
    s = _int("slot", slot)
    n = _int("seq_len", seq_len)
    r = _int("ratio", ratio, minimum=1)
    g = _int("ring", ring, minimum=1)
    if r == 2 and not online:
        return dsv4_ratio2_state_rows(s, n)
    if n == 0 or n % r == 0:
        return np.empty(0, dtype=np.int64)
    if online:
        return np.array([s], dtype=np.int64)
    if g % r:
        raise PlanError(f"offline request state: ring {g} is not a multiple of ratio {r}")
    return np.array([s * (g // r) + ((n - 1) % g) // r], dtype=np.int64)


def dsa_tail_segments(row: int, seq_len: int, pool_size: int, tail: int) -> IndexArray:
    """The DSA kpool-compress tail ring's live slots as ``[row, start, first, 0, second, tail]``.

    The ``n = seq_len % pool_size`` tokens not yet compressed live at ring slots
    ``(seq_len - n + i) % tail``: ``first`` slots from ``start`` then ``second`` slots
    from 0 (``start = (seq_len - n) % tail``, ``first = min(n, tail - start)``,
    ``second = n - first``). Returns ``[]`` when nothing is pending. Contract:
    ``row >= 0``, ``seq_len >= 0``, ``pool_size >= 2``, ``tail >= pool_size``.
    """
    r = _int("row", row)
    n = _int("seq_len", seq_len)
    pool = _int("pool_size", pool_size, minimum=2)
    t = _int("tail", tail, minimum=1)
    if t < pool:
        raise PlanError(f"DSA tail ring of {t} slots is smaller than pool_size {pool}")
    valid = n % pool
    if valid == 0:
        return np.empty(0, dtype=np.int64)
    start = (n - valid) % t
    first = min(valid, t - start)
    return np.array([r, start, first, 0, valid - first, t], dtype=np.int64)


# ---------------------------------------------------------------------------------------
# chunked prefill


class ChunkPages(NamedTuple):
    """One KV chunk: its pages, where they sit in the request's page list, its token end."""

    pages: IndexArray
    """Page ids the chunk sends (a new array)."""
    page_slice: slice
    """Positions of ``pages`` in the request's page list (the reference's ``index_slice``)."""
    end: int
    """Token position the chunk actually reaches: the next chunk starts here."""


def chunk_pages(
    pages: npt.ArrayLike,
    start: int,
    end: int,
    page_size: int,
    *,
    last: bool,
    base: int = 0,
) -> ChunkPages:
    """The pages of a chunked-prefill send covering token positions ``[start, end)``.

    ``pages`` is the request's page list for token positions ``[base, ...)`` (``base`` is
    the decode prefix length, page-aligned). A non-last chunk's ``end`` is snapped down to a
    page boundary (``end -= end % page_size``): its partial page is sent by a later chunk,
    once complete. The last chunk keeps ``end`` and includes its partial page. The result's
    ``end`` is where the next chunk must start. Contract: ``base`` and ``start`` are
    multiples of ``page_size``; ``base <= start <= end``; ``pages`` covers ``end``
    (``end <= base + len(pages) * page_size``). A chunk may be empty (a last chunk after a
    full prefix hit still carries state).
    """
    page = _int("page_size", page_size, minimum=1)
    lo = _int("start", start)
    hi = _int("end", end)
    b = _int("base", base)
    plist = _array("pages", pages)
    if b % page or lo % page:
        raise PlanError(
            f"chunk_pages: base {b} and start {lo} must be multiples of page_size {page}"
        )
    if not b <= lo <= hi:
        raise PlanError(f"chunk_pages: need base {b} <= start {lo} <= end {hi}")
    if hi > b + len(plist) * page:
        raise PlanError(
            f"chunk_pages: end {hi} is past the {len(plist)} pages from base {b} "
            f"(they cover up to token {b + len(plist) * page}, page_size {page})"
        )
    stop_tok = hi if last else _floor(hi, page)
    first = (lo - b) // page
    stop = -(-(stop_tok - b) // page)
    return ChunkPages(plist[first:stop].copy(), slice(first, stop), stop_tok)
