"""What prefill and decode instances share: a model, its TP ranks' pools, the tables,
and the placement of codec rows into pool units.

**Placement** (which unit of a tensor holds a row), by the row's series and the
component's type:

* token rows of page components: the token's full-pool slot (``page*page_size + off``);
* token rows of window components: the token's SWA-pool slot (``full_to_swa``);
* compressed entry ``e`` of ratio ``r``: row ``(e*r % page_size) // r`` of the page
  holding position ``e*r``;
* ring rows of position ``p``: row ``p % ring`` of the SWA page holding ``p``
  (DeepSeek-V4 page-scoped compressor state) or of the request slot (request-scoped);
* slot state: the request slot.

Writing shards every row for every rank (:mod:`kvhandoff.lab.engine.sharding`); reading
reassembles from every rank and reports whether replicas agreed.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from kvhandoff.errors import LayoutError
from kvhandoff.lab.engine.alloc import IdArray
from kvhandoff.lab.engine.arch import Arch, forward
from kvhandoff.lab.engine.codecs import Field, Key, LayerCodec, RowArray, Series
from kvhandoff.lab.engine.pools import (
    PAGE_TYPES,
    WINDOW_TYPES,
    PoolConfig,
    RankPools,
    rank_layout,
    units_per_item,
)
from kvhandoff.lab.engine.sharding import join, split
from kvhandoff.lab.engine.tables import ReqTable, Tables
from kvhandoff.layout import NO_LAYER, Layout
from kvhandoff.session.request.aux import (
    MAGIC,
    AuxRecord,
    AuxSpec,
    AuxState,
    check,
    stamp,
)
from kvhandoff.state_types import StateType

AUX_KEY: Key = ("aux", "aux", NO_LAYER)
VALID_FROM_KEY: Key = ("swa_valid_from", "swa_valid_from", NO_LAYER)

Snapshot = dict[Key, tuple[IdArray, RowArray]]


AUX = AuxSpec()
"""The aux row format (sglang's ``MetadataBuffers`` row): the session's own
(:mod:`kvhandoff.session.request.aux`), so a session ``Sender`` restamps the same guard
and decode's check holds over either transfer."""


def pack_aux(rid: int, first_token: int, first_logprob: float, row_bytes: int) -> RowArray:
    """Request ``rid``'s aux row of ``row_bytes``: its first token and logprob, stamped
    with its guard and crc (in-process the engine stamps it itself)."""
    row = np.zeros(row_bytes, dtype=np.uint8)
    AUX.pack(row, first_token=first_token, first_logprob=first_logprob)
    stamp(row, rid)
    return row.reshape(1, -1)


def unpack_aux(row: RowArray, rid: int) -> tuple[AuxRecord | None, str]:
    """Request ``rid``'s record, or ``None`` and why the row is not its intact row."""
    raw = row.reshape(-1)
    state, why = check(raw, rid)
    if state is not AuxState.OK:
        return None, f"aux row {state.value}: {why}"
    if int(raw[12:16].view("<u4")[0]) != MAGIC:
        return None, "aux row is torn or corrupt (no header magic)"
    return AUX.unpack(raw), ""


class Instance:
    """One prefill or decode deployment: ``tp`` ranks' pools over one set of tables."""

    def __init__(self, model: PreTrainedModel, arch: Arch, *, tp: int, pools: PoolConfig,
                 seed: int = 0) -> None:
        self.model, self.arch, self.tp = model, arch, tp
        windowed = arch.window > 0
        sps = (pools.swa_page_size or pools.page_size) if windowed else None
        self.tables = Tables(
            page_size=pools.page_size, num_pages=pools.num_pages, num_slots=pools.num_slots,
            swa_page_size=sps, num_swa_pages=pools.num_swa_pages or pools.num_pages, seed=seed)
        self.ranks = [RankPools(rank_layout(arch.shape, pools, tp_rank=r, tp_size=tp))
                      for r in range(tp)]
        self.fields: dict[Key, tuple[LayerCodec, Field]] = {
            f.key: (c, f) for c in arch.layer_codecs for f in c.fields}
        for key, (_, f) in self.fields.items():
            if self.global_row_bytes(key) != f.row_bytes:
                raise LayoutError(f"{arch.name}: tensor {key} holds {self.global_row_bytes(key)}"
                                  f" B per unit but the model's rows are {f.row_bytes} B")

    @property
    def layout(self) -> Layout:
        """Rank 0's layout (component names, types and shapes are every rank's)."""
        return self.ranks[0].layout

    # -- placement -----------------------------------------------------------------------
    def global_row_bytes(self, key: Key) -> int:
        comp, t = self.ranks[0].spec(key)
        per = units_per_item(t, comp, self.tables.page_size)
        if t.shard is None:
            return t.item_bytes // per
        return t.shard.outer // per * sum(t.shard.groups) * t.shard.inner_bytes

    def units(self, key: Key, series: Series, req: ReqTable, ids: IdArray, ratio: int = 1
              ) -> IdArray:
        """Pool units of tensor ``key`` holding rows ``ids`` of ``req``."""
        comp, t = self.ranks[0].spec(key)
        tb = self.tables
        per = units_per_item(t, comp, tb.page_size)
        ids = np.asarray(ids, dtype=np.int64)
        if series is Series.SLOT:
            return np.full(len(ids), req.slot * per, dtype=np.int64) + ids
        if series is Series.RING:
            if comp.type is StateType.DSV4_SWA:
                owner = tb.swa_slots(ids, req) // self._sps
                self._mapped(key, owner, ids)
            else:
                owner = np.full(len(ids), req.slot, dtype=np.int64)
            out: IdArray = owner * per + ids % per
            return out
        pos = ids * ratio
        if comp.type in WINDOW_TYPES:
            swa = tb.swa_slots(pos, req)
            self._mapped(key, swa, ids)
            return swa
        if comp.type not in PAGE_TYPES:
            raise LayoutError(f"tensor {key}: {series.value} rows in a {comp.type.value} component")
        out = req.pages[pos // tb.page_size] * per + (pos % tb.page_size) // ratio
        return out

    @staticmethod
    def _mapped(key: Key, slots: IdArray, ids: IdArray) -> None:
        if len(slots) and int(slots.min()) < 0:
            bad = int(ids[int(np.argmin(slots))])
            raise LayoutError(f"tensor {key}: position {bad} has no sliding-window page")

    @property
    def _sps(self) -> int:
        return self.tables.swa_page_size or self.tables.page_size

    # -- rows ----------------------------------------------------------------------------
    def write(self, key: Key, units: IdArray, rows: RowArray) -> None:
        """Store global ``rows`` at ``units`` of tensor ``key`` on every rank (its share)."""
        comp, t = self.ranks[0].spec(key)
        per = units_per_item(t, comp, self.tables.page_size)
        outer = t.shard.outer // per if t.shard is not None else 1
        for r, rank in enumerate(self.ranks):
            rank.units(key)[units] = split(rows, t.shard, outer, r, self.tp)

    def read(self, key: Key, units: IdArray) -> tuple[RowArray, bool]:
        """Global rows at ``units`` of tensor ``key``, reassembled from every rank, and
        whether every replica agreed."""
        comp, t = self.ranks[0].spec(key)
        per = units_per_item(t, comp, self.tables.page_size)
        outer = t.shard.outer // per if t.shard is not None else 1
        return join([rank.units(key)[units] for rank in self.ranks], t.shard, outer)

    def write_field(self, f: Field, req: ReqTable, ids: IdArray, rows: RowArray) -> None:
        if len(ids):
            self.write(f.key, self.units(f.key, f.series, req, ids, f.ratio), rows)

    def read_field(self, f: Field, req: ReqTable, ids: IdArray) -> tuple[RowArray, bool]:
        return self.read(f.key, self.units(f.key, f.series, req, ids, f.ratio))

    def has(self, key: Key) -> bool:
        return any(c.name == key[0] for c in self.layout.components)

    # -- model ---------------------------------------------------------------------------
    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def snapshot(self, cache: DynamicCache) -> Snapshot:
        """Every live row of every field of ``cache`` (for byte-exact comparisons)."""
        return {f.key: c.read(cache.layers[c.layer], f, 0)
                for c in self.arch.layer_codecs for f in c.fields}

    def forward(self, cache: DynamicCache, tokens: list[int] | np.ndarray) -> torch.Tensor:
        """Logits of the last position after feeding ``tokens`` into ``cache``."""
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64)).reshape(1, -1)
        return forward(self.model, ids, cache)
