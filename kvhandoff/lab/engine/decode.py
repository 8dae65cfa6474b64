"""The decode instance: preallocate, receive, rebuild the HF cache from pools, decode.

Per request, as sglang's decode does:

* :meth:`DecodeInstance.admit` — match the prompt against the prefix cache (a whole-page
  hit, capped so the sliding window still comes from prefill), allocate the remaining
  pages, the window's SWA pages and a slot, and open the transfer on every rank with
  this side's index lists (``TransferInfo``).
* :meth:`DecodeInstance.finish` — after the transfer reported done: check the aux row
  landed for this request, rebuild a ``DynamicCache`` from the pools (every rank's
  share, reassembled through :mod:`kvhandoff.lab.engine.sharding`), decode greedily, and
  release (full prompt pages go to the prefix cache when it is on).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from transformers import DynamicCache, PreTrainedModel

from kvhandoff.indices import swa_window_start
from kvhandoff.lab.engine.alloc import AllocatorError
from kvhandoff.lab.engine.arch import Arch
from kvhandoff.lab.engine.codecs import Key, RowArray, Series
from kvhandoff.lab.engine.instance import (
    AUX_KEY,
    VALID_FROM_KEY,
    Instance,
    Snapshot,
    unpack_aux,
)
from kvhandoff.lab.engine.lists import component_lists
from kvhandoff.lab.engine.pools import PoolConfig
from kvhandoff.lab.engine.prefix_cache import PrefixCache
from kvhandoff.lab.engine.tables import ReqTable
from kvhandoff.lab.engine.transfer import DecodeTransfer


@dataclass(slots=True)
class Ticket:
    rid: int
    tokens: np.ndarray
    req: ReqTable
    prefix_len: int

    @property
    def n(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True, slots=True)
class DecodeOutcome:
    tokens: list[int]
    snapshot: Snapshot  # the rebuilt cache as rows, before decoding
    replicas_agree: bool  # every TP replica of every byte read was identical
    problem: str = ""  # why nothing was decoded (aux row missing, foreign or corrupt)


class DecodeInstance(Instance):
    """``tp`` decode ranks; optionally a prefix cache shared by all of them."""

    def __init__(self, model: PreTrainedModel, arch: Arch, *, tp: int, pools: PoolConfig,
                 prefix_cache: bool = False, seed: int = 0) -> None:
        super().__init__(model, arch, tp=tp, pools=pools, seed=seed + 7)
        self.prefix = PrefixCache(pools.page_size, self.tables.pages.free) if prefix_cache else None
        self._tickets: dict[int, Ticket] = {}

    # -- admission -----------------------------------------------------------------------
    def max_prefix(self, n: int) -> int:
        """Longest prefix decode may hold for an ``n``-token prompt: whole pages, and below
        the sliding window (window pages and ring state always come from prefill)."""
        ps = self.tables.page_size
        cap = n // ps * ps
        if self.arch.window:
            cap = min(cap, max(0, n - self.arch.swa_span) // ps * ps)
        return cap

    def admit(self, rid: int, tokens: list[int] | np.ndarray, transfer: DecodeTransfer) -> Ticket:
        toks = np.asarray(tokens, dtype=np.int64)
        n, ps = len(toks), self.tables.page_size
        hit = (self.prefix.match(toks, self.max_prefix(n) // ps) if self.prefix is not None
               else np.zeros(0, dtype=np.int64))
        req = self.tables.new_request(prefix_pages=hit)
        prefix = len(hit) * ps
        try:
            try:
                self.tables.extend(req, n)
            except AllocatorError:
                if not self.evict():  # under pressure, drop the unlocked cached prefixes
                    raise
                self.tables.extend(req, n)
            if self.arch.window:
                self.tables.map_swa(req, swa_window_start(n, self.arch.swa_span, self._sps,
                                                          prefix), n)
            lists = component_lists(self.layout, self.tables, req, n=n, prefix=prefix,
                                    window=self.arch.swa_span)
        except BaseException:
            self._release(Ticket(rid, toks, req, prefix), donate=False)
            raise
        for rank in self.ranks:  # a guard found later was written for this request
            rank.units(AUX_KEY)[req.aux_row] = 0
        for d in range(self.tp):
            transfer.open(rid, d, lists, prefix)
        ticket = Ticket(rid, toks, req, prefix)
        self._tickets[rid] = ticket
        return ticket

    # -- after the transfer --------------------------------------------------------------
    def finish(self, rid: int, max_new_tokens: int, *, corrupt: str | None = None
               ) -> DecodeOutcome:
        """Rebuild ``rid``'s cache from the pools and decode ``max_new_tokens`` greedily
        (the first is prefill's, from the aux row). ``corrupt`` names a component one of
        whose received bytes is flipped first (to prove the end-to-end check can fail)."""
        t = self._tickets.pop(rid)
        done = False
        try:
            if corrupt is not None:
                self.corrupt(t, corrupt)
            slot = np.array([t.req.slot], dtype=np.int64)
            aux_row, agree = self.read(AUX_KEY, np.array([t.req.aux_row], dtype=np.int64))
            aux, problem = unpack_aux(aux_row, rid)
            if aux is None:
                return DecodeOutcome(tokens=[], snapshot={}, replicas_agree=agree,
                                     problem=f"request {rid}: {problem}")
            if self.has(VALID_FROM_KEY):  # the first position the window pages hold
                valid, ok = self.read(VALID_FROM_KEY, slot)
                want, got = max(0, t.n - self.arch.window + 1), int(valid.view(np.int64)[0, 0])
                if got != want:
                    return DecodeOutcome(tokens=[], snapshot={}, replicas_agree=agree and ok,
                                         problem=f"request {rid}: swa_valid_from is {got}, "
                                                 f"expected {want}")
                agree &= ok
            cache, ok = self.rebuild(t)
            snapshot = self.snapshot(cache)
            out = [aux.first_token]
            for _ in range(max_new_tokens - 1):
                out.append(int(self.forward(cache, out[-1:]).argmax()))
            done = True
            return DecodeOutcome(tokens=out[:max_new_tokens], snapshot=snapshot,
                                 replicas_agree=agree and ok)
        finally:
            self._release(t, donate=done)

    def rebuild(self, t: Ticket) -> tuple[DynamicCache, bool]:
        """A fresh ``DynamicCache`` holding what the pools hold for ``t``."""
        cache = self.new_cache()
        agree = True
        for codec in self.arch.layer_codecs:
            rows: dict[Key, RowArray] = {}
            for f in codec.fields:
                r, ok = self.read_field(f, t.req, codec.live(f, t.n))
                rows[f.key], agree = r, agree and ok
            codec.fill(cache.layers[codec.layer], t.n, rows)
        return cache, agree

    def corrupt(self, t: Ticket, target: str) -> None:
        """Flip one byte that was received for ``target`` (``component`` or
        ``component/tensor``) and that decoding reads: the high (exponent) byte of the
        first element of the most recent live row on rank 0 (request rows: the low byte of
        the first integer: the aux row's first token, ``swa_valid_from``)."""
        component, _, tensor = target.partition("/")
        for key, at in ((AUX_KEY, 16), (VALID_FROM_KEY, 0)):  # integer fields: low byte
            if component == key[0]:
                row = t.req.aux_row if key == AUX_KEY else t.req.slot
                self.ranks[0].units(key)[row, at] ^= 0x01
                return
        for codec in self.arch.layer_codecs:
            for f in codec.fields:
                ids = codec.live(f, t.n)
                if f.component != component or tensor not in ("", f.tensor) or not len(ids):
                    continue
                if f.series is Series.TOKENS and int(ids[-1]) < t.prefix_len:
                    continue
                unit = int(self.units(f.key, f.series, t.req, ids[-1:], f.ratio)[0])
                row, hi = self.ranks[0].units(f.key)[unit], f.itemsize - 1
                # keep the sign, force the exponent to ~2^15: large, finite, never a no-op
                new = (int(row[hi]) & 0x80) | 0x47
                row[hi] = new if new != row[hi] else new ^ 0x20
                return
        raise ValueError(f"{target!r} names no received row to corrupt")

    def _release(self, t: Ticket, *, donate: bool) -> None:
        keep = None
        if self.prefix is not None:
            borrowed = t.req.pages[:t.req.borrowed]
            if donate:
                full = t.n // self.tables.page_size
                keep = self.prefix.insert(t.tokens, t.req.pages[:full])
            self.prefix.unlock(borrowed)
        self.tables.release(t.req, keep=keep)

    def evict(self) -> int:
        """Drop every unlocked prefix-cache page (returns how many were freed)."""
        return self.prefix.evict_all() if self.prefix is not None else 0
