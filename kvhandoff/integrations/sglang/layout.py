"""A kvhandoff :class:`~kvhandoff.layout.Layout` from what an SGLang rank registers. Pure.

SGLang hands a transfer backend its buffers in ``KVArgs``, an attribute bag the scheduler
fills from its pools (``sglang/srt/disaggregation/prefill.py`` and ``decode.py``,
``_init_kv_manager``). It is read once, at the boundary, into :class:`Registered`; this
module turns that into components:

=====================  =============  ====================================================
SGLang buffers         component      one item, and how it shards across attention TP
=====================  =============  ====================================================
``kv_data_ptrs``       ``kv``         a page: ``page_size`` token rows of K (then of V) of
(K then V per layer)   (``KV``)       the rank's heads, NHD; sharded by KV head
``kv_data_ptrs``       ``kv``         a page of the MLA latent (one buffer per layer);
(MLA)                  (``MLA``)      replicated
``state_types`` entry  by type        see :data:`STATE_TYPES`
``aux_data_ptrs``      ``metadata``   one row of each metadata buffer (the first token,
                       (REQUEST_ROW)  logprobs, hidden state, bootstrap room …); replicated
=====================  =============  ====================================================

State components: an SWA pool's pages (``swa``: K then V per sliding layer, sharded by
head like the KV pages), DSA indexer pages (``dsa``, replicated), Mamba / linear-attention
slots (``mamba``: per layer its conv and its SSM tensors, sharded as
:mod:`kvhandoff.sharding` says), DeepSeek-V4 ring rows and request state, request rows.
Types kvhandoff has no declaration for are refused by name (:data:`REFUSED`).

How a Mamba conv shards: SGLang states the sub-blocks of a GDN or Kimi conv
(``state_conv_shard_groups``), and nothing for a Mamba2 ``[x | B | C]`` conv, whose
sub-blocks come from the model's config (:class:`Mamba2Dims`). A conv whose sub-blocks
nobody states is described as one block, and an identity field pins the attention TP
size, so a pair of different TP sizes is refused at the handshake instead of slicing
across sub-blocks.

Draft-model buffers (speculative decoding) come after the target's in each list: they
get their own tensor names (``draft_k``, ``draft_latent``, ``draft_index``), so they pair
only with the peer's draft buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvhandoff.errors import LayoutError
from kvhandoff.layout import (
    NO_LAYER,
    Component,
    Layout,
    MemoryKind,
    Region,
    RowKind,
    ShardSpec,
    TensorSpec,
)
from kvhandoff.sharding import ConvKind, ConvSplit, conv_shard, extended_groups, mamba2_conv
from kvhandoff.state_types import StateType

__all__ = ["KV", "METADATA", "REFUSED", "STATE_TYPES", "Mamba2Dims", "Registered",
           "StateEntry", "component_name", "describe"]

KV = "kv"
METADATA = "metadata"

STATE_TYPES: dict[str, StateType] = {
    "mamba": StateType.MAMBA,
    "swa": StateType.SWA,
    "dsa": StateType.NSA,
    "swa_ring": StateType.DSV4_RING,
    "c128_state": StateType.DSV4_REQUEST,
    "request_row": StateType.REQUEST_ROW,
}
"""SGLang ``StateType`` values (``sglang.srt.disaggregation.base.conn``) kvhandoff moves,
and the kvhandoff state type each becomes."""

REFUSED: dict[str, str] = {
    "qsa_pending": "Qwen QSA's pending index-K ring",
    "qsa_compressed": "Qwen QSA's compressed-K pages",
    "dsa_tail": "the DSA kpool-compress tail ring (index_kpool > 1)",
    "minimax_index_k": "MiniMax sparse index-K pages",
    "minimax_dense_kv": "MiniMax dense-layer KV pages",
    "block_scale": "MXFP8 KV block scales",
    "block_scale_swa": "MXFP8 sliding-window KV block scales",
}
"""SGLang state types kvhandoff has no declaration for yet: refused at start-up, named."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StateEntry:
    """One ``state_types`` entry of KVArgs: one buffer per tensor, and for Mamba the
    per-tensor slice facts (``dims``: the rank's length of the TP-sliced axis, 0 for a
    replicated tensor; ``outer``: rows before that axis; ``conv_groups``: a conv's
    global sub-blocks, or None)."""

    type: str
    ptrs: tuple[int, ...]
    lens: tuple[int, ...]
    item_lens: tuple[int, ...]
    layer_ids: tuple[int, ...] = ()
    dims: tuple[int, ...] = ()
    outer: tuple[int, ...] = ()
    conv_groups: tuple[tuple[int, ...] | None, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Registered:
    """What one SGLang rank registered (its KVArgs, read once)."""

    kv_ptrs: tuple[int, ...]
    kv_lens: tuple[int, ...]
    kv_item_lens: tuple[int, ...]
    kv_layer_ids: tuple[int, ...] = ()
    num_draft_entries: int = 0
    page_size: int
    kv_head_num: int = 0  # this rank's KV heads (MHA)
    total_kv_head_num: int = 0  # the model's
    swa_head_num: int = 0  # the sliding-window pool's, when they differ (0: as above)
    total_swa_head_num: int = 0
    start_layer: int = 0
    aux_ptrs: tuple[int, ...] = ()
    aux_lens: tuple[int, ...] = ()
    aux_item_lens: tuple[int, ...] = ()
    states: tuple[StateEntry, ...] = ()
    kv_cache_dtype: str = "auto"
    is_mla: bool = False
    compression_ratios: tuple[int, ...] = ()  # DeepSeek-V4: its KV list is by buffer type


@dataclass(frozen=True, slots=True, kw_only=True)
class Mamba2Dims:
    """What a Mamba2 model's config says its conv is made of (KVArgs does not)."""

    n_groups: int
    state: int


def component_name(state_type: str, index: int, types: Sequence[str]) -> str:
    """The component of ``types[index]``: its SGLang name, numbered when it repeats."""
    if types.count(state_type) == 1:
        return state_type
    return f"{state_type}{types[:index].count(state_type)}"


def describe(reg: Registered, *, tp_rank: int, tp_size: int, mamba2: Mamba2Dims | None = None,
             extra: Sequence[Component] = (), identity: Sequence[tuple[str, str]] = (),
             memory: MemoryKind = MemoryKind.HOST, device: int = 0) -> Layout:
    """The rank's Layout: ``kv``, one component per state entry, ``metadata``, then
    ``extra`` (kvhandoff's own aux component). The KV and state buffers live in
    ``memory`` (of GPU ``device``); the metadata buffers in host memory, as SGLang keeps
    them. Raises :class:`~kvhandoff.errors.LayoutError` naming the component, tensor and
    numbers when the buffers do not fit the rules above."""
    if reg.compression_ratios:
        raise LayoutError(
            f"kvhandoff cannot describe DeepSeek-V4's compressed KV pools yet (KVArgs lists "
            f"them by buffer type, compression ratios {sorted(set(reg.compression_ratios))})")
    ident = dict(identity)
    types = [s.type for s in reg.states]
    refused = [t for t in types if t not in STATE_TYPES]
    if refused:
        raise LayoutError(
            "kvhandoff cannot move SGLang state " + ", ".join(
                f"{t!r} ({REFUSED.get(t, 'a state type it does not know')})" for t in refused)
            + f"; it moves {sorted(STATE_TYPES)}")
    components = [_kv(reg, tp_size)]
    for i, entry in enumerate(reg.states):
        name = component_name(entry.type, i, types)
        tensors, pinned = _state(name, entry, reg, tp_size, mamba2)
        if pinned:
            ident[f"{name} conv sharding"] = f"one block at attention TP {tp_size}"
        components.append(Component(type=STATE_TYPES[entry.type], name=name, tensors=tensors))
    if memory is not MemoryKind.HOST:
        components = [_on(c, memory, device) for c in components]
    components.append(_metadata(reg))
    components += extra
    return Layout(page_size=reg.page_size, tp_rank=tp_rank, tp_size=tp_size,
                  components=tuple(components), regions=_regions(components),
                  identity=tuple(sorted(ident.items())))


def _on(c: Component, memory: MemoryKind, device: int) -> Component:
    return Component(type=c.type, name=c.name, tensors=tuple(
        replace(t, memory=memory, device=device) for t in c.tensors))


def _regions(components: Sequence[Component]) -> tuple[Region, ...]:
    """The distinct memory blocks under every tensor: overlapping or shared buffers (a
    unified pool reports one buffer as KV and as state) become one region."""
    spans = sorted({(t.memory, t.device, t.ptr, t.ptr + t.nbytes)
                    for c in components for t in c.tensors if t.nbytes})
    merged: list[tuple[MemoryKind, int, int, int]] = []
    for mem, dev, lo, hi in spans:
        if merged and merged[-1][:2] == (mem, dev) and lo <= merged[-1][3]:
            m = merged[-1]
            merged[-1] = (mem, dev, m[2], max(m[3], hi))
        else:
            merged.append((mem, dev, lo, hi))
    return tuple(Region(ptr=lo, nbytes=hi - lo, memory=mem, device=dev)
                 for mem, dev, lo, hi in merged)


def _names(n: int, draft: int, per_layer: int, base: str) -> list[tuple[str, int]]:
    """(tensor name, index within its group) of ``n`` buffers: ``per_layer`` groups of
    target layers (K then V), then the draft's the same way."""
    target = n - draft
    if target < 0 or target % per_layer or draft % per_layer:
        raise LayoutError(f"component {base!r}: {n} buffers ({draft} of the draft model) do "
                          f"not split into {per_layer} group(s) per layer")
    groups = ["k", "v"] if per_layer == 2 else [base]
    out = []
    for count, prefix in ((target, ""), (draft, "draft_")):
        layers = count // per_layer
        out += [(f"{prefix}{g}", i) for g in groups for i in range(layers)]
    return out


def _kv(reg: Registered, tp_size: int) -> Component:
    n = len(reg.kv_ptrs)
    per_layer = 1 if reg.is_mla else 2
    names = _names(n, reg.num_draft_entries, per_layer, "latent")
    ids = reg.kv_layer_ids
    if ids and len(ids) != n:
        raise LayoutError(f"component 'kv': {len(ids)} layer ids for {n} buffers")
    tensors = []
    for j, (name, i) in enumerate(names):
        layer = ids[j] if ids else (i if name.startswith("draft_") else reg.start_layer + i)
        item = reg.kv_item_lens[j]
        shard = None if reg.is_mla else _head_shard(reg, item, f"kv tensor {name!r} layer {layer}")
        tensors.append(_paged(name, layer, reg.kv_ptrs[j], reg.kv_lens[j], item, reg.page_size,
                              shard))
    return Component(type=StateType.MLA if reg.is_mla else StateType.KV, name=KV,
                     tensors=tuple(tensors))


def _head_shard(reg: Registered, item: int, where: str, *, swa: bool = False) -> ShardSpec:
    """A page of ``page_size`` token rows of this rank's heads (NHD): sharded by head."""
    heads, total, page = reg.kv_head_num, reg.total_kv_head_num, reg.page_size
    if swa and reg.swa_head_num:
        heads, total = reg.swa_head_num, reg.total_swa_head_num
    if heads < 1 or total < 1 or item % (page * heads):
        raise LayoutError(f"{where}: a page of {item} B is not {page} tokens x {heads} heads "
                          f"(of {total})")
    return ShardSpec(outer=page, groups=(total,), inner_bytes=item // (page * heads))


def _paged(name: str, layer: int, ptr: int, nbytes: int, item: int, page: int,
           shard: ShardSpec | None) -> TensorSpec:
    """A page of ``page`` token rows (so a page-size difference could be re-paged), or
    one opaque item when its bytes are not whole rows."""
    rows = item % page == 0
    return TensorSpec(name=name, layer_id=layer, ptr=ptr, nbytes=nbytes, item_bytes=item,
                      rows=page if rows else 1, row_kind=RowKind.TOKEN if rows else RowKind.ITEM,
                      shard=shard)


def _state(name: str, e: StateEntry, reg: Registered, tp_size: int,
           mamba2: Mamba2Dims | None) -> tuple[tuple[TensorSpec, ...], bool]:
    """The tensors of one state component, and whether a conv's sharding is unknown (so
    the attention TP size must match)."""
    n = len(e.ptrs)
    if not (len(e.lens) == len(e.item_lens) == n):
        raise LayoutError(f"component {name!r}: {n} buffers, {len(e.lens)} lengths and "
                          f"{len(e.item_lens)} item lengths")
    if e.type == "mamba":
        return _mamba(name, e, tp_size, mamba2)
    if e.type == "swa":
        names = _names(n, 0, 2, "swa")
        return tuple(_paged(t, i, e.ptrs[j], e.lens[j], e.item_lens[j], reg.page_size,
                            _head_shard(reg, e.item_lens[j], f"{name} tensor {t!r} layer {i}",
                                        swa=True) if e.item_lens[j] else None)
                     for j, (t, i) in enumerate(names)), False
    if e.type == "dsa":  # the target's layers first, then the draft's (as the KV pages)
        layers = len(reg.kv_ptrs) - reg.num_draft_entries
        layers //= 1 if reg.is_mla else 2
        names = _names(n, max(0, n - layers), 1, "index")
        return tuple(TensorSpec(name=t, layer_id=i if t.startswith("draft_")
                                else reg.start_layer + i, ptr=e.ptrs[j], nbytes=e.lens[j],
                                item_bytes=e.item_lens[j])
                     for j, (t, i) in enumerate(names)), False
    # rows (rings, request state, request rows): one opaque row per item, per buffer
    return tuple(TensorSpec(name=f"{name}{j}", layer_id=NO_LAYER, ptr=e.ptrs[j],
                            nbytes=e.lens[j], item_bytes=e.item_lens[j])
                 for j in range(n)), False


def _mamba(name: str, e: StateEntry, tp: int, dims: Mamba2Dims | None
           ) -> tuple[tuple[TensorSpec, ...], bool]:
    n = len(e.ptrs)
    for what, v in (("layer ids", e.layer_ids), ("slice dims", e.dims),
                    ("outer counts", e.outer)):
        if len(v) != n:
            raise LayoutError(f"component {name!r}: {len(v)} {what} for {n} buffers")
    groups = e.conv_groups or (None,) * n
    seen: dict[int, int] = {}
    pinned = False
    tensors = []
    for j in range(n):
        layer = e.layer_ids[j]
        k = seen[layer] = seen.get(layer, -1) + 1  # per layer: conv first, then the SSM
        spec, unknown = _mamba_shard(f"{name} tensor state{k} layer {layer}", e.item_lens[j],
                                     e.dims[j], e.outer[j], groups[j], k == 0, tp, dims)
        pinned |= unknown
        tensors.append(TensorSpec(name=f"state{k}", layer_id=layer, ptr=e.ptrs[j],
                                  nbytes=e.lens[j], item_bytes=e.item_lens[j], shard=spec))
    return tuple(tensors), pinned


def _mamba_shard(where: str, item: int, dim: int, outer: int,
                 groups: tuple[int, ...] | None, conv: bool, tp: int,
                 dims: Mamba2Dims | None) -> tuple[ShardSpec | None, bool]:
    """One Mamba tensor's ShardSpec (None: replicated on every rank), and whether it is a
    conv whose sub-blocks are unknown."""
    if dim == 0:
        return None, False
    if outer < 1 or item % (outer * dim):
        raise LayoutError(f"{where}: {item} B is not {outer} rows x {dim} sliced units")
    unit = item // (outer * dim)  # bytes of one channel (or head) in one row
    if groups is not None:  # GDN [q|k|v] / Kimi [v|k|k]: SGLang states them, global
        if sum(groups) != dim * tp:
            raise LayoutError(f"{where}: conv sub-blocks {list(groups)} do not sum to "
                              f"{dim} channels x TP {tp}")
        kind = ConvKind.GDN if outer == 1 else ConvKind.KDA
        return conv_shard(ConvSplit(kind=kind, blocks=groups), channel_bytes=unit,
                          outer_rows=outer), False
    if conv and dims is not None:  # Mamba2 [x|B|C], B and C extended to TP when fewer
        bc = 2 * extended_groups(dims.n_groups, tp) * dims.state
        split = mamba2_conv(dim * tp - bc, dims.n_groups, dims.state)
        return conv_shard(split, channel_bytes=unit, outer_rows=outer), False
    return ShardSpec(outer=outer, groups=(dim * tp,), inner_bytes=unit), conv


def _metadata(reg: Registered) -> Component:
    n = len(reg.aux_ptrs)
    if not n or not (len(reg.aux_lens) == len(reg.aux_item_lens) == n):
        raise LayoutError(f"metadata buffers: {n} pointers, {len(reg.aux_lens)} lengths, "
                          f"{len(reg.aux_item_lens)} item lengths (at least one each)")
    return Component(type=StateType.REQUEST_ROW, name=METADATA, tensors=tuple(
        TensorSpec(name=f"meta{j}", layer_id=NO_LAYER, ptr=reg.aux_ptrs[j],
                   nbytes=reg.aux_lens[j], item_bytes=reg.aux_item_lens[j])
        for j in range(n)))
