"""``run_disaggregated``: prefill on P ranks, hand off, decode on D ranks, compare.

For every prompt: decode admits it (prefix cache, destinations), prefill runs it in
chunks and sends as it goes, decode rebuilds the cache from its pools and decodes
greedily. The same model then decodes the prompt *colocated*: plain HF in one process
(its own ``DynamicCache``, no engine, no pools, no transfer), prefilling in the same
chunks, then greedy steps. A request is ``ok`` when the tokens are equal **and**
decode's rebuilt cache equals prefill's byte for byte (every live row of every layer;
every TP replica agreeing). Tokens from a one-forward prefill are reported too
(:attr:`RequestResult.oneshot_equal`): chunked and one-forward prefill round
differently, which a top-k selection (DSA indexer) may turn into a different token.

``prefix_hit=True`` first hands off a *donor* request sharing the prompt's first
``P`` tokens (``P``: whole pages and chunks, below the window) so decode's prefix cache
holds them; the prompt then only moves its suffix pages.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from kvhandoff.lab.engine.arch import Arch, describe, forward
from kvhandoff.lab.engine.decode import DecodeInstance
from kvhandoff.lab.engine.instance import Snapshot
from kvhandoff.lab.engine.models import ARCHITECTURES, load_model
from kvhandoff.lab.engine.pools import PoolConfig, RankPools
from kvhandoff.lab.engine.prefill import PrefillInstance
from kvhandoff.lab.engine.transfer import LocalTransfer, Transfer, handshake

TransferFactory = Callable[[Sequence[RankPools], Sequence[RankPools]], Transfer]
"""Builds the transfer between prefill ranks and decode ranks (default: in-process)."""


@dataclass(frozen=True, slots=True)
class RequestResult:
    rid: int
    prompt_len: int
    prefix_len: int  # tokens decode already held (prefix-cache hit)
    donor: bool  # a request run only to fill decode's prefix cache
    disaggregated: list[int]
    colocated: list[int]  # plain HF, same prefill chunks, one process
    oneshot: list[int]  # plain HF, the whole prompt in one forward
    bytes_by_component: dict[str, int]
    chunks: int
    state_equal: bool
    state_diff: str  # the first difference found ("" when equal)

    @property
    def tokens_equal(self) -> bool:
        return self.disaggregated == self.colocated

    @property
    def oneshot_equal(self) -> bool:
        """Also equal to one-forward prefill. Chunked and one-shot prefill differ in
        rounding, so a model with a discontinuous choice (a DSA top-k, an MoE router)
        may legitimately flip a near-tie here; the handoff itself is checked by
        :attr:`ok`."""
        return self.disaggregated == self.oneshot

    @property
    def ok(self) -> bool:
        return self.tokens_equal and self.state_equal


@dataclass(frozen=True, slots=True)
class RunResult:
    model: str
    prefill_tp: int
    decode_tp: int
    page_size: int
    chunk: int
    requests: list[RequestResult]
    leaks: dict[str, int] = field(default_factory=dict)  # ids still allocated, per pool

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.requests) and not any(self.leaks.values())


@dataclass(frozen=True, slots=True)
class Prepared:
    """A loaded model, its description and the engine settings that suit it."""

    model: PreTrainedModel
    arch: Arch
    name: str
    page_size: int
    swa_page_size: int | None


@functools.lru_cache(maxsize=16)
def _named(name: str, dtype: torch.dtype) -> Prepared:
    model = load_model(name, dtype=dtype)
    a = ARCHITECTURES[name]
    return Prepared(model, describe(model, name), name, a.page_size, a.swa_page_size)


def prepare(model: str | os.PathLike[str] | PretrainedConfig | PreTrainedModel,
            dtype: torch.dtype = torch.float32) -> Prepared:
    """Load (named tiny models are built once and cached) and describe ``model``.
    DeepSeek-V4 gets 128-token pages (whole C4 and C128 rows) and a 16-token SWA pool
    page; everything else 16-token pages (the named tiny models use 4)."""
    if isinstance(model, str) and model in ARCHITECTURES:
        return _named(model, dtype)
    m = model if isinstance(model, PreTrainedModel) else load_model(model, dtype=dtype)
    arch = describe(m)
    ps, sps = (128, 16) if arch.dsv4 else (16, None)
    return Prepared(m, arch, arch.name, ps, sps)


def colocated_greedy(model: PreTrainedModel, tokens: Sequence[int] | np.ndarray,
                     max_new_tokens: int,
                     chunk: int | None = None) -> list[int]:
    """Plain HF greedy decoding in one process with the model's own ``DynamicCache``:
    forwards over the prompt (in ``chunk``-token pieces, or all at once), then one
    forward per new token. No engine, no pools, no transfer."""
    cache = DynamicCache(config=model.config)
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64)).reshape(1, -1)
    step_len = chunk or ids.shape[1]
    out: list[int] = []
    for s in range(0, ids.shape[1], step_len):
        logits = forward(model, ids[:, s:s + step_len], cache)
    while True:
        out.append(int(logits.argmax()))
        if len(out) == max_new_tokens:
            return out
        logits = forward(model, torch.tensor([[out[-1]]]), cache)


def compare(prefill: Snapshot, decode: Snapshot) -> str:
    """The first difference between two snapshots ("" when byte-identical)."""
    for key in prefill:
        (ids_p, rows_p), (ids_d, rows_d) = prefill[key], decode[key]
        if not np.array_equal(ids_p, ids_d):
            return f"{key}: prefill holds rows {ids_p[:4]}.. decode {ids_d[:4]}.."
        if not np.array_equal(rows_p, rows_d):
            bad = np.flatnonzero((rows_p != rows_d).any(axis=1))
            return f"{key}: row {int(ids_p[bad[0]])} differs ({len(bad)} rows)"
    return ""


def snapshot_digest(snapshot: Snapshot) -> dict[str, str]:
    """Per tensor, a digest of its live rows and their ids: what two processes exchange
    to compare a prefill cache with a decode cache without shipping the bytes."""
    out = {}
    for key, (ids, rows) in sorted(snapshot.items()):
        h = hashlib.sha256(np.ascontiguousarray(ids).tobytes())
        h.update(np.ascontiguousarray(rows).tobytes())
        out["/".join(map(str, key))] = h.hexdigest()
    return out


@dataclass(frozen=True, slots=True)
class Engines:
    """A started prefill instance, decode instance and the transfer between them."""

    prep: Prepared
    prefill: PrefillInstance
    decode: DecodeInstance
    link: Transfer
    page_size: int
    prefix_hit: bool


def start(
    model: str | os.PathLike[str] | PretrainedConfig | PreTrainedModel,
    prompt_lens: Sequence[int],
    *,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    chunk: int = 16,
    prefix_hit: bool = False,
    page_size: int | None = None,
    transfer: TransferFactory | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_pages: int | None = None,
) -> Engines:
    """Everything :func:`run_disaggregated` does before its first request: load and
    describe the model, lay out both instances' pools (sized for ``prompt_lens``), and
    check every (prefill rank, decode rank) pair as the session handshake does
    (:func:`~kvhandoff.lab.engine.transfer.handshake`). Whatever cannot work is refused here,
    by a :class:`~kvhandoff.errors.HandoffError` naming the cause (an unmappable cache
    layer, a TP size the heads do not allow, incompatible layouts)."""
    prep = prepare(model, dtype)
    m, arch, sps = prep.model, prep.arch, prep.swa_page_size
    ps = page_size or prep.page_size
    total = sum(prompt_lens)
    pages = num_pages or 2 * sum(math.ceil(n / ps) + 1 for n in prompt_lens) + 8
    pools = PoolConfig(page_size=ps, num_pages=pages, num_slots=8, swa_page_size=sps,
                       num_swa_pages=(2 * total // (sps or ps) + 16))
    prefill = PrefillInstance(m, arch, tp=prefill_tp, pools=pools, chunk=chunk, seed=seed)
    decode = DecodeInstance(m, arch, tp=decode_tp, pools=pools, prefix_cache=prefix_hit,
                            seed=seed)
    handshake(prefill.ranks, decode.ranks)
    link = (transfer or LocalTransfer)(prefill.ranks, decode.ranks)
    return Engines(prep, prefill, decode, link, ps, prefix_hit)


def run_disaggregated(
    model: str | os.PathLike[str] | PretrainedConfig | PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    chunk: int = 16,
    max_new_tokens: int = 16,
    prefix_hit: bool = False,
    page_size: int | None = None,
    corrupt: str | None = None,
    transfer: TransferFactory | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_pages: int | None = None,
) -> RunResult:
    """Hand every prompt from a ``prefill_tp``-rank prefill to a ``decode_tp``-rank decode
    and compare with colocated decoding. ``corrupt`` flips one received byte of that
    component in every request (the check must then fail). Pools are sized for the
    prompts unless ``num_pages`` says otherwise (a small pool makes decode evict its
    prefix cache under pressure); every page and slot must be free again at the end
    (``RunResult.leaks``)."""
    e = start(model, [len(p) for p in prompts], prefill_tp=prefill_tp, decode_tp=decode_tp,
              chunk=chunk, prefix_hit=prefix_hit, page_size=page_size, transfer=transfer,
              dtype=dtype, seed=seed, num_pages=num_pages)
    return serve(e, prompts, max_new_tokens=max_new_tokens, corrupt=corrupt)


def serve(e: Engines, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 16,
          corrupt: str | None = None) -> RunResult:
    """Hand every prompt off through started engines (:func:`start`), in order, then
    drop decode's prefix cache and count what is still allocated."""
    m, ps, prefill, decode, link = e.prep.model, e.page_size, e.prefill, e.decode, e.link
    chunk = prefill.chunk
    results: list[RequestResult] = []
    for prompt in prompts:
        toks = np.asarray(prompt, dtype=np.int64)
        if e.prefix_hit:
            donor = _donor(toks, decode.max_prefix(len(toks)), math.lcm(ps, chunk),
                           int(m.config.get_text_config().vocab_size))
            if donor is not None:
                results.append(_handoff(len(results), donor, prefill, decode, link,
                                        max_new_tokens, None, donor=True))
        results.append(_handoff(len(results), toks, prefill, decode, link, max_new_tokens,
                                corrupt, donor=False))
    decode.evict()
    leaks = {f"prefill {k}": v for k, v in prefill.tables.leaks().items()}
    leaks |= {f"decode {k}": v for k, v in decode.tables.leaks().items()}
    return RunResult(model=e.prep.name, prefill_tp=prefill.tp, decode_tp=decode.tp,
                     page_size=ps, chunk=chunk, requests=results, leaks=leaks)


def _donor(toks: np.ndarray, cap: int, step: int, vocab: int) -> np.ndarray | None:
    """A prompt sharing ``toks``' first ``P`` tokens (``P`` a multiple of ``step`` up to
    ``cap``) and continuing differently; ``None`` when no such prefix exists."""
    p = cap // step * step
    if p == 0:
        return None
    tail = (toks[p:p + 3] + 1) % vocab if len(toks) > p else np.array([1, 2, 3])
    return np.concatenate([toks[:p], tail])


def _handoff(rid: int, toks: np.ndarray, prefill: PrefillInstance, decode: DecodeInstance,
             link: Transfer, max_new: int, corrupt: str | None, *, donor: bool
             ) -> RequestResult:
    ticket = decode.admit(rid, toks, link)
    out_p = prefill.run(rid, toks, link)
    report = link.wait(rid)
    out_d = decode.finish(rid, max_new, corrupt=corrupt)
    diff = out_d.problem or compare(out_p.snapshot, out_d.snapshot)
    if not diff and not out_d.replicas_agree:
        diff = "TP replicas on decode disagree"
    return RequestResult(
        rid=rid, prompt_len=len(toks), prefix_len=ticket.prefix_len, donor=donor,
        disaggregated=out_d.tokens,
        colocated=colocated_greedy(prefill.model, toks, max_new, prefill.chunk),
        oneshot=colocated_greedy(prefill.model, toks, max_new),
        bytes_by_component=report.bytes_by_component, chunks=report.chunks,
        state_equal=not diff, state_diff=diff,
    )
