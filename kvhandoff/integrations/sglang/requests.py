"""SGLang's per-request index lists as a kvhandoff request's. Pure.

SGLang's scheduler hands its backend, per request:

* on prefill, ``send(kv_indices, state_indices, num_kv_tokens)`` per chunk: the chunk's
  KV page ids *past decode's prefix* (``finalize_bootstrap`` starts sending at
  ``decode_prefix_len``), and with the last chunk ``state_indices``, one entry per
  ``kv_args.state_types`` (an index list, or None when that state does not move);
  ``init(num_pages, aux_index)`` before, with the page count past the prefix and the
  metadata row;
* on decode, ``send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len)``:
  its pages of ``[decode_prefix_len, seq_len)``, its metadata row and its state entries.

A kvhandoff Sender counts KV pages from token 0 and drops those below decode's prefix
itself; so the prefill side is handed ``prefix // page_size`` placeholder pages first
(:func:`from_token_zero`), which never move. The metadata row travels as the
``metadata`` component (one row on each side); kvhandoff's own arrival guard uses the
same row number in its aux component.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvhandoff.integrations.sglang.layout import KV, METADATA, component_name

__all__ = ["PLACEHOLDER_PAGE", "decode_indices", "from_token_zero", "prefill_state",
           "prefix_pages"]

PLACEHOLDER_PAGE = 0
"""What stands for a page inside decode's prefix: SGLang's padding page (page 0 of every
pool, never handed to a request), so it is a valid id and is never written."""

Items = npt.NDArray[np.int64]


def prefix_pages(decode_prefix_len: int, page_size: int) -> int:
    """Whole pages of decode's prefix (SGLang aligns the prefix to a page)."""
    if decode_prefix_len < 0 or decode_prefix_len % page_size:
        raise ValueError(f"decode prefix of {decode_prefix_len} tokens is not a whole number "
                         f"of {page_size}-token pages")
    return decode_prefix_len // page_size


def from_token_zero(pages: npt.ArrayLike, skip: int) -> Items:
    """A chunk's pages as a kvhandoff Sender takes them: ``skip`` placeholder pages for
    decode's prefix (first chunk only), then ``pages``."""
    arr = np.asarray(pages, dtype=np.int64).reshape(-1)
    if not skip:
        return arr
    return np.concatenate([np.full(skip, PLACEHOLDER_PAGE, dtype=np.int64), arr])


def _states(types: Sequence[str], state_indices: Sequence[object] | None
            ) -> dict[str, object | None]:
    if state_indices is not None and len(state_indices) != len(types):
        raise ValueError(f"{len(state_indices)} state index lists for the {len(types)} state "
                         f"types {list(types)}")
    entries = state_indices if state_indices is not None else [None] * len(types)
    return {component_name(t, i, types): (None if v is None else np.asarray(v, np.int64))
            for i, (t, v) in enumerate(zip(types, entries, strict=True))}


def prefill_state(types: Sequence[str], state_indices: Sequence[object] | None,
                  aux_index: int) -> dict[str, object | None]:
    """The last chunk's state for ``Sender.send``: each state entry under its component
    name, and the metadata row."""
    return {**_states(types, state_indices), METADATA: [aux_index]}


def decode_indices(types: Sequence[str], kv_indices: npt.ArrayLike,
                   state_indices: Sequence[object] | None, aux_index: int
                   ) -> dict[str, object | None]:
    """Every component's destination list for ``Receiver.init`` (kvhandoff's aux row is
    passed on its own)."""
    return {KV: np.asarray(kv_indices, np.int64).reshape(-1),
            **_states(types, state_indices), METADATA: [aux_index]}
