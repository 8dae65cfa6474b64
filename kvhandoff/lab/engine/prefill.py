"""The prefill instance: chunked prefill into paged pools, sent chunk by chunk.

Per request (:meth:`PrefillInstance.run`), as sglang's ``_send_kv_chunk`` does:

1. announce the request on every rank (its KV page count: zero when no component moves
   chunk by chunk, e.g. all-sliding-window attention) and learn decode's prefix length
   (pages below it are dropped by the transfer; chunks that hold only such pages, or no
   chunked component at all, are not sent);
2. for every chunk of ``chunk`` prompt tokens: grow the page table, run the HF model
   over the chunk with the request's cache, copy the rows the chunk produced (token
   rows, compressed entries) into every rank's pools, evict sliding-window pages that
   left the window, and send the pages completed so far, counted from token 0 (a
   non-last chunk keeps its partial last page for the next send);
3. with the last chunk: write the per-request state (conv/SSM, compressor rings), the
   aux row (first sampled token) and request rows, and send every state component;
4. wait until no write reads the request's source memory any more
   (:meth:`Transfer.settle`), then release its pages and slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from kvhandoff.lab.engine.arch import Arch
from kvhandoff.lab.engine.codecs import Series
from kvhandoff.lab.engine.instance import (
    AUX_KEY,
    VALID_FROM_KEY,
    Instance,
    Snapshot,
    pack_aux,
)
from kvhandoff.lab.engine.lists import component_lists
from kvhandoff.lab.engine.pools import CHUNKED_TYPES, PoolConfig
from kvhandoff.lab.engine.tables import ReqTable
from kvhandoff.lab.engine.transfer import Chunk, PrefillTransfer


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    first_token: int
    chunks_sent: int
    snapshot: Snapshot  # the request's whole cache as rows, for the end-to-end check


class PrefillInstance(Instance):
    """``tp`` prefill ranks running one model with chunked prefill."""

    def __init__(self, model: PreTrainedModel, arch: Arch, *, tp: int, pools: PoolConfig,
                 chunk: int, seed: int = 0) -> None:
        super().__init__(model, arch, tp=tp, pools=pools, seed=seed)
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.chunk = chunk

    def run(self, rid: int, tokens: list[int] | np.ndarray, transfer: PrefillTransfer
            ) -> PrefillOutcome:
        toks = np.asarray(tokens, dtype=np.int64)
        n, ps = len(toks), self.tables.page_size
        if n < 1:
            raise ValueError(f"request {rid}: empty prompt")
        req = self.tables.new_request()
        try:
            # KV pages the transfer will carry: none when no component moves by chunk (a
            # model whose attention is all sliding-window keeps only window pages, which
            # move with the last chunk like every other state component)
            chunked = any(c.type in CHUNKED_TYPES for c in self.layout.components)
            pages_total = -(-n // ps) if chunked else 0
            prefix = max(transfer.start(rid, r, pages_total, req.aux_row)
                         for r in range(self.tp))
            cache = self.new_cache()
            marks = {k: 0 for k, (_, f) in self.fields.items()
                     if f.series in (Series.TOKENS, Series.ENTRIES)}
            sent, sends = 0, 0  # tokens whose pages went out (complete pages only)
            logits = torch.empty(0)
            for s in range(0, n, self.chunk):
                e = min(n, s + self.chunk)
                self.tables.extend(req, e)
                self.tables.map_swa(req, s, e)
                logits = self.forward(cache, toks[s:e])
                self._write_rows(req, cache, marks)
                if self.arch.window:
                    self.tables.evict_swa(req, e - self.arch.swa_span)
                last = e == n
                end = n if last else e - e % ps
                if not last and (not chunked or end <= sent or end <= prefix):
                    continue  # nothing decode lacks is complete yet
                state = None
                if last:
                    self._write_state(rid, req, cache, n, logits)
                    lists = component_lists(self.layout, self.tables, req, n=n, prefix=prefix,
                                            window=self.arch.swa_span)
                    state = {c.name: lists[c.name] for c in self.layout.components
                             if c.type not in CHUNKED_TYPES}
                pages = req.pages[sent // ps:-(-end // ps)] if chunked else req.pages[:0]
                chunk = Chunk(pages=pages, last=last, state=state)
                for r in range(self.tp):
                    transfer.send(rid, r, chunk)
                sent, sends = end, sends + 1
            for r in range(self.tp):
                transfer.settle(rid, r)
            return PrefillOutcome(first_token=int(logits.argmax()), chunks_sent=sends,
                                  snapshot=self.snapshot(cache))
        finally:
            self.tables.release(req)

    def _write_rows(self, req: ReqTable, cache: object, marks: dict[tuple[str, str, int], int]
                    ) -> None:
        """Copy the token rows and compressed entries produced since the last call."""
        layers = cache.layers  # type: ignore[attr-defined]
        for key, since in marks.items():
            codec, f = self.fields[key]
            ids, rows = codec.read(layers[codec.layer], f, since)
            self.write_field(f, req, ids, rows)
            if len(ids):
                marks[key] = int(ids[-1]) + 1

    def _write_state(self, rid: int, req: ReqTable, cache: object, n: int,
                     logits: torch.Tensor) -> None:
        """Per-request state (rings, slots), the aux row and request rows."""
        layers = cache.layers  # type: ignore[attr-defined]
        for codec, f in self.fields.values():
            if f.series in (Series.RING, Series.SLOT):
                ids, rows = codec.read(layers[codec.layer], f, 0)
                self.write_field(f, req, ids, rows)
        slot = np.array([req.slot], dtype=np.int64)
        first = int(logits.argmax())
        logprob = float(torch.log_softmax(logits.float(), -1)[first])
        self.write(AUX_KEY, np.array([req.aux_row], dtype=np.int64),
                   pack_aux(rid, first, logprob, self.global_row_bytes(AUX_KEY)))
        if self.has(VALID_FROM_KEY):
            valid = np.array([[max(0, n - self.arch.window + 1)]], dtype=np.int64)
            self.write(VALID_FROM_KEY, slot, valid.view(np.uint8))
