"""Decode-side prefix cache: page-aligned prompt prefixes whose KV pages decode keeps.

Keys chain page by page (``key_k = H(key_{k-1} || tokens of page k)``), so a lookup
walks the prompt's pages and stops at the first miss: the hit is always a whole-page
prefix, which is what sglang's decode radix cache promises prefill (``decode_prefix_len``
is page-aligned). Cached pages are owned by the cache; a request that hits them borrows
them (locked) and never frees them. Pages hold every page-indexed component (full KV,
MLA latents, indexer keys, DeepSeek-V4 compressed rows); sliding-window pages and
per-request state are never cached (the engine caps a hit below the window).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from kvhandoff.lab.engine.alloc import IdArray


class PrefixCache:
    """Whole-page prompt prefixes → pages. Not thread-safe."""

    def __init__(self, page_size: int, free: Callable[[IdArray], None]) -> None:
        self.page_size = page_size
        self._free = free
        self._pages: dict[bytes, int] = {}
        self._locks: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._pages)

    def _keys(self, tokens: np.ndarray, num_pages: int) -> list[bytes]:
        keys, h = [], b""
        toks = np.asarray(tokens, dtype=np.int64)
        for k in range(num_pages):
            h = hashlib.sha1(h + toks[k * self.page_size:(k + 1) * self.page_size].tobytes(),
                             usedforsecurity=False).digest()
            keys.append(h)
        return keys

    def match(self, tokens: np.ndarray, max_pages: int) -> IdArray:
        """Locked pages of the longest cached prefix of ``tokens`` (at most ``max_pages``)."""
        out = []
        for key in self._keys(tokens, min(max_pages, len(tokens) // self.page_size)):
            page = self._pages.get(key)
            if page is None:
                break
            out.append(page)
        for p in out:
            self._locks[p] += 1
        return np.array(out, dtype=np.int64)

    def unlock(self, pages: IdArray) -> None:
        for p in pages.tolist():
            self._locks[p] -= 1

    def insert(self, tokens: np.ndarray, pages: IdArray) -> IdArray:
        """Offer a finished request's full pages; returns the page ids the cache took over
        (pages whose prefix was already cached stay with the request, to be freed)."""
        taken = []
        for key, page in zip(self._keys(tokens, len(pages)), pages.tolist(), strict=True):
            if key not in self._pages:
                self._pages[key] = page
                self._locks[page] = 0
                taken.append(page)
        return np.array(taken, dtype=np.int64)

    def evict_all(self) -> int:
        """Free every unlocked cached page; returns how many pages were freed."""
        drop = [(k, p) for k, p in self._pages.items() if self._locks[p] == 0]
        for k, p in drop:
            del self._pages[k], self._locks[p]
        self._free(np.array([p for _, p in drop], dtype=np.int64))
        return len(drop)
