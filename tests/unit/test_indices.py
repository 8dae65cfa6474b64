"""Unit and property tests of kvhandoff.indices (pure index arithmetic)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.errors import PlanError
from kvhandoff.indices import (
    chunk_pages,
    compress_state_positions,
    dsa_tail_segments,
    dsv4_compress_ring_size,
    dsv4_ratio2_state_rows,
    dsv4_request_state_rows,
    mamba_slot,
    num_pages,
    pages_from_slots,
    prefill_seq_len,
    ring_positions,
    ring_rows,
    suffix_pages,
    swa_window_pages,
    swa_window_start,
    token_pages,
)

FAST = settings(max_examples=80, deadline=None)


def slots_of(pages: list[int] | np.ndarray, page: int, n_tokens: int) -> np.ndarray:
    """Token slots of ``n_tokens`` tokens allocated page-major on ``pages``."""
    pages = np.asarray(pages, dtype=np.int64)
    return (np.repeat(pages * page, page) + np.tile(np.arange(page), len(pages)))[:n_tokens]


@st.composite
def allocation(draw: st.DrawFn, max_pages: int = 12) -> tuple[int, np.ndarray, int]:
    """(page_size, distinct page ids, token count filling them, last page maybe partial)."""
    page = draw(st.sampled_from([1, 2, 3, 4, 16, 64]))
    n_pages = draw(st.integers(0, max_pages))
    pages = draw(st.lists(st.integers(0, 200), min_size=n_pages, max_size=n_pages, unique=True))
    n_tokens = 0 if not n_pages else draw(st.integers((n_pages - 1) * page + 1, n_pages * page))
    return page, np.array(pages, dtype=np.int64), n_tokens


# ---------------------------------------------------------------------------------------
# pages_from_slots


def test_pages_from_slots_full_and_partial_pages() -> None:
    slots = slots_of([5, 2, 9], 4, 10)
    assert pages_from_slots(slots, 4).tolist() == [5, 2, 9]
    assert pages_from_slots([], 4).tolist() == []
    assert pages_from_slots([7, 3, 0], 1).tolist() == [7, 3, 0]


def test_pages_from_slots_returns_fresh_int64_and_leaves_input_alone() -> None:
    slots = slots_of([3, 1], 2, 4).astype(np.int32)
    before = slots.copy()
    out = pages_from_slots(slots, 2)
    assert out.dtype == np.int64
    assert not np.shares_memory(out, slots)
    np.testing.assert_array_equal(slots, before)


@pytest.mark.parametrize(
    ("slots", "page", "match"),
    [
        ([1, 2, 3, 4], 4, "not a multiple of page_size 4"),  # starts mid-page
        ([4, 5, 7, 8], 4, r"position 2: slot 7, expected 6"),  # gap inside a page
        ([4, 5, 6, 7, 9], 4, "position 4 starts a page but holds slot 9"),
        ([0, 1, 0, 1], 2, r"page\(s\) \[0\] appear more than once"),
        ([0, -1], 2, r"slots\[1\] is -1"),
        ([[0, 1]], 2, "1-D"),
        ([0.0, 1.0], 2, "integers"),
    ],
)
def test_pages_from_slots_rejects_bad_lists(slots: list[int], page: int, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        pages_from_slots(slots, page)


@pytest.mark.parametrize("page", [0, -4, 2.0, True])
def test_pages_from_slots_rejects_bad_page_size(page: object) -> None:
    with pytest.raises(PlanError, match="page_size"):
        pages_from_slots([0, 1], page)  # type: ignore[arg-type]


@FAST
@given(allocation())
def test_pages_from_slots_round_trips_contiguous_allocations(
    alloc: tuple[int, np.ndarray, int],
) -> None:
    page, pages, n = alloc
    np.testing.assert_array_equal(pages_from_slots(slots_of(pages, page, n), page), pages)


@FAST
@given(allocation(), st.data())
def test_pages_from_slots_detects_any_single_slot_corruption(
    alloc: tuple[int, np.ndarray, int], data: st.DataObject
) -> None:
    page, pages, n = alloc
    if n == 0 or page == 1:
        return  # with page 1 every list of distinct slots is valid
    slots = slots_of(pages, page, n)
    i = data.draw(st.integers(0, n - 1))
    bumped = slots.copy()
    bumped[i] += data.draw(st.integers(1, page - 1))
    with pytest.raises(PlanError):
        pages_from_slots(bumped, page)


# ---------------------------------------------------------------------------------------
# lengths and suffixes


def test_num_pages_is_ceil() -> None:
    assert [num_pages(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    with pytest.raises(PlanError, match="num_tokens must be >= 0, got -1"):
        num_pages(-1, 4)
    with pytest.raises(PlanError, match="page_size must be >= 1, got 0"):
        num_pages(3, 0)


def test_prefill_seq_len_excludes_sampled_token() -> None:
    assert prefill_seq_len(128, 129) == 128  # last chunk: fill_ids already has the sample
    assert prefill_seq_len(128, 64) == 64  # a non-last chunk
    with pytest.raises(PlanError, match="extend_end must be >= 0, got -3"):
        prefill_seq_len(5, -3)


def test_suffix_pages() -> None:
    row = slots_of([8, 3, 6, 1], 4, 16)
    assert suffix_pages(row, 4, 13, 4).tolist() == [3, 6, 1]
    assert suffix_pages(row, 0, 16, 4).tolist() == [8, 3, 6, 1]
    assert suffix_pages(row, 8, 8, 4).tolist() == []
    with pytest.raises(PlanError, match="prefix_len 2 is not a multiple of page_size 4"):
        suffix_pages(row, 2, 10, 4)
    with pytest.raises(PlanError, match="start 12 is past end 8"):
        suffix_pages(row, 12, 8, 4)
    with pytest.raises(PlanError, match="holds only 16 slots"):
        suffix_pages(row, 0, 17, 4)


@FAST
@given(
    page=st.sampled_from([1, 4, 16, 64]),
    k=st.integers(1, 8),
    extra=st.integers(0, 3),
    prefix_pages=st.integers(0, 8),
)
def test_page_aligned_prompt_gives_exactly_prompt_pages_regression_27004(
    page: int, k: int, extra: int, prefix_pages: int
) -> None:
    """A page-aligned prompt of k pages: prefill and decode both list exactly k pages.

    The request row also holds the sampled token (and maybe more), in a fresh page; the
    old bug counted it and sent k+1 pages against decode's k.
    """
    prompt_len = k * page
    prefix = min(prefix_pages, k) * page
    row = slots_of(np.arange(k + 2) * 3 + 1, page, prompt_len + 1 + extra)
    p_len = prefill_seq_len(prompt_len, extend_end=prompt_len + 1 + extra)
    prefill = suffix_pages(row, prefix, p_len, page)
    decode = suffix_pages(row, prefix, prompt_len, page)
    assert len(prefill) == len(decode) == k - prefix // page
    assert len(suffix_pages(row, 0, p_len, page)) == prompt_len // page
    np.testing.assert_array_equal(prefill, decode)


# ---------------------------------------------------------------------------------------
# sliding window


def test_swa_window_start() -> None:
    assert swa_window_start(100, 10, 4) == 88  # 90 floored to 88
    assert swa_window_start(5, 10, 4) == 0  # clamped at 0
    assert swa_window_start(100, 10, 4, decode_prefix_len=96) == 96  # prefix hit wins
    assert swa_window_start(100, 10, 4, decode_prefix_len=93) == 92
    with pytest.raises(PlanError, match="decode_prefix_len 101 is past seq_len 100"):
        swa_window_start(100, 10, 4, decode_prefix_len=101)
    with pytest.raises(PlanError, match="window must be >= 1, got 0"):
        swa_window_start(100, 0, 4)


def test_swa_window_pages_with_translation() -> None:
    page = 4
    row = slots_of([2, 0, 1], page, 10)  # full pages 2, 0, 1
    full_to_swa = np.full(4 * page + 1, -1, dtype=np.int64)
    swa_of_full = {2: 7, 0: 5, 1: 6}
    for f, s in swa_of_full.items():
        full_to_swa[f * page : (f + 1) * page] = np.arange(s * page, (s + 1) * page)
    snapshot = full_to_swa.copy()
    assert swa_window_pages(row, 10, 5, page).tolist() == [0, 1]
    assert swa_window_pages(row, 10, 5, page, full_to_swa=full_to_swa).tolist() == [5, 6]
    assert swa_window_pages(row, 10, 100, page, full_to_swa=full_to_swa).tolist() == [7, 5, 6]
    np.testing.assert_array_equal(full_to_swa, snapshot)


def test_swa_window_pages_rejects_unmapped_and_out_of_range_slots() -> None:
    row = slots_of([0, 1], 2, 4)
    with pytest.raises(PlanError, match="maps to SWA slot -1"):
        swa_window_pages(row, 4, 4, 2, full_to_swa=np.array([0, 1, -1, -1]))
    with pytest.raises(PlanError, match="outside full_to_swa of length 2"):
        swa_window_pages(row, 4, 4, 2, full_to_swa=np.array([0, 1]))
    with pytest.raises(PlanError, match="holds only 4 slots"):
        swa_window_pages(row, 5, 4, 2)


@FAST
@given(allocation(), st.data())
def test_window_pages_cover_window_clipped_at_prefix(
    alloc: tuple[int, np.ndarray, int], data: st.DataObject
) -> None:
    page, pages, n = alloc
    row = slots_of(pages, page, n)
    window = data.draw(st.integers(1, 3 * page + 5))
    prefix = data.draw(st.integers(0, n // page)) * page
    swa_ids = data.draw(st.permutations(list(range(len(pages)))))
    full_to_swa = np.full(201 * page, -1, dtype=np.int64)
    for f, s in zip(pages.tolist(), swa_ids, strict=True):
        full_to_swa[f * page : (f + 1) * page] = np.arange(s * page, (s + 1) * page)

    start = swa_window_start(n, window, page, prefix)
    got = swa_window_pages(row, n, window, page, prefix)
    got_swa = swa_window_pages(row, n, window, page, prefix, full_to_swa=full_to_swa)

    lo = max(prefix, n - window, 0)
    first, stop = lo // page, -(-n // page)  # pages holding [lo, n), and no others
    assert start == first * page
    np.testing.assert_array_equal(got, pages[first:stop])
    np.testing.assert_array_equal(got_swa, np.array(swa_ids, dtype=np.int64)[first:stop])
    assert len(got) == num_pages(n - start, page)
    covered = np.concatenate([np.arange(i * page, (i + 1) * page) for i in range(first, stop)]
                             or [np.empty(0, dtype=np.int64)])
    assert set(range(lo, n)) <= set(covered.tolist())


# ---------------------------------------------------------------------------------------
# rings, slots, DeepSeek-V4 and DSA state


@FAST
@given(st.integers(1, 16), st.integers(0, 200), st.integers(0, 200), st.integers(0, 64))
def test_token_pages_are_the_pages_holding_the_tokens(page: int, a: int, b: int,
                                                       window: int) -> None:
    """Every token of the span lies in a listed page, and no listed page is empty of
    them; a window keeps the pages of its last ``window`` tokens (floored to a page)."""
    start, end = sorted((a, b))
    span = token_pages(start, end, page, window=window)
    lo = max(start, end - window, 0) // page * page if window else start
    tokens = range(lo, end)
    assert set(span) == {t // page for t in tokens}
    assert span.step == 1


def test_token_pages_refuses_a_reversed_span() -> None:
    assert token_pages(4, 9, 4) == range(1, 3)
    assert token_pages(0, 17, 4, window=6) == range(2, 5)
    assert list(token_pages(5, 5, 4)) == []
    with pytest.raises(PlanError, match="start 9 is past end 4"):
        token_pages(9, 4, 4)


def test_ring_positions_and_rows() -> None:
    assert ring_positions(10, 4).tolist() == [6, 7, 8, 9]
    assert ring_positions(3, 4).tolist() == [0, 1, 2]
    assert ring_positions(0, 4).tolist() == []
    assert ring_rows(2, [6, 7, 8, 9], 4).tolist() == [10, 11, 8, 9]
    assert ring_rows(0, [], 4).tolist() == []
    with pytest.raises(PlanError, match="collide in a ring of 4 rows"):
        ring_rows(1, [1, 5], 4)
    with pytest.raises(PlanError, match="collide in a ring of 4 rows"):
        ring_rows(1, ring_positions(10, 5), 4)
    with pytest.raises(PlanError, match="slot must be >= 0, got -1"):
        ring_rows(-1, [0], 4)


@FAST
@given(slot=st.integers(0, 1000), ring=st.integers(1, 300), extra=st.integers(0, 1000))
def test_ring_rows_of_last_ring_positions_are_a_permutation_of_the_ring(
    slot: int, ring: int, extra: int
) -> None:
    rows = ring_rows(slot, ring_positions(ring + extra, ring), ring)
    np.testing.assert_array_equal(np.sort(rows), np.arange(slot * ring, (slot + 1) * ring))


def test_mamba_slot() -> None:
    assert mamba_slot(3).tolist() == [3]
    assert mamba_slot(np.int32(0)).dtype == np.int64
    assert mamba_slot(np.array([7], dtype=np.int32)).tolist() == [7]
    for bad, match in [
        (-1, r"is -1; indices must be >= 0"),
        ([1, 2], "single index"),
        ([], "single index"),
        (1.0, "must be an integer"),
        (True, "must be an integer"),
    ]:
        with pytest.raises(PlanError, match=match):
            mamba_slot(bad)  # type: ignore[arg-type]


def test_dsv4_request_state_rows() -> None:
    # offline C128, ring 128: one item per request
    assert dsv4_request_state_rows(3, 300, 128, 128, online=False).tolist() == [3]
    # offline C128, ring 256 (speculative): two items per request, pick by position
    assert dsv4_request_state_rows(3, 300, 128, 256, online=False).tolist() == [3 * 2 + 0]
    assert dsv4_request_state_rows(3, 200, 128, 256, online=False).tolist() == [3 * 2 + 1]
    # nothing pending
    assert dsv4_request_state_rows(3, 256, 128, 256, online=False).tolist() == []
    assert dsv4_request_state_rows(3, 0, 128, 128, online=True).tolist() == []
    # online: one row per request
    assert dsv4_request_state_rows(5, 300, 128, 1, online=True).tolist() == [5]
    # ratio 2: the whole ring is one item
    assert dsv4_request_state_rows(4, 7, 2, 8, online=False).tolist() == [4]
    assert dsv4_request_state_rows(4, 8, 2, 8, online=False).tolist() == []
    assert dsv4_ratio2_state_rows(4, 9).tolist() == [4]
    with pytest.raises(PlanError, match="ring 100 is not a multiple of ratio 128"):
        dsv4_request_state_rows(0, 5, 128, 100, online=False)


def test_dsv4_compress_ring_size_table() -> None:
    assert dsv4_compress_ring_size(4) == 8
    assert dsv4_compress_ring_size(4, num_draft_tokens=3) == 16
    assert dsv4_compress_ring_size(128) == 128
    assert dsv4_compress_ring_size(128, num_draft_tokens=1) == 256
    assert dsv4_compress_ring_size(128, online=True) == 1
    assert dsv4_compress_ring_size(2) == 2
    assert dsv4_compress_ring_size(2, num_draft_tokens=3) == 8  # 1 << (4).bit_length()
    with pytest.raises(PlanError, match="ratio 7"):
        dsv4_compress_ring_size(7)
    with pytest.raises(PlanError, match="online compression exists only for ratio 128"):
        dsv4_compress_ring_size(4, online=True)


def test_compress_state_positions_fit_both_c4_rings() -> None:
    assert compress_state_positions(10, 4).tolist() == [4, 5, 6, 7, 8, 9]
    assert compress_state_positions(8, 4).tolist() == [4, 5, 6, 7]
    assert compress_state_positions(2, 4).tolist() == [0, 1]
    pos = compress_state_positions(1003, 4)
    for ring in (8, 16):  # prefill without speculation, decode with it
        assert len(np.unique(ring_rows(1, pos, ring))) == len(pos)


def test_dsa_tail_segments() -> None:
    assert dsa_tail_segments(3, 8, 4, 6).tolist() == []  # nothing pending
    assert dsa_tail_segments(3, 9, 4, 6).tolist() == [3, 2, 1, 0, 0, 6]
    assert dsa_tail_segments(3, 7, 4, 6).tolist() == [3, 4, 2, 0, 1, 6]  # wraps
    with pytest.raises(PlanError, match="tail ring of 3 slots is smaller than pool_size 4"):
        dsa_tail_segments(0, 5, 4, 3)
    with pytest.raises(PlanError, match="pool_size must be >= 2, got 1"):
        dsa_tail_segments(0, 5, 1, 3)


@FAST
@given(
    seq_len=st.integers(0, 5000),
    pool=st.integers(2, 16),
    extra=st.integers(0, 16),
    row=st.integers(0, 64),
)
def test_dsa_tail_segments_cover_exactly_the_pending_ring_slots(
    seq_len: int, pool: int, extra: int, row: int
) -> None:
    tail = pool + extra
    seg = dsa_tail_segments(row, seq_len, pool, tail).tolist()
    pending = seq_len % pool
    if not pending:
        assert seg == []
        return
    r, start, first, zero, second, t = seg
    assert (r, zero, t, first + second) == (row, 0, tail, pending)
    slots = list(range(start, start + first)) + list(range(second))
    assert slots == [(seq_len - pending + i) % tail for i in range(pending)]


# ---------------------------------------------------------------------------------------
# chunked prefill


def test_chunk_pages_snaps_non_last_end() -> None:
    plist = np.array([9, 4, 7, 2])
    c = chunk_pages(plist, 0, 6, 4, last=False)
    assert (c.pages.tolist(), c.page_slice, c.end) == ([9], slice(0, 1), 4)
    c = chunk_pages(plist, 4, 14, 4, last=True)
    assert (c.pages.tolist(), c.page_slice, c.end) == ([4, 7, 2], slice(1, 4), 14)
    c = chunk_pages(plist, 4, 6, 4, last=False)  # no complete page yet
    assert (c.pages.tolist(), c.end) == ([], 4)
    c = chunk_pages(plist[2:], 8, 8, 4, last=True, base=8)  # full prefix hit
    assert (c.pages.tolist(), c.page_slice, c.end) == ([], slice(0, 0), 8)
    assert not np.shares_memory(chunk_pages(plist, 0, 16, 4, last=True).pages, plist)


@pytest.mark.parametrize(
    ("start", "end", "base", "match"),
    [
        (2, 8, 0, "must be multiples of page_size 4"),
        (8, 4, 0, "need base 0 <= start 8 <= end 4"),
        (0, 8, 4, "need base 4 <= start 0"),
        (0, 17, 0, "end 17 is past the 4 pages"),
    ],
)
def test_chunk_pages_rejects_bad_ranges(start: int, end: int, base: int, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        chunk_pages([1, 2, 3, 4], start, end, 4, last=True, base=base)


@FAST
@given(allocation(), st.data())
def test_chunks_partition_the_request_pages(
    alloc: tuple[int, np.ndarray, int], data: st.DataObject
) -> None:
    page, pages, n = alloc
    base = data.draw(st.integers(0, len(pages))) * page
    base = min(base, (n // page) * page)
    plist = pages[base // page :]
    sent: list[np.ndarray] = []
    slices: list[slice] = []
    start = base
    ends = sorted(data.draw(st.lists(st.integers(base, n), max_size=5)))
    for end in [*ends, n]:
        last = end == n and len(sent) == len(ends)
        c = chunk_pages(plist, start, max(end, start), page, last=last, base=base)
        assert c.end % page == 0 or last
        sent.append(c.pages)
        slices.append(c.page_slice)
        start = c.end
    assert start == n
    np.testing.assert_array_equal(np.concatenate([np.empty(0, np.int64), *sent]), plist)
    assert all(a.stop == b.start for a, b in itertools.pairwise(slices))
