"""Named real model architectures, the per-rank Layouts they register, and test requests.

Pure: numpy only, no I/O, no memory unless the caller's allocator makes some.

* :class:`ModelShape` describes a model's per-request state (which layer keeps what,
  with the published head counts and dims). Named shapes: :data:`SHAPES`
  (``qwen3_next``, ``nemotron_h``, ``gpt_oss``, ``deepseek_v32``, ``deepseek_v4``,
  ``llama``, ``kimi_linear``, ``jamba``, ``lfm2``, ``gemma4``, ``mimo_v2_flash``,
  ``inkling``);
  :func:`tiny` shrinks one to a few layers and small dims with the same structure (same
  layer kinds, same sharding groups).
* :func:`layout_for` builds the :class:`~kvhandoff.layout.Layout` one TP/PP rank
  registers, following the pool layouts of sglang (``sglang_facts.md`` §2):
  MHA K and V pages per layer (NHD, head-sharded, GQA-replicated when TP exceeds
  the KV heads; each layer's pages in its KV group's shape, so K/V head counts and head
  dims may differ between layers and between K and V), MLA pages (replicated), NSA
  indexer pages (opaque), Mamba2 / GDN / KDA conv and SSM slots (sharded per sub-block),
  Mamba1 slots (sharded by d_inner), short-conv slots (by channel; beside attention, by
  what each conv runs over), SWA pages, the DeepSeek-V4 set and one aux row per
  request. Addresses come from ``alloc(nbytes) -> ptr``; the default
  :class:`FakeAllocator` hands out aligned addresses and allocates nothing, so
  benchmarks can plan layouts of real size.
* :func:`request_for` builds the request (component name -> :class:`Indices`) of a
  sequence of N tokens for a pair of layouts, with contiguous or random page ids,
  SWA window pages, the Mamba slot, ring rows and positions, and the aux row. It
  uses simple local formulas (sglang_facts.md §3.2), not :mod:`kvhandoff.indices`.

Component names are stable: ``kv`` (full-attention / MLA / DSv4 compressed KV),
``swa``, ``nsa``, ``mamba``, ``swa_ring``, ``c128_state``, ``swa_valid_from``, ``aux``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from kvhandoff.errors import LayoutError
from kvhandoff.layout import (
    NO_LAYER,
    Component,
    Layout,
    RowKind,
    ShardSpec,
    TensorSpec,
)
from kvhandoff.plan.request import Indices
from kvhandoff.sharding import (
    ConvSplit,
    conv_shard,
    gdn_conv,
    kda_conv,
    mamba1_conv,
    mamba2_conv,
    ssm_shard,
)
from kvhandoff.state_types import StateType

Alloc = Callable[[int], int]
"""``alloc(nbytes) -> ptr``: where a tensor of ``nbytes`` lives."""


class LayerKind(enum.StrEnum):
    """What per-request state one model layer keeps."""

    ATTN = "attn"  # full attention, MHA/GQA K and V pages
    SWA = "swa"  # sliding-window attention, MHA/GQA K and V pages of the window
    MLA = "mla"  # MLA latent pages (+ an NSA indexer page when the shape has one)
    GDN = "gdn"  # gated delta net: conv [q|k|v] + SSM slot (Qwen3-Next)
    MAMBA2 = "mamba2"  # Mamba2: conv [x|B|C] + SSM slot (Nemotron-H)
    MAMBA1 = "mamba1"  # Mamba1: conv [d_inner] + SSM [d_inner, state] slot (Jamba)
    ATTN_MAMBA2 = "attn_mamba2"  # attention K/V pages and a Mamba2 slot in one layer (Falcon-H1)
    ATTN_MAMBA1 = "attn_mamba1"  # attention K/V pages and a Mamba1 slot in one layer (Zamba)
    KDA = "kda"  # Kimi delta attention: transposed conv + SSM slot
    SHORT_CONV = "short_conv"  # short convolution: a conv [channels, K-1] slot, no SSM (LFM2)
    # attention K/V pages (full / sliding window) and the layer's short-conv slots
    # (ModelShape.layer_convs: Inkling's convs over K, V and the residual stream)
    ATTN_SHORT_CONV = "attn_short_conv"
    SWA_SHORT_CONV = "swa_short_conv"
    MLP = "mlp"  # no per-request state
    DSV4_W = "dsv4_w"  # DeepSeek-V4 window-only layer (compress ratio 0)
    DSV4_C4 = "dsv4_c4"  # DeepSeek-V4 ratio-4 layer (+ indexer)
    DSV4_C128 = "dsv4_c128"  # DeepSeek-V4 ratio-128 layer


_LINEAR = (LayerKind.GDN, LayerKind.MAMBA2, LayerKind.KDA, LayerKind.MAMBA1,
           LayerKind.ATTN_MAMBA2, LayerKind.ATTN_MAMBA1)
_MHA = (LayerKind.ATTN, LayerKind.ATTN_MAMBA2, LayerKind.ATTN_MAMBA1,
        LayerKind.ATTN_SHORT_CONV)  # layers with full-attention K/V pages
_SWA = (LayerKind.SWA, LayerKind.SWA_SHORT_CONV)  # layers with sliding-window K/V pages
_M2 = (LayerKind.MAMBA2, LayerKind.ATTN_MAMBA2)  # layers with a Mamba2 slot
_M1 = (LayerKind.MAMBA1, LayerKind.ATTN_MAMBA1)  # layers with a Mamba1 slot
_CONV_BANK = (LayerKind.ATTN_SHORT_CONV, LayerKind.SWA_SHORT_CONV)  # layers with layer_convs
_DSV4 = (LayerKind.DSV4_W, LayerKind.DSV4_C4, LayerKind.DSV4_C128)
_KV_PAGES = (*_MHA, *_SWA)  # layers with MHA K/V pages (full or window)


class ConvInput(enum.StrEnum):
    """What a layer's short convolution runs over, which decides how TP shards its state."""

    KEYS = "keys"  # the K projection: the layer's kv_heads x head_dim, sharded by KV heads
    VALUES = "values"  # the V projection: kv_heads x v_head_dim, sharded by KV heads
    HIDDEN = "hidden"  # the residual stream (after an all-reduce): replicated on every rank


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerConv:
    """One short-convolution state an attention + short-conv layer keeps: a conv slot
    ``[channels, kernel-1]`` named ``name`` in the ``short_conv`` component. The channels
    follow ``input``: K or V heads of the layer's KV group (head-sharded like the K/V
    pages, GQA-replicated past the heads) or ``hidden_size`` (replicated)."""

    name: str
    input: ConvInput
    kernel: int

    def __post_init__(self) -> None:
        if not self.name or self.kernel < 2:
            raise LayoutError(f"layer conv {self}: needs a name and a kernel above 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class KVGroup:
    """Attention layers whose K/V pages have another shape than the model's default
    (:attr:`ModelShape.kv_heads` / ``head_dim`` / ``v_head_dim``): Gemma 4's full layers
    (head_dim 512 beside 256), MiMo-V2-Flash's full layers (fewer KV heads than its
    sliding ones). Each layer's K and V tensors carry their group's shape and are
    head-sharded by the group's own KV heads, so groups replicate independently under
    GQA (one group sharded while another is replicated at the same TP)."""

    layers: tuple[int, ...]
    kv_heads: int
    head_dim: int  # K head dim
    v_head_dim: int = 0  # 0: head_dim

    def __post_init__(self) -> None:
        if not self.layers or min(self.kv_heads, self.head_dim, self.v_head_dim) < 0 \
                or not (self.kv_heads and self.head_dim):
            raise LayoutError(f"KV group {self}: needs layers, kv_heads and head_dim")

    @property
    def geometry(self) -> tuple[int, int, int]:
        """``(kv_heads, k_head_dim, v_head_dim)``."""
        return (self.kv_heads, self.head_dim, self.v_head_dim or self.head_dim)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """A model's per-request state geometry. Sizes in elements unless named ``_bytes``."""

    name: str
    layers: tuple[LayerKind, ...]
    # MHA / GQA attention (full and sliding-window layers)
    kv_heads: int = 0
    head_dim: int = 0  # K head dim (and V's unless v_head_dim says otherwise)
    v_head_dim: int = 0  # 0: head_dim (MiMo-V2-Flash: K 192, V 128)
    kv_groups: tuple[KVGroup, ...] = ()  # attention layers of other K/V shapes
    kv_dtype_bytes: int = 2
    sliding_window: int = 0  # tokens (SWA layers, DSv4 window)
    # MLA latent row (kv_lora_rank + qk_rope_head_dim, in bytes) and the DSA/NSA indexer
    mla_row_bytes: int = 0
    index_row_bytes: int = 0  # per token: fp8 keys (index_head_dim) + fp32 scale per 128 dims
    index_elided_layers: tuple[int, ...] = ()  # skip-top-k layers: placeholder, item 0
    # GDN / KDA linear attention
    linear_k_heads: int = 0
    linear_k_dim: int = 0
    linear_v_heads: int = 0
    linear_v_dim: int = 0
    # Mamba2 (heads, head_dim, groups, state) / Mamba1 (intermediate, state)
    mamba_intermediate: int = 0  # Mamba1 d_inner: conv channels and SSM rows, TP-sharded
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_state: int = 0
    conv_kernel: int = 4
    conv_dtype_bytes: int = 2
    # short convolutions (LFM2): channels (TP-sharded) and kernel width of the conv slot
    short_conv_channels: int = 0
    short_conv_kernel: int = 0
    # attention + short-conv layers (ATTN_SHORT_CONV / SWA_SHORT_CONV): their conv slots
    layer_convs: tuple[LayerConv, ...] = ()
    hidden_size: int = 0  # channels of a ConvInput.HIDDEN conv
    ssm_dtype_bytes: int = 4
    # DeepSeek-V4
    dsv4_kv_row_bytes: int = 0  # compressed / SWA KV row: 448 fp8 nope + 64 bf16 rope
    dsv4_head_dim: int = 0  # compressor state width (head_dim)
    dsv4_index_head_dim: int = 0
    dsv4_draft_layers: int = 0  # NextN layers; their SWA ring is the swa_ring component
    aux_row_bytes: int = 256

    def __post_init__(self) -> None:
        if not self.layers:
            raise LayoutError(f"shape {self.name!r} has no layers")
        if self.has(*_MHA) and LayerKind.MLA in self.layers:
            raise LayoutError(f"shape {self.name!r}: MHA and MLA layers would share component 'kv'")
        linear = {k for k in self.layers if k in _LINEAR}
        alone = {LayerKind.ATTN_MAMBA2: LayerKind.MAMBA2, LayerKind.ATTN_MAMBA1: LayerKind.MAMBA1}
        families = {alone.get(k, k) for k in linear}
        if len(families) > 1 and linear & {*_M1, LayerKind.ATTN_MAMBA2}:
            raise LayoutError(
                f"shape {self.name!r}: linear layers of kinds {sorted(k.value for k in families)} "
                f"would share the 'mamba' component's one conv / SSM geometry")
        if self.has(*_M1) and not (self.mamba_intermediate and self.mamba_state):
            raise LayoutError(f"shape {self.name!r}: Mamba1 layers need mamba_intermediate and "
                              f"mamba_state")
        if self.has(LayerKind.SHORT_CONV) and not (self.short_conv_channels
                                                     and self.short_conv_kernel > 1):
            raise LayoutError(f"shape {self.name!r}: short-conv layers need short_conv_channels "
                              f"and a short_conv_kernel above 1")
        if self.has(*_CONV_BANK) != bool(self.layer_convs):
            raise LayoutError(f"shape {self.name!r}: layer_convs go with attention + short-conv "
                              f"layers ({LayerKind.ATTN_SHORT_CONV.value}, "
                              f"{LayerKind.SWA_SHORT_CONV.value}) and only with them")
        names = [c.name for c in self.layer_convs]
        if len(set(names)) != len(names) or "conv" in names:
            raise LayoutError(f"shape {self.name!r}: layer conv names {names} repeat or take "
                              f"the short-conv layers' 'conv'")
        if any(c.input is ConvInput.HIDDEN for c in self.layer_convs) and not self.hidden_size:
            raise LayoutError(f"shape {self.name!r}: a conv over the hidden stream needs "
                              f"hidden_size")
        grouped = [i for g in self.kv_groups for i in g.layers]
        if len(set(grouped)) != len(grouped):
            raise LayoutError(f"shape {self.name!r}: a layer is in two KV groups {self.kv_groups}")
        bad = [i for i in grouped
               if not 0 <= i < len(self.layers) or self.layers[i] not in _KV_PAGES]
        if bad:
            raise LayoutError(f"shape {self.name!r}: KV group layers {bad} are no attention "
                              f"layers with K/V pages")
        for i in self.index_elided_layers:
            if not 0 <= i < len(self.layers) or self.layers[i] is not LayerKind.MLA:
                raise LayoutError(f"shape {self.name!r}: elided indexer layer {i} is no MLA layer")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_ids(self, *kinds: LayerKind) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layers) if k in kinds)

    def has(self, *kinds: LayerKind) -> bool:
        return any(k in kinds for k in self.layers)

    def kv_geometry(self, layer: int) -> tuple[int, int, int]:
        """``(kv_heads, k_head_dim, v_head_dim)`` of attention layer ``layer``: its KV
        group's, else the model's default."""
        for g in self.kv_groups:
            if layer in g.layers:
                return g.geometry
        return (self.kv_heads, self.head_dim, self.v_head_dim or self.head_dim)

    # derived sizes -------------------------------------------------------------------
    @property
    def conv_split(self) -> ConvSplit:
        """The conv state's independently sharded sub-blocks (:mod:`kvhandoff.sharding`),
        in channels."""
        if self.has(LayerKind.GDN):
            kd = self.linear_k_heads * self.linear_k_dim
            return gdn_conv(kd, self.linear_v_heads * self.linear_v_dim)
        if self.has(LayerKind.KDA):
            return kda_conv(self.linear_v_heads * self.linear_v_dim,
                            self.linear_k_heads * self.linear_k_dim)
        if self.has(*_M1):
            return mamba1_conv(self.mamba_intermediate)
        return mamba2_conv(self.mamba_heads * self.mamba_head_dim, self.mamba_groups,
                           self.mamba_state, whole_groups=False)

    @property
    def conv_groups(self) -> tuple[int, ...]:
        """Global channel lengths of the conv state's independently sharded sub-blocks."""
        return self.conv_split.blocks

    @property
    def conv_labels(self) -> tuple[str, ...]:
        """What each of :attr:`conv_groups` counts, for refusals (none for KDA)."""
        if self.has(LayerKind.GDN):
            return ("q channels", "k channels", "v channels")
        if self.has(LayerKind.KDA):
            return ()
        if self.has(*_M1):
            return ("d_inner channels",)
        return ("x channels", "B channels", "C channels")

    @property
    def ssm_heads(self) -> int:
        """Length of the SSM state's sharded axis (Mamba1: d_inner rows)."""
        if self.has(*_M1):
            return self.mamba_intermediate
        return self.mamba_heads if self.has(*_M2) else self.linear_v_heads

    @property
    def ssm_head_bytes(self) -> int:
        """Bytes of one unit of the SSM state's sharded axis."""
        if self.has(*_M1):
            return self.mamba_state * self.ssm_dtype_bytes
        if self.has(*_M2):
            return self.mamba_head_dim * self.mamba_state * self.ssm_dtype_bytes
        return self.linear_v_dim * self.linear_k_dim * self.ssm_dtype_bytes

    @property
    def dsv4_c4_state_row_bytes(self) -> int:
        """One C4 compressor ring row: kv and score, 2 × head_dim each (overlap 2), fp32."""
        return 2 * 2 * self.dsv4_head_dim * 4

    @property
    def dsv4_c4_index_state_row_bytes(self) -> int:
        return 2 * 2 * self.dsv4_index_head_dim * 4

    @property
    def dsv4_c128_state_bytes(self) -> int:
        """The online C128 request row: max, sum and kv of head_dim each, fp32."""
        return 3 * self.dsv4_head_dim * 4

    @property
    def total_layers(self) -> int:
        """Model layers plus DSv4 NextN draft layers (ids ``num_layers ..``)."""
        return self.num_layers + self.dsv4_draft_layers


def _pattern(s: str) -> tuple[LayerKind, ...]:
    table = {"M": LayerKind.MAMBA2, "-": LayerKind.MLP, "*": LayerKind.ATTN}
    return tuple(table[c] for c in s)


QWEN3_NEXT = ModelShape(
    # Qwen3-Next-80B-A3B: 48 layers, layer i is full attention when (i+1) % 4 == 0.
    name="qwen3_next",
    layers=tuple(LayerKind.ATTN if (i + 1) % 4 == 0 else LayerKind.GDN for i in range(48)),
    kv_heads=2, head_dim=256,
    linear_k_heads=16, linear_k_dim=128, linear_v_heads=32, linear_v_dim=128, conv_kernel=4,
)
NEMOTRON_H = ModelShape(
    # Nemotron-H-8B: hybrid_override_pattern (M = Mamba2, - = MLP, * = attention).
    name="nemotron_h",
    layers=_pattern("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"),
    kv_heads=8, head_dim=128,
    mamba_heads=128, mamba_head_dim=64, mamba_groups=8, mamba_state=128, conv_kernel=4,
)
GPT_OSS = ModelShape(
    # GPT-OSS-120B: 36 layers alternating sliding (window 128) and full attention.
    name="gpt_oss",
    layers=tuple(LayerKind.SWA if i % 2 == 0 else LayerKind.ATTN for i in range(36)),
    kv_heads=8, head_dim=64, sliding_window=128,
)
DEEPSEEK_V32 = ModelShape(
    # DeepSeek-V3.2: 61 MLA layers (kv_lora 512 + rope 64, bf16) + DSA indexer pages.
    name="deepseek_v32",
    layers=(LayerKind.MLA,) * 61,
    mla_row_bytes=(512 + 64) * 2, index_row_bytes=128 + 4,
)
DEEPSEEK_V4 = ModelShape(
    # DeepSeek-V4-Flash: 43 layers, compress ratios [0, 0, 4] + [128, 4] * 20, window 128,
    # head_dim 512 (448 nope + 64 rope), index_head_dim 128, one NextN draft layer.
    name="deepseek_v4",
    layers=(LayerKind.DSV4_W, LayerKind.DSV4_W, LayerKind.DSV4_C4)
    + (LayerKind.DSV4_C128, LayerKind.DSV4_C4) * 20,
    sliding_window=128, dsv4_kv_row_bytes=448 + 64 * 2, dsv4_head_dim=512,
    dsv4_index_head_dim=128, index_row_bytes=128 + 4, dsv4_draft_layers=1,
)
LLAMA = ModelShape(
    # Llama-3.1-70B: 80 layers, GQA 8 KV heads x 128, bf16.
    name="llama", layers=(LayerKind.ATTN,) * 80, kv_heads=8, head_dim=128,
)
JAMBA = ModelShape(
    # Jamba-v0.1 (52B): 32 layers, attention at i % 8 == 4, Mamba1 elsewhere (MoE every
    # other layer: no state); d_inner = 2 x 4096, d_state 16, d_conv 4; GQA 8 KV heads x 128.
    name="jamba",
    layers=tuple(LayerKind.ATTN if i % 8 == 4 else LayerKind.MAMBA1 for i in range(32)),
    kv_heads=8, head_dim=128, mamba_intermediate=8192, mamba_state=16, conv_kernel=4,
)
KIMI_LINEAR = ModelShape(
    # Kimi-Linear-48B-A3B: 27 layers, KDA (32 heads x 128) with MLA at layers 3, 7, ... 23, 26.
    name="kimi_linear",
    layers=tuple(
        LayerKind.MLA if i in (3, 7, 11, 15, 19, 23, 26) else LayerKind.KDA for i in range(27)
    ),
    mla_row_bytes=(512 + 64) * 2,
    linear_k_heads=32, linear_k_dim=128, linear_v_heads=32, linear_v_dim=128, conv_kernel=4,
)
LFM2 = ModelShape(
    # LFM2-1.2B: 16 layers, full attention at 2, 5, 8, 10, 12, 14 (GQA 8 KV heads x 64),
    # short convolutions elsewhere: a conv_L_cache 3 window over the 2048 hidden channels.
    name="lfm2",
    layers=tuple(LayerKind.ATTN if i in (2, 5, 8, 10, 12, 14) else LayerKind.SHORT_CONV
                 for i in range(16)),
    kv_heads=8, head_dim=64, short_conv_channels=2048, short_conv_kernel=3,
)
_GEMMA4_FULL = tuple(range(5, 30, 6))
GEMMA4 = ModelShape(
    # Gemma 4 (transformers' default Gemma4TextConfig): 30 layers, every sixth full
    # attention with head_dim 512, sliding-window (512) layers with head_dim 256; 4 KV heads.
    name="gemma4",
    layers=tuple(LayerKind.ATTN if i in _GEMMA4_FULL else LayerKind.SWA for i in range(30)),
    kv_heads=4, head_dim=256, sliding_window=512,
    kv_groups=(KVGroup(layers=_GEMMA4_FULL, kv_heads=4, head_dim=512),),
)
_MIMO_FULL = (0, *range(5, 48, 6))
MIMO_V2_FLASH = ModelShape(
    # MiMo-V2-Flash: 48 layers, full attention at 0, 5, 11, ... 47 with 4 KV heads,
    # sliding-window (128) layers with 8; K head dim 192, V head dim 128.
    name="mimo_v2_flash",
    layers=tuple(LayerKind.ATTN if i in _MIMO_FULL else LayerKind.SWA for i in range(48)),
    kv_heads=8, head_dim=192, v_head_dim=128, sliding_window=128,
    kv_groups=(KVGroup(layers=_MIMO_FULL, kv_heads=4, head_dim=192, v_head_dim=128),),
)
_INKLING_FULL = tuple(range(5, 66, 6))
INKLING = ModelShape(
    # Inkling (transformers' default InklingTextConfig): 66 layers, every sixth full
    # attention (8 KV heads x 128), sliding-window (512) layers with 16 KV heads x 128;
    # every layer also keeps four short convolutions (kernel 4): over its K and V
    # projections (head-sharded) and over the 6144-wide residual stream twice (replicated).
    name="inkling",
    layers=tuple(LayerKind.ATTN_SHORT_CONV if i in _INKLING_FULL else LayerKind.SWA_SHORT_CONV
                 for i in range(66)),
    kv_heads=16, head_dim=128, sliding_window=512,
    kv_groups=(KVGroup(layers=_INKLING_FULL, kv_heads=8, head_dim=128),),
    layer_convs=(LayerConv(name="conv0", input=ConvInput.KEYS, kernel=4),
                 LayerConv(name="conv1", input=ConvInput.VALUES, kernel=4),
                 LayerConv(name="conv2", input=ConvInput.HIDDEN, kernel=4),
                 LayerConv(name="conv3", input=ConvInput.HIDDEN, kernel=4)),
    hidden_size=6144,
)

SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (QWEN3_NEXT, NEMOTRON_H, GPT_OSS, DEEPSEEK_V32, DEEPSEEK_V4, LLAMA, KIMI_LINEAR,
              JAMBA, LFM2, GEMMA4, MIMO_V2_FLASH, INKLING)
}


def get(name: str) -> ModelShape:
    """The named shape; raises KeyError listing the known names."""
    try:
        return SHAPES[name]
    except KeyError:
        raise KeyError(f"unknown model shape {name!r}; known: {sorted(SHAPES)}") from None


def tiny(shape: ModelShape, *, num_layers: int | None = None) -> ModelShape:
    """A small version of ``shape`` with the same structure.

    Keeps the shortest prefix of the layer pattern that has every layer kind (at
    least 4 layers, an even count so PP 2 splits it), head counts up to 8 (so GQA
    replication at TP 4/8 stays what it is: 2 KV heads stay 2), and shrinks head
    and state dims to a few elements. ``num_layers`` overrides the layer count.
    """
    kinds = set(shape.layers)
    n = 0
    while set(shape.layers[:n]) != kinds:
        n += 1
    n = max(n, 4)
    n += n % 2
    if num_layers is not None:
        n = num_layers
    layers = tuple(shape.layers[i % shape.num_layers] for i in range(n))

    def heads(h: int) -> int:
        return min(h, 8)

    def dim(d: int, small: int) -> int:
        return min(d, small) if d else 0

    def head(d: int) -> int:  # a head dim, keeping its ratio to the default head_dim
        return max(1, round(dim(shape.head_dim, 8) * d / shape.head_dim)) if d else 0

    return replace(
        shape,
        name=f"tiny_{shape.name}",
        layers=layers,
        kv_heads=heads(shape.kv_heads),
        head_dim=dim(shape.head_dim, 8),
        v_head_dim=head(shape.v_head_dim),
        kv_groups=tuple(replace(g, layers=kept, kv_heads=heads(g.kv_heads),
                                head_dim=head(g.head_dim), v_head_dim=head(g.v_head_dim))
                        for g in shape.kv_groups
                        if (kept := tuple(i for i in range(n)
                                          if i % shape.num_layers in g.layers))),
        sliding_window=dim(shape.sliding_window, 16),
        mla_row_bytes=dim(shape.mla_row_bytes, 40),
        index_row_bytes=dim(shape.index_row_bytes, 12),
        index_elided_layers=tuple(i for i in shape.index_elided_layers if i < n),
        linear_k_heads=heads(shape.linear_k_heads),
        linear_k_dim=dim(shape.linear_k_dim, 4),
        linear_v_heads=min(shape.linear_v_heads, 16),
        linear_v_dim=dim(shape.linear_v_dim, 4),
        mamba_intermediate=dim(shape.mamba_intermediate, 16),
        mamba_heads=heads(shape.mamba_heads),
        mamba_head_dim=dim(shape.mamba_head_dim, 4),
        mamba_groups=heads(shape.mamba_groups),
        mamba_state=dim(shape.mamba_state, 4),
        short_conv_channels=dim(shape.short_conv_channels, 16),
        hidden_size=dim(shape.hidden_size, 16),
        dsv4_kv_row_bytes=dim(shape.dsv4_kv_row_bytes, 24),
        dsv4_head_dim=dim(shape.dsv4_head_dim, 4),
        dsv4_index_head_dim=dim(shape.dsv4_index_head_dim, 2),
        aux_row_bytes=64,
    )


# ---------------------------------------------------------------------------------------
# Layouts


class FakeAllocator:
    """Deterministic bump allocator of aligned fake addresses; allocates nothing."""

    def __init__(self, base: int = 1 << 44, align: int = 4096) -> None:
        self.next = base
        self.align = align

    def __call__(self, nbytes: int) -> int:
        ptr = self.next
        self.next += -(-max(nbytes, 1) // self.align) * self.align
        return ptr


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The contiguous half-open layer range PP stage ``pp_rank`` of ``pp_size`` owns."""
    if not 0 <= pp_rank < pp_size:
        raise LayoutError(f"pp_rank {pp_rank} is outside PP size {pp_size}")
    if pp_size > num_layers:
        raise LayoutError(f"PP {pp_size} exceeds the model's {num_layers} layers")
    return pp_rank * num_layers // pp_size, (pp_rank + 1) * num_layers // pp_size


def dsv4_ring_size(spec_decode: bool) -> int:
    """Rows of the page-scoped C4 compress-state ring (8, or 16 with speculative decoding)."""
    return 16 if spec_decode else 8


def _check_sizes(shape: ModelShape, page_size: int, num_pages: int, num_slots: int) -> None:
    """Refuse sizes no layout of ``shape`` can have (naming them)."""
    if min(page_size, num_pages, num_slots) < 1:
        raise LayoutError(
            f"page_size, num_pages and num_slots must be >= 1, got {page_size}, {num_pages}, "
            f"{num_slots}"
        )
    if shape.has(*_DSV4) and page_size % 128:
        raise LayoutError(
            f"{shape.name}: page_size {page_size} must be a multiple of 128 (a DeepSeek-V4 "
            f"logical page holds whole C4 and C128 compressed rows)"
        )


def layout_for(
    shape: ModelShape,
    *,
    tp_rank: int,
    tp_size: int,
    page_size: int,
    num_pages: int,
    num_slots: int,
    pp_rank: int = 0,
    pp_size: int = 1,
    alloc: Alloc | None = None,
    num_swa_pages: int | None = None,
    swa_page_size: int | None = None,
    spec_decode: bool = False,
) -> Layout:
    """What TP rank ``tp_rank`` of PP stage ``pp_rank`` registers for ``shape``.

    ``num_pages`` pages of ``page_size`` tokens in the full-attention / MLA / indexer
    pools (``num_swa_pages``, default the same, in the SWA pool), ``num_slots``
    request slots (Mamba slots, request rows, aux rows, DSv4 rings). DeepSeek-V4 needs
    ``page_size`` to be a multiple of 128 (its logical page holds whole compressed
    rows); its SWA pages hold ``swa_page_size`` tokens (default 64, or ``page_size``
    when smaller) and ``spec_decode`` doubles its compress-state rings (8 -> 16).
    """
    _check_sizes(shape, page_size, num_pages, num_slots)
    base = (1 << 44) + ((pp_rank * tp_size + tp_rank) << 38)
    mem = alloc if alloc is not None else FakeAllocator(base=base)
    lo, hi = stage_layers(shape.num_layers, pp_rank, pp_size)
    last = pp_rank == pp_size - 1
    mine = range(lo, hi)
    b = _Builder(shape, mem, tp_rank, tp_size)
    comps: list[Component] = []
    swa_pages = num_swa_pages if num_swa_pages is not None else num_pages
    if shape.has(*_DSV4):
        sp = swa_page_size if swa_page_size is not None else min(64, page_size)
        comps += b.dsv4(mine, last, page_size, num_pages, sp, swa_pages, num_slots, spec_decode)

    def add(kind: StateType, name: str, build: Callable[[], list[TensorSpec]]) -> None:
        b.component = name  # what a refusal while building it names
        comps.append(Component(type=kind, name=name, tensors=tuple(build())))

    if shape.has(*_MHA):
        add(StateType.KV, "kv", lambda: b.mha(shape.layer_ids(*_MHA), mine, page_size, num_pages))
    if shape.has(LayerKind.MLA):
        add(StateType.MLA, "kv",
            lambda: b.mla(shape.layer_ids(LayerKind.MLA), mine, page_size, num_pages))
        if shape.index_row_bytes:
            add(StateType.NSA, "nsa", lambda: b.nsa(mine, page_size, num_pages))
    if shape.has(*_SWA):
        add(StateType.SWA, "swa", lambda: b.mha(shape.layer_ids(*_SWA), mine, page_size, swa_pages))
    if shape.has(*_LINEAR):
        add(StateType.MAMBA, "mamba", lambda: b.mamba(mine, num_slots))
    if shape.has(LayerKind.SHORT_CONV, *_CONV_BANK):
        add(StateType.SHORT_CONV, "short_conv", lambda: b.short_conv(mine, num_slots))
    add(StateType.AUX, "aux", lambda: [b.tensor("aux", NO_LAYER, shape.aux_row_bytes, num_slots)])
    return Layout(
        page_size=page_size, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
        layers=(lo, hi + (shape.dsv4_draft_layers if last else 0)), components=tuple(comps),
        identity=_identity(shape), model=shape.name,
    )


def _identity(shape: ModelShape) -> tuple[tuple[str, str], ...]:
    """What the two sides must share that no tensor's geometry shows: the sliding window
    decides which pages each side's window list names (lists of windows that differ pair
    the wrong pages), so the handshake compares it (:attr:`Layout.identity`)."""
    if shape.sliding_window and shape.has(*_SWA, *_DSV4):
        return (("sliding_window", str(shape.sliding_window)),)
    return ()


def _some(layers: list[int]) -> str:
    """Layer ids for a message: all of a few, else the first ones and the count."""
    if len(layers) <= 4:
        return ", ".join(map(str, layers))
    return f"{layers[0]}, {layers[1]}, … {layers[-1]} ({len(layers)} layers)"


def _dtype(nbytes: int) -> str:
    return {1: "fp8", 2: "bf16", 4: "fp32"}.get(nbytes, f"{nbytes}B")


class _Builder:
    def __init__(self, shape: ModelShape, alloc: Alloc, tp_rank: int, tp_size: int) -> None:
        self.s = shape
        self.alloc = alloc
        self.tp = (tp_rank, tp_size)
        self.component = ""  # the component being built, for refusals

    def refuse(self, what: str) -> LayoutError:
        """A refusal naming the model, the component being built, and ``what``."""
        return LayoutError(f"{self.s.name}: component {self.component!r}: {what}")

    def tensor(
        self, name: str, layer: int, item: int, capacity: int, *, rows: int = 1,
        kind: RowKind = RowKind.ITEM, shard: ShardSpec | None = None, dtype: str = "uint8",
    ) -> TensorSpec:
        if shard is not None:
            try:
                item = shard.local_item_bytes(*self.tp)
            except LayoutError as e:
                raise self.refuse(f"tensor {name!r} (layer {layer}) at TP rank {self.tp[0]} "
                                  f"of {self.tp[1]}: {e}") from None
        nbytes = item * capacity
        return TensorSpec(
            name=name, layer_id=layer, ptr=self.alloc(nbytes) if nbytes else 0, nbytes=nbytes,
            item_bytes=item, rows=rows, row_kind=kind, shard=shard, dtype=dtype,
        )

    def mha(self, layers: tuple[int, ...], mine: range, page: int, pages: int
            ) -> list[TensorSpec]:
        """K then V of every layer: NHD pages, head-sharded (GQA-replicated past the heads)."""
        s = self.s

        def shard(name: str, layer: int) -> ShardSpec:
            heads, kd, vd = s.kv_geometry(layer)
            return ShardSpec.axis(outer=page, axis=heads,
                                  inner_bytes=(kd if name == "k" else vd) * s.kv_dtype_bytes,
                                  labels=("KV heads",))

        return [self.tensor(n, layer, 0, pages, rows=page, kind=RowKind.TOKEN,
                            shard=shard(n, layer), dtype=_dtype(s.kv_dtype_bytes))
                for n in ("k", "v") for layer in layers if layer in mine]

    def mla(self, layers: tuple[int, ...], mine: range, page: int, pages: int
            ) -> list[TensorSpec]:
        return [self.tensor("kv", layer, page * self.s.mla_row_bytes, pages, rows=page,
                            kind=RowKind.TOKEN, dtype="bf16")
                for layer in layers if layer in mine]

    def nsa(self, mine: range, page: int, pages: int) -> list[TensorSpec]:
        """One opaque indexer page per MLA layer: fp8 keys, then fp32 scales."""
        out = []
        for layer in self.s.layer_ids(LayerKind.MLA):
            if layer not in mine:
                continue
            if layer in self.s.index_elided_layers:
                out.append(TensorSpec(name="index_k", layer_id=layer, ptr=0, nbytes=0,
                                      item_bytes=0))
            else:
                out.append(self.tensor("index_k", layer, page * self.s.index_row_bytes, pages))
        return out

    def mamba(self, mine: range, slots: int) -> list[TensorSpec]:
        """All conv slots, then all SSM slots (sglang's tensor-major order)."""
        s = self.s
        layers = [i for i in s.layer_ids(*_LINEAR) if i in mine]
        rows, c, labels = s.conv_kernel - 1, s.conv_dtype_bytes, s.conv_labels
        conv = (conv_shard(s.conv_split, channel_bytes=c, outer_rows=rows,  # (K-1, channels)
                           labels=labels)
                if s.has(LayerKind.KDA)
                else conv_shard(s.conv_split, channel_bytes=rows * c, labels=labels))
        tp = self.tp[1]
        if s.has(*_M2) and tp > s.mamba_groups:
            raise self.refuse(
                f"Mamba2 layers {_some(layers)}: TP {tp} exceeds the {s.mamba_groups} B/C "
                f"groups of the conv [x | B | C]; padded, replicated groups are not modelled")
        if s.has(LayerKind.GDN) and (s.linear_k_heads % tp or s.linear_v_heads % tp):
            # vLLM and SGLang run num_heads / TP whole heads per rank (sglang's CPU path
            # pads the heads instead): none cuts a key head's channels across ranks
            raise self.refuse(
                f"gated delta net layers {_some(layers)}: {s.linear_k_heads} key heads and "
                f"{s.linear_v_heads} value heads do not split into whole heads over TP {tp} "
                f"(key heads % TP = {s.linear_k_heads % tp}, value heads % TP = "
                f"{s.linear_v_heads % tp}); vLLM and SGLang shard the conv's q | k | v and "
                f"the SSM state by whole heads, so no engine keeps a state split this way")
        ssm = ssm_shard(s.ssm_heads, s.ssm_head_bytes,
                        "d_inner rows" if s.has(*_M1) else "SSM heads")
        return ([self.tensor("conv", i, 0, slots, shard=conv, dtype=_dtype(s.conv_dtype_bytes))
                 for i in layers]
                + [self.tensor("ssm", i, 0, slots, shard=ssm, dtype=_dtype(s.ssm_dtype_bytes))
                   for i in layers])

    def short_conv(self, mine: range, slots: int) -> list[TensorSpec]:
        """One conv slot per short-conv layer: ``[channels, K-1]``, sharded by channel
        (each rank convolves its slice of the hidden channels); then every
        :class:`LayerConv` slot of the attention + short-conv layers, sharded by what it
        convolves (its layer's K or V heads, or replicated over the hidden stream)."""
        s = self.s
        dtype = _dtype(s.conv_dtype_bytes)
        out = []
        if s.has(LayerKind.SHORT_CONV):
            conv = ShardSpec.axis(axis=s.short_conv_channels,
                                  inner_bytes=(s.short_conv_kernel - 1) * s.conv_dtype_bytes,
                                  labels=("conv channels",))
            out += [self.tensor("conv", i, 0, slots, shard=conv, dtype=dtype)
                    for i in s.layer_ids(LayerKind.SHORT_CONV) if i in mine]
        for c in s.layer_convs:  # tensor-major, like the mamba component
            width = (c.kernel - 1) * s.conv_dtype_bytes
            for i in s.layer_ids(*_CONV_BANK):
                if i not in mine:
                    continue
                if c.input is ConvInput.HIDDEN:
                    out.append(self.tensor(c.name, i, s.hidden_size * width, slots, dtype=dtype))
                    continue
                heads, kd, vd = s.kv_geometry(i)
                shard = ShardSpec.axis(axis=heads, inner_bytes=(
                    kd if c.input is ConvInput.KEYS else vd) * width, labels=("KV heads",))
                out.append(self.tensor(c.name, i, 0, slots, shard=shard, dtype=dtype))
        return out

    def dsv4(
        self, mine: range, last: bool, page: int, pages: int, swa_page: int, swa_pages: int,
        slots: int, spec: bool,
    ) -> list[Component]:
        s = self.s
        row = s.dsv4_kv_row_bytes
        c4 = [i for i in s.layer_ids(LayerKind.DSV4_C4) if i in mine]
        c128 = [i for i in s.layer_ids(LayerKind.DSV4_C128) if i in mine]
        every = [i for i in range(s.num_layers) if i in mine]
        # compressed KV, per ratio: C4 KV, C4 indexer, C128 KV (one logical page each)
        kv = ([self.tensor("kv", i, page // 4 * row, pages, rows=page // 4, kind=RowKind.TOKEN,
                           dtype="fp8_ds_mla") for i in c4]
              + [self.tensor("index_k", i, page // 4 * s.index_row_bytes, pages, rows=page // 4,
                             kind=RowKind.TOKEN, dtype="fp8_index") for i in c4]
              + [self.tensor("kv", i, page // 128 * row, pages, rows=page // 128,
                             kind=RowKind.TOKEN, dtype="fp8_ds_mla") for i in c128])
        # SWA KV pages of every layer + page-scoped C4 compress and indexer-compress rings
        ring = dsv4_ring_size(spec)
        swa = ([self.tensor("swa_kv", i, swa_page * row, swa_pages, rows=swa_page,
                            kind=RowKind.TOKEN, dtype="fp8_ds_mla") for i in every]
               + [self.tensor("c4_state", i, ring * s.dsv4_c4_state_row_bytes, swa_pages,
                              rows=ring, kind=RowKind.RING, dtype="fp32") for i in c4]
               + [self.tensor("c4_index_state", i, ring * s.dsv4_c4_index_state_row_bytes,
                              swa_pages, rows=ring, kind=RowKind.RING, dtype="fp32")
                  for i in c4])
        # the NextN draft layers' unified SWA ring: one token row per item
        draft = range(s.num_layers, s.total_layers) if last else range(0)
        ring_t = [self.tensor("swa_ring", i, row, slots * s.sliding_window, dtype="fp8_ds_mla")
                  for i in draft]
        c128_state = [self.tensor("c128_state", i, s.dsv4_c128_state_bytes, slots, dtype="fp32")
                      for i in c128]
        valid = [self.tensor("swa_valid_from", NO_LAYER, 8, slots, dtype="int64")]
        out = [Component(type=StateType.MLA, name="kv", tensors=tuple(kv)),
               Component(type=StateType.DSV4_SWA, name="swa", tensors=tuple(swa))]
        if s.dsv4_draft_layers:
            out.append(Component(type=StateType.DSV4_RING, name="swa_ring",
                                 tensors=tuple(ring_t)))
        out += [Component(type=StateType.DSV4_REQUEST, name="c128_state",
                          tensors=tuple(c128_state)),
                Component(type=StateType.REQUEST_ROW, name="swa_valid_from",
                          tensors=tuple(valid))]
        return out


# ---------------------------------------------------------------------------------------
# Requests

_PAGE_TYPES = (StateType.KV, StateType.MLA, StateType.NSA)
_SLOT_TYPES = (StateType.MAMBA, StateType.SHORT_CONV, StateType.REQUEST_ROW, StateType.AUX)


def request_for(
    shape: ModelShape,
    src: Layout,
    dst: Layout,
    num_tokens: int,
    *,
    prefix_len: int = 0,
    seed: int = 0,
    contiguous: bool = False,
    src_slot: int | None = None,
    dst_slot: int | None = None,
) -> dict[str, Indices | None]:
    """Indices of every component of ``src``/``dst`` for a sequence of ``num_tokens``.

    Page ids are ``1..n`` (``contiguous``) or a seeded random choice from each
    side's pool (page 0 is left as padding). The decode prefix ``prefix_len`` tokens
    are already on decode (a multiple of decode's page size). Page sizes may differ
    between the sides for MHA / MLA / SWA pages: the token rows then move by row.
    The choice depends only on ``seed``, the side and the pool, so every PP stage
    of one prefill gets the same page ids and slot.
    """
    if num_tokens < 0 or not 0 <= prefix_len <= num_tokens:
        raise ValueError(f"need 0 <= prefix_len <= num_tokens, got {prefix_len}, {num_tokens}")
    if prefix_len % dst.page_size:
        raise ValueError(f"prefix_len {prefix_len} is not a multiple of decode's page size "
                         f"{dst.page_size}")
    n = num_tokens
    sides = (_Side(src, 0, seed, contiguous, src_slot), _Side(dst, 1, seed, contiguous, dst_slot))
    out: dict[str, Indices | None] = {}
    dst_types = {c.name: c.type for c in dst.components}
    for comp in src.components:
        if dst_types.get(comp.name, comp.type) is not comp.type:
            raise ValueError(f"component {comp.name!r} has different types on the two sides")
        t = comp.type
        if t in _PAGE_TYPES:
            if (t is StateType.NSA or shape.has(*_DSV4)) and src.page_size != dst.page_size:
                raise ValueError(f"component {comp.name!r} ({t.value}) needs equal page sizes "
                                 f"on both sides, got {src.page_size} and {dst.page_size}")
            out[comp.name] = _token_span(sides, "kv", prefix_len, n,
                                         src.page_size, dst.page_size)
        elif t is StateType.SWA:
            out[comp.name] = _window(sides, shape.sliding_window, prefix_len, n,
                                     src.page_size, dst.page_size)
        elif t is StateType.DSV4_SWA:
            out[comp.name] = _dsv4_swa(sides, comp.name, shape.sliding_window, prefix_len, n)
        elif t is StateType.DSV4_RING:
            ring = shape.sliding_window
            pos = np.arange(max(0, n - ring), n)
            out[comp.name] = Indices(sides[0].slot * ring + pos % ring,
                                     sides[1].slot * ring + pos % ring)
        elif t is StateType.DSV4_REQUEST:
            pending = n % 128 != 0
            out[comp.name] = Indices([sides[0].slot] if pending else [],
                                     [sides[1].slot] if pending else [])
        elif t in _SLOT_TYPES:
            out[comp.name] = Indices([sides[0].slot], [sides[1].slot])
        else:  # pragma: no cover - every StateType above is handled
            raise ValueError(f"request_for does not know state type {t.value}")
    return out


def _dsv4_swa(sides: tuple[_Side, _Side], name: str, window: int, prefix_len: int,
              n: int) -> Indices:
    """A DeepSeek-V4 SWA component's indices: the window's pages (equal page sizes on
    both sides) and the C4 compressor's live positions."""
    ps, pd = (_swa_page(s.layout, name) for s in sides)
    if ps != pd:
        raise ValueError(f"DeepSeek-V4 SWA pages differ ({ps} vs {pd} tokens)")
    win = _window(sides, window, prefix_len, n, ps, pd)
    lo = max(0, n - (n % 4 + 4))  # the C4 compressor's live positions
    return Indices(win.src, win.dst, positions=np.arange(lo, n))


class _Side:
    def __init__(self, layout: Layout, side: int, seed: int, contiguous: bool,
                 slot: int | None) -> None:
        self.layout = layout
        self.side = side
        self.seed = seed
        self.contiguous = contiguous
        slots = _capacity(layout, _SLOT_TYPES) or 2
        if slot is None:
            rng = np.random.default_rng([seed, side, 0])
            slot = int(rng.integers(1, slots)) if slots > 1 else 0
        if not 0 <= slot < slots:
            raise ValueError(f"slot {slot} is outside the {slots} request slots")
        self.slot = slot

    def pages(self, pool: str, count: int) -> np.ndarray:
        """``count`` page ids of ``pool`` (same ids for the same seed, side and pool)."""
        cap = _capacity(self.layout, _POOL_TYPES[pool]) or count + 1
        if count + 1 > cap:
            raise ValueError(f"{count} pages do not fit a {pool} pool of {cap} (page 0 is padding)")
        if self.contiguous:
            return np.arange(1, count + 1, dtype=np.int64)
        rng = np.random.default_rng([self.seed, self.side, 1 + list(_POOL_TYPES).index(pool)])
        return rng.permutation(cap - 1)[:count].astype(np.int64) + 1


_POOL_TYPES: dict[str, tuple[StateType, ...]] = {
    "kv": _PAGE_TYPES,
    "swa": (StateType.SWA, StateType.DSV4_SWA),
}


def _capacity(layout: Layout, types: tuple[StateType, ...]) -> int:
    caps = [t.capacity for c in layout.components if c.type in types
            for t in c.tensors if t.capacity and t.row_kind is not RowKind.RING]
    return min(caps) if caps else 0


def _swa_page(layout: Layout, name: str) -> int:
    rows = [t.rows for t in layout.component(name).tensors if t.row_kind is RowKind.TOKEN]
    return rows[0] if rows else layout.page_size


def _token_span(sides: tuple[_Side, _Side], pool: str, start: int, end: int, ps: int, pd: int
                ) -> Indices:
    """Pages holding tokens ``[start, end)`` on each side, by row when pages differ."""
    first = [start // p * p for p in (ps, pd)]
    lists = [s.pages(pool, math.ceil(end / p) - f // p if end > f else 0)
             for s, f, p in zip(sides, first, (ps, pd), strict=True)]
    if ps == pd and first[0] == first[1] == start:
        return Indices(lists[0], lists[1])
    return Indices(lists[0], lists[1], src_first_row=start - first[0],
                   dst_first_row=start - first[1], num_rows=end - start)


def _window(sides: tuple[_Side, _Side], window: int, prefix: int, end: int, ps: int, pd: int
            ) -> Indices:
    """Window pages from ``page_floor(max(prefix, end - window))`` on each side; with
    unequal pages, the rows both windows hold."""
    starts = [max(prefix, end - window) // p * p for p in (ps, pd)]
    return _token_span(sides, "swa", max(starts), end, ps, pd)
