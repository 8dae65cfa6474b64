"""A kvhandoff :class:`~kvhandoff.layout.Layout` from what vLLM registers. Pure.

vLLM hands a connector its KV-cache groups (``kv_cache_config.kv_cache_groups``: one spec
and a list of layer names each) and, per layer, a tensor whose dimension 0 is the block
id (``register_kv_caches``). Each transferable group becomes one component and each layer
tensor one :class:`~kvhandoff.layout.TensorSpec` indexed by block id:

=====================  ===============  ==================================================
vLLM spec              state type       one item (a block)
=====================  ===============  ==================================================
``FullAttentionSpec``  ``KV``           ``[H, N, C]`` head-major (``LBHNC``): sharded by
                                        KV head, so heterogeneous TP slices it
``SlidingWindowSpec``  ``SWA``          as full attention
``MLAAttentionSpec``   ``MLA``          the latent page, replicated across TP
``MambaSpec``          ``MAMBA``        vLLM's raw padded page, read as one tensor per
                                        state (conv, then SSM/temporal) at its offset
                                        and page stride, each sharded as vLLM shards it
=====================  ===============  ==================================================

How vLLM shards recurrent state across TP ranks (its ``MambaStateShapeCalculator``), and
so how each state tensor is described (:func:`mamba_states`):

* conv state, ``(dim, K-1)`` per rank ("DS" layout) or ``(K-1, dim)`` ("SD"): the conv
  channels are sub-blocks sharded on their own — Mamba2 ``[x, B, C]`` (B and C in whole
  groups of ``state`` channels, replicated when TP exceeds the groups, as vLLM extends
  them), GDN ``[q, k, v]`` (q and k may differ in size from v), Mamba1 ``[x]``;
* SSM / temporal state: sharded by head (Mamba2 ``(heads, head_dim, state)``, GDN
  ``(v_heads, v_dim, k_dim)``) or by channel (Mamba1 ``(dim, state)``).

Several groups may alias one allocation (vLLM overlays groups of a hybrid model on one
page pool; a block id belongs to one group at a time), so the layout's regions are the
distinct backing allocations, not the tensors.

What this cannot express yet is refused here, at start-up, naming the group: recurrent
state of another kind under TP > 1, attention pages that are not head-major under TP > 1,
and more than one full-attention group (the session moves one paged KV component per
request).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvhandoff.errors import LayoutError
from kvhandoff.layout import NO_LAYER, Component, Layout, MemoryKind, Region, ShardSpec, TensorSpec
from kvhandoff.sharding import (
    ConvSplit,
    conv_shard,
    gdn_conv,
    mamba1_conv,
    mamba2_conv,
    ssm_shard,
)
from kvhandoff.state_types import StateType

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")

KINDS = {"full": StateType.KV, "sliding": StateType.SWA, "mla": StateType.MLA,
         "mamba": StateType.MAMBA}
"""Group kinds this module maps, and the state type each becomes."""


class VllmLayoutError(ValueError):
    """What vLLM registered cannot be handed off (yet); the message names the group."""


@dataclass(frozen=True, slots=True)
class MambaInfo:
    """What a ``MambaSpec`` says about one layer's state, with the model facts its shapes
    leave out. Shapes are this rank's (already divided by TP)."""

    kind: str  # "mamba1", "mamba2", "gdn", or vLLM's name for another kind
    shapes: tuple[tuple[int, ...], ...]
    itemsizes: tuple[int, ...]
    conv_dim_first: bool  # the conv state is (dim, K-1) ("DS"), not (K-1, dim)
    n_groups: int = 0  # mamba2: the model's B/C groups (before vLLM extends them for TP)
    replicated: bool = False  # every TP rank holds the whole state


@dataclass(frozen=True, slots=True)
class StatePart:
    """One state inside a Mamba page: where it starts, its bytes, how it shards."""

    name: str
    offset: int
    nbytes: int
    shard: ShardSpec | None


def mamba_states(m: MambaInfo, tp_size: int) -> tuple[StatePart, ...] | str:
    """The states of one Mamba page in page order, or why they cannot be described."""
    sizes = [math.prod(s) * b for s, b in zip(m.shapes, m.itemsizes, strict=True)]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    if m.replicated:
        return tuple(StatePart(f"state{i}", o, n, None)
                     for i, (o, n) in enumerate(zip(offsets, sizes, strict=True)))
    if m.kind not in ("mamba1", "mamba2", "gdn") or len(m.shapes) != 2:
        return f"recurrent state of kind {m.kind!r} with {len(m.shapes)} parts"
    conv = m.shapes[0]
    rows, dim = (conv[1], conv[0]) if m.conv_dim_first else (conv[0], conv[1])
    try:
        split, ssm_spec = _recurrent(m, dim, tp_size)
    except LayoutError as e:
        return str(e)
    if split.channels != dim * tp_size and m.kind != "mamba2":  # mamba2: B/C may be extended
        return (f"{m.kind} conv dim {dim} at TP {tp_size} does not split into {split.blocks} x "
                f"{split.unit}")
    c = m.itemsizes[0]
    conv_spec = (conv_shard(split, channel_bytes=rows * c) if m.conv_dim_first
                 else conv_shard(split, channel_bytes=c, outer_rows=rows))
    return (StatePart("conv", offsets[0], sizes[0], conv_spec),
            StatePart("ssm", offsets[1], sizes[1], ssm_spec))


def _recurrent(m: MambaInfo, dim: int, tp: int) -> tuple[ConvSplit, ShardSpec]:
    """The conv's sub-blocks and the SSM state's sharding (:mod:`kvhandoff.sharding`)
    from this rank's shapes; LayoutError when they do not fit the kind's rules."""
    ssm, isz = m.shapes[1], m.itemsizes[1]
    if m.kind == "mamba1":  # conv [x], SSM (d_inner, state)
        return mamba1_conv(dim * tp), ssm_shard(ssm[0] * tp, ssm[1] * isz, "d_inner rows")
    if m.kind == "mamba2":  # conv [x | B | C], SSM (heads, head_dim, state)
        heads, head_dim, state = ssm
        if not m.n_groups:
            raise LayoutError(f"Mamba2 conv channels cannot be cut into groups of {state} "
                              f"(n_groups unknown)")
        return (mamba2_conv(heads * head_dim * tp, m.n_groups, state),
                ssm_shard(heads * tp, head_dim * state * isz))
    v_heads, v_dim, k_dim = ssm  # gdn: conv [q | k | v], temporal (v_heads, v_dim, k_dim)
    value = v_heads * v_dim
    key2 = dim - value
    if key2 <= 0 or key2 % 2:
        raise LayoutError(f"GDN conv dim {dim} is not 2 x key + value ({value})")
    # whole heads on every rank: a unit common to key and value heads is TP-independent
    split = gdn_conv(key2 // 2 * tp, value * tp, unit=math.gcd(k_dim, v_dim))
    return split, ssm_shard(v_heads * tp, v_dim * k_dim * isz)


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """One transferable KV-cache group, as read from vLLM's spec."""

    index: int  # position in kv_cache_config.kv_cache_groups
    kind: str  # a key of KINDS
    spec: str  # the vLLM spec class name (for messages)
    block_size: int
    layer_names: tuple[str, ...]
    total_heads: int = 0  # attention: the model's KV heads over all TP ranks
    mamba: MambaInfo | None = None  # mamba groups


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One layer tensor, as read from torch: shape and strides in elements."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    dtype: str
    base_ptr: int  # the backing allocation (untyped storage)
    base_nbytes: int
    memory: MemoryKind = MemoryKind.HOST
    device: int = 0

    @property
    def block_bytes(self) -> int:
        return self.strides[0] * self.itemsize

    @property
    def num_blocks(self) -> int:
        return self.shape[0]


def layer_index(name: str) -> int:
    """The model layer a vLLM layer name belongs to (``model.layers.3.self_attn.attn`` → 3),
    or ``NO_LAYER`` when the name carries none."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else NO_LAYER


def component_name(group: GroupInfo) -> str:
    return f"g{group.index}.{group.kind}"


def build_layout(groups: Sequence[GroupInfo], tensors: Mapping[str, TensorInfo], *,
                 tp_rank: int, tp_size: int, extra: Sequence[Component] = (),
                 extra_regions: Sequence[Region] = (),
                 identity: Sequence[tuple[str, str]] = (), model: str = "") -> Layout:
    """The rank's Layout: one component per group, plus ``extra`` (the aux component).
    Raises :class:`VllmLayoutError` (or :class:`~kvhandoff.errors.LayoutError`) naming
    ``model``, the group, the layer and the numbers for what cannot be handed off."""
    try:
        return _build(groups, tensors, tp_rank=tp_rank, tp_size=tp_size, extra=extra,
                      extra_regions=extra_regions, identity=identity, model=model)
    except (VllmLayoutError, LayoutError) as e:
        if not model or str(e).startswith(f"{model}: "):  # the Layout named it already
            raise
        raise type(e)(f"{model}: {e}") from None


def _build(groups: Sequence[GroupInfo], tensors: Mapping[str, TensorInfo], *,
           tp_rank: int, tp_size: int, extra: Sequence[Component],
           extra_regions: Sequence[Region], identity: Sequence[tuple[str, str]],
           model: str) -> Layout:
    full = [g for g in groups if g.kind == "full"]
    if len(full) > 1:
        raise VllmLayoutError(
            f"vLLM made {len(full)} full-attention KV-cache groups "
            f"({[g.index for g in full]}); kvhandoff moves one paged KV component per request. "
            f"Start vLLM with --disable-hybrid-kv-cache-manager or a model with one attention "
            f"group")
    components, regions = [], {}
    for g in groups:
        if g.kind not in KINDS:
            raise VllmLayoutError(f"KV-cache group {g.index} ({g.spec}) has no kvhandoff state "
                                  f"type yet; supported: {sorted(KINDS)}")
        specs = []
        for name in g.layer_names:
            t = tensors.get(name)
            if t is None:
                raise VllmLayoutError(f"group {g.index} ({g.spec}) names layer {name!r}, which "
                                      f"vLLM did not register a tensor for")
            specs.extend(_tensors(g, name, t, tp_size))
            regions[t.base_ptr] = Region(ptr=t.base_ptr, nbytes=t.base_nbytes, memory=t.memory,
                                         device=t.device)
        components.append(Component(type=KINDS[g.kind], name=component_name(g),
                                    tensors=tuple(specs)))
    page = full[0].block_size if full else groups[0].block_size if groups else 1
    return Layout(page_size=page, tp_rank=tp_rank, tp_size=tp_size,
                  components=(*components, *extra),
                  regions=(*sorted(regions.values(), key=lambda r: r.ptr), *extra_regions),
                  identity=tuple(identity), model=model)


def _tensors(g: GroupInfo, name: str, t: TensorInfo, tp_size: int) -> list[TensorSpec]:
    where = f"group {g.index} ({g.spec}) layer {name!r}"
    item = t.block_bytes
    # a view may end before its last block's stride does (padded pages): keep whole items
    # that lie inside the backing allocation
    end = t.base_ptr + t.base_nbytes
    nbytes = min(t.num_blocks * item, (end - t.ptr) // item * item)
    if g.kind == "mamba" and g.mamba is not None:
        parts = mamba_states(g.mamba, tp_size)
        if isinstance(parts, str):
            if tp_size > 1:
                raise VllmLayoutError(f"{where}: {parts}; kvhandoff cannot slice it per TP "
                                      f"rank at TP {tp_size}, run this model at TP 1 on both "
                                      f"sides")
        else:
            if sum(p.nbytes for p in parts) > item:
                raise VllmLayoutError(f"{where}: its states ({sum(p.nbytes for p in parts)} B) "
                                      f"do not fit its {item} B page")
            return [TensorSpec(name=f"{name}#{p.name}", layer_id=layer_index(name),
                               ptr=t.ptr + p.offset, nbytes=nbytes - p.offset,
                               item_bytes=p.nbytes, stride=item, shard=p.shard,
                               memory=t.memory, device=t.device) for p in parts]
    return [_tensor(g, name, t, tp_size, where, nbytes)]


def _tensor(g: GroupInfo, name: str, t: TensorInfo, tp_size: int, where: str,
            nbytes: int) -> TensorSpec:
    item = t.block_bytes
    shard = None
    if g.kind in ("full", "sliding"):
        shard = _head_shard(g, where, t, tp_size)
        if shard is None and tp_size > 1:
            raise VllmLayoutError(
                f"{where}: pages of shape {t.shape} strides {t.strides} are not head-major "
                f"[H, N, C] blocks, so TP {tp_size} cannot be sliced by head; use the LBHNC "
                f"KV-cache layout")
    elif g.kind == "mamba" and tp_size > 1:
        raise VllmLayoutError(
            f"{where}: vLLM hands Mamba/linear-attention state as raw padded pages, which "
            f"kvhandoff does not slice per TP rank yet (TP {tp_size}); run this model at TP 1 "
            f"on both sides")
    return TensorSpec(name=name, layer_id=layer_index(name), ptr=t.ptr, nbytes=nbytes,
                      item_bytes=item, dtype=t.dtype if shard is not None else "uint8",
                      shard=shard, memory=t.memory, device=t.device)


def _head_shard(g: GroupInfo, where: str, t: TensorInfo, tp_size: int) -> ShardSpec | None:
    """``outer 1 × heads × (N·C bytes)`` for a dense head-major ``[B, H, N, C]`` block."""
    if len(t.shape) != 4:
        return None
    _, h, n, c = t.shape
    dense = (n * c, c, 1)
    if tuple(t.strides[1:]) != dense or t.strides[0] != h * n * c:
        return None
    total = g.total_heads or h
    if total % h and h != 1:
        raise VllmLayoutError(f"{where}: {h} local KV heads at TP {tp_size} do not divide the "
                              f"model's {total} ({total} = {total // h} x {h} + {total % h})")
    return ShardSpec(outer=1, groups=(total,), inner_bytes=n * c * t.itemsize,
                     labels=("KV heads",))
