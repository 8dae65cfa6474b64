"""State types and the one table of their policies.

A state type is a *declaration*: how its items are indexed and how the two index
lists of a request pair up. Nothing else in kvhandoff switches on the type; the
planner reads this table. Adding a type is adding a row.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class StateType(enum.StrEnum):
    """Kinds of per-request state. The value is the stable wire name."""

    KV = "kv"  # full-attention KV pages (MHA/GQA: head-sharded)
    MLA = "mla"  # MLA latent KV pages (replicated across TP)
    MAMBA = "mamba"  # Mamba2 / GDN / KDA conv + SSM state, one slot per request
    SHORT_CONV = "short_conv"  # short-convolution window only (LFM2), one slot per request
    SWA = "swa"  # sliding-window KV pages of the window only
    NSA = "nsa"  # sparse-attention (DSA) indexer pages, suffix after the decode prefix
    DSV4_SWA = "dsv4_swa"  # DeepSeek-V4 SWA KV + page-scoped compress rings (mixed items)
    DSV4_RING = "dsv4_ring"  # DeepSeek-V4 unified SWA ring, one token row per item
    DSV4_REQUEST = "dsv4_request"  # DeepSeek-V4 request-scoped compression state
    REQUEST_ROW = "request_row"  # one row per request (e.g. DSv4 swa_valid_from)
    AUX = "aux"  # per-request metadata row (first token, logprobs, arrival guard)


class IndexKind(enum.StrEnum):
    """What one index of a component addresses."""

    PAGE = "page"  # a page of token rows
    SLOT = "slot"  # a per-request state slot
    ROW = "row"  # one row (ring row, metadata row)


class LengthPolicy(enum.StrEnum):
    """How a request's source and destination index lists pair up."""

    EXACT = "exact"  # lengths must be equal, else IndexLengthMismatch
    TRIM = "trim"  # keep the common prefix and warn (paged windows drift by a page)


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    index_kind: IndexKind
    length: LengthPolicy
    may_be_empty: bool  # an empty index list is a normal request (nothing pending)
    max_items: int | None = None  # e.g. exactly one Mamba slot per request
    indices: str = ""  # how engines compute the list (see kvhandoff.indices)


POLICIES: dict[StateType, Policy] = {
    StateType.KV: Policy(
        index_kind=IndexKind.PAGE, length=LengthPolicy.EXACT, may_be_empty=True,
        indices="pages of [decode_prefix_len, seq_len), chunk by chunk",
    ),
    StateType.MLA: Policy(
        index_kind=IndexKind.PAGE, length=LengthPolicy.EXACT, may_be_empty=True,
        indices="pages of [decode_prefix_len, seq_len), chunk by chunk",
    ),
    StateType.MAMBA: Policy(
        index_kind=IndexKind.SLOT, length=LengthPolicy.EXACT, may_be_empty=False, max_items=1,
        indices="the request's mamba slot",
    ),
    StateType.SHORT_CONV: Policy(
        index_kind=IndexKind.SLOT, length=LengthPolicy.EXACT, may_be_empty=False, max_items=1,
        indices="the request's conv slot",
    ),
    StateType.SWA: Policy(
        index_kind=IndexKind.PAGE, length=LengthPolicy.TRIM, may_be_empty=True,
        indices="window pages from page_floor(max(prefix, seq_len - window))",
    ),
    StateType.NSA: Policy(
        index_kind=IndexKind.PAGE, length=LengthPolicy.TRIM, may_be_empty=True,
        indices="suffix pages of [decode_prefix_len, seq_len)",
    ),
    StateType.DSV4_SWA: Policy(
        index_kind=IndexKind.PAGE, length=LengthPolicy.TRIM, may_be_empty=True,
        indices="SWA window pages; ring tensors also take logical positions",
    ),
    StateType.DSV4_RING: Policy(
        index_kind=IndexKind.ROW, length=LengthPolicy.EXACT, may_be_empty=True,
        indices="slot * ring + pos % ring for the last `window` positions",
    ),
    StateType.DSV4_REQUEST: Policy(
        index_kind=IndexKind.ROW, length=LengthPolicy.EXACT, may_be_empty=True,
        indices="the pending compression row, or nothing when seq_len % ratio == 0",
    ),
    StateType.REQUEST_ROW: Policy(
        index_kind=IndexKind.ROW, length=LengthPolicy.EXACT, may_be_empty=False, max_items=1,
        indices="the request's row",
    ),
    StateType.AUX: Policy(
        index_kind=IndexKind.ROW, length=LengthPolicy.EXACT, may_be_empty=False, max_items=1,
        indices="the request's metadata row",
    ),
}


def policy(state_type: StateType) -> Policy:
    """The policy of ``state_type``; every member has one (a test pins this)."""
    return POLICIES[state_type]
