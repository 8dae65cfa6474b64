"""What a Hugging Face model keeps per request, as a kvhandoff ``ModelShape`` plus codecs.

:func:`describe` runs the model once on a few tokens and looks at the cache it builds
(handed over as ``past_key_values`` or, for attention-free SSMs such as Mamba, as
``cache_params``: whichever keyword the model's forward takes, :func:`cache_keyword`):
each cache layer's *kind* picks a codec (:mod:`kvhandoff.lab.engine.codecs`), and the
tensors' shapes give the dimensions. The one piece of family knowledge is how a
linear-attention conv's channels split into independently sharded sub-blocks, read from
the family's config (:mod:`kvhandoff.sharding`'s spelling tables) and checked against
the cache: delta nets (gated: Qwen3-Next, Qwen3.5, OLMo-hybrid; Kimi: Kimi-Linear,
Bailing-hybrid) use ``[q | k | v]`` with q and k of the key heads and v of the value heads
(unequal blocks in general); Mamba2 mixers use ``[x | B | C]`` with B and C of the
config's groups; Mamba1 mixers (a 3-D recurrent state
``[d_inner, d_state]``: Jamba, Mamba, Falcon-Mamba; or a 4-D one cut into heads whose
conv holds ``x`` alone: Zamba) have one channel axis ``d_inner``, which also indexes the
SSM state; short convolutions (a conv state and no recurrent state: LFM2) have one
channel axis, the hidden size; the short convolutions an attention layer keeps beside its
K/V (Inkling) run over K, V or the residual stream, told apart by channel count.
Everything else is read off the cache, so a new family built from the same cache-layer
kinds needs no code here.

Attention layers need not agree on their K/V shape: each layer's KV heads and K / V head
dims are recorded, and layers of another shape than the first become a
:class:`~kvhandoff.lab.shapes.KVGroup` (Gemma 4's 512-dim full layers, MiMo-V2-Flash's full
layers with fewer KV heads and V heads narrower than K).

Kinds: full / sliding attention, MLA (+ DSA indexer), linear attention (GDN, Mamba2,
Mamba1), short convolutions, ``"hybrid"`` layers holding attention K/V and a Mamba2 or
Mamba1 slot at once (Falcon-H1, Zamba), ``"hybrid"`` / ``"hybrid_sliding"`` layers
holding full / sliding attention and short convolutions (Inkling), DeepSeek-V4's
compressed kinds, and dummy layers.

The result drives :func:`kvhandoff.lab.shapes.layout_for`: the engine's pools are laid out
exactly as the library's named shapes describe real deployments (sglang's pools).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from kvhandoff.errors import LayoutError
from kvhandoff.lab.engine.codecs import (
    AttentionCodec,
    ConvSlot,
    DeepseekV4Codec,
    HybridCodec,
    LatentCodec,
    LayerCodec,
    LinearCodec,
    ShortConvCodec,
)
from kvhandoff.lab.shapes import ConvInput, KVGroup, LayerConv, LayerKind, ModelShape
from kvhandoff.sharding import DELTA_NET_DIMS, MAMBA2_GROUPS, delta_net_dims, mamba2_groups

_PROBE_TOKENS = 8
_DSV4_KINDS = ("compressed_sparse_attention", "heavily_compressed_attention")
_C4_STATE_REACH = 2 * 4 - 1  # a C4 compressor's pending group plus its last full one


@dataclass(frozen=True, slots=True)
class Arch:
    """A model's per-request state: the shape the pools follow and one codec per layer."""

    name: str
    shape: ModelShape
    codecs: tuple[LayerCodec | None, ...]  # None: the layer keeps nothing (MLP / MoE)
    window: int  # sliding window in tokens (0: none)
    dsv4: bool

    @property
    def swa_span(self) -> int:
        """Positions below the sequence end the SWA pool keeps, and a handoff moves the
        pages of: the window, widened for DeepSeek-V4's C4 layers to the
        ``2 * 4 - 1`` positions their compressor state reaches back
        (:func:`~kvhandoff.indices.compress_state_positions`). That state lives in the
        SWA page of its position (sglang's page-scoped rings), so a window narrower
        than its reach would evict it while a decoder still needs it."""
        if LayerKind.DSV4_C4 in self.shape.layers:
            return max(self.window, _C4_STATE_REACH)
        return self.window

    @property
    def layer_codecs(self) -> tuple[LayerCodec, ...]:
        return tuple(c for c in self.codecs if c is not None)


def _kind(cache_layer: Any) -> str:
    """The cache-layer kind, by class hierarchy (hybrid classes subclass two kinds)."""
    names = {c.__name__ for c in type(cache_layer).__mro__}
    compressed = getattr(cache_layer, "_layer_type", "")
    if compressed in _DSV4_KINDS:
        return str(compressed)
    if "LinearAttentionCacheLayerMixin" in names and "DynamicSlidingWindowLayer" in names:
        return "hybrid_sliding"
    if "LinearAttentionCacheLayerMixin" in names and "DynamicLayer" in names:
        return "hybrid"
    for kind in ("LinearAttentionLayer", "DynamicIndexedLayer", "DynamicSlidingWindowLayer",
                 "DynamicLayer", "DummyLayer"):
        if kind in names:
            return kind
    return type(cache_layer).__name__


def cache_keyword(model: PreTrainedModel) -> str:
    """The keyword ``model``'s forward takes its cache by: ``past_key_values`` (attention
    and hybrid models) or ``cache_params`` (attention-free SSMs: Mamba, Mamba2,
    Falcon-Mamba). Read off the signature, so any family taking either one works; a
    cache passed by the wrong name would land in ``**kwargs`` and stay empty."""
    params = inspect.signature(model.forward).parameters
    kw = next((k for k in ("past_key_values", "cache_params") if k in params), None)
    if kw is None:
        raise LayoutError(f"{type(model).__name__}.forward takes no cache (neither "
                          f"past_key_values nor cache_params); the engine cannot hand it off")
    return kw


def forward(model: PreTrainedModel, ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """Logits of the last position after feeding ``ids`` (``[1, n]``) into ``cache``
    (no gradients)."""
    with torch.no_grad():
        out = model(ids, use_cache=True, **{cache_keyword(model): cache})
    logits: torch.Tensor = out.logits[0, -1]
    return logits


def describe(model: PreTrainedModel, name: str = "") -> Arch:
    """Probe ``model`` (one forward of a few tokens, no gradients) and describe its state.

    Raises :class:`~kvhandoff.errors.LayoutError` naming the layer for a cache-layer kind
    the engine has no codec for (e.g. sliding-window attention and a linear state in one
    layer: ``kvhandoff.lab.shapes`` has no layer kind for it).
    """
    cfg = model.config.get_text_config(decoder=True)
    cache = DynamicCache(config=model.config)
    forward(model, torch.zeros((1, _PROBE_TOKENS), dtype=torch.long), cache)
    kinds = [_kind(layer) for layer in cache.layers]
    dsv4 = any(k in _DSV4_KINDS for k in kinds)
    b = _ShapeBuilder(name or cfg.model_type)
    codecs: list[LayerCodec | None] = []
    for i, (kind, layer) in enumerate(zip(kinds, cache.layers, strict=True)):
        codecs.append(b.layer(i, kind, layer, cfg, dsv4=dsv4, mla=_is_mla(cfg, i)))
    return Arch(name=b.name, shape=b.shape(), codecs=tuple(codecs), window=b.window, dsv4=dsv4)


def _short_conv(layer: Any) -> bool:
    """A short-convolution mixer's layer (LFM2): one conv state and no recurrent state."""
    return bool(layer.number_of_states == 1 and layer.conv_states[0] is not None
                and layer.recurrent_states[0] is None)


def _conv_only(layer: Any) -> bool:
    """A linear-attention cache layer whose every state is a conv window and none a
    recurrent state (Inkling's short convolutions beside its attention)."""
    return all(layer.conv_states[j] is not None and layer.recurrent_states[j] is None
               for j in range(layer.number_of_states))


def _is_mla(cfg: Any, i: int) -> bool:
    """Whether layer ``i`` keeps an MLA latent (a ``kv_lora_rank`` is set). A config whose
    layers differ (transformers' heterogeneous configs) refuses the global read with a
    ``RuntimeError``: then the layer's own config (``per_layer_config[i]``) says."""
    try:
        return getattr(cfg, "kv_lora_rank", None) is not None
    except RuntimeError:
        return getattr(cfg.per_layer_config[i], "kv_lora_rank", None) is not None


class _ShapeBuilder:
    """Accumulates ModelShape fields while codecs are chosen layer by layer."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.kinds: list[LayerKind] = []
        self.fields: dict[str, Any] = {}
        self.window = 0
        self.kv_geometry: dict[int, tuple[int, int, int]] = {}  # layer -> (heads, k, v dim)

    def _set(self, **values: Any) -> None:
        for k, v in values.items():
            if self.fields.setdefault(k, v) != v:
                raise LayoutError(f"{self.name}: layers disagree on {k} "
                                  f"({self.fields[k]} vs {v}); one pool shape per model")

    def layer(self, i: int, kind: str, layer: Any, cfg: Any, *, dsv4: bool, mla: bool
              ) -> LayerCodec | None:
        if kind == "DummyLayer":
            self.kinds.append(LayerKind.MLP)
            return None
        if dsv4:
            return self._dsv4(i, kind, layer, cfg)
        if kind in ("DynamicLayer", "DynamicIndexedLayer") and mla:
            return self._latent(i, layer, indexed=kind == "DynamicIndexedLayer")
        if kind == "DynamicSlidingWindowLayer" and mla:
            raise LayoutError(f"{self.name} layer {i}: a sliding-window MLA layer (a windowed "
                              f"latent); the model catalogue has MLA pages for full attention only")
        if kind in ("DynamicLayer", "DynamicSlidingWindowLayer"):
            window = int(layer.sliding_window) if kind == "DynamicSlidingWindowLayer" else None
            self.kinds.append(LayerKind.SWA if window else LayerKind.ATTN)
            return self._attention(i, layer, window)
        if kind == "LinearAttentionLayer" and _short_conv(layer):
            return self._short_conv(i, layer)
        if kind == "LinearAttentionLayer":
            codec, lk = self._linear(i, layer, cfg)
            self.kinds.append(lk)
            return codec
        if kind in ("hybrid", "hybrid_sliding"):  # attention and a linear state in one layer
            return self._hybrid(i, kind, layer, cfg)
        if kind == "DynamicIndexedLayer":
            raise LayoutError(f"{self.name} layer {i}: a DSA indexer beside MHA attention (no "
                              f"MLA latent: the config sets no kv_lora_rank); kvhandoff.lab.shapes "
                              f"has indexer pages for MLA layers only")
        raise LayoutError(
            f"{self.name} layer {i}: no engine codec for cache layer kind {kind!r} "
            f"({type(layer).__name__}); kvhandoff.lab.shapes has one layer kind per layer")

    def _filled(self, i: int, what: str, *tensors: Any) -> None:
        """Refuse a layer the probe forward left without ``what`` (a cross-attention
        layer filled only from an image, an indexer that never ran on a short prompt):
        the engine cannot tell its shape, and a request would find nothing to move."""
        if any(t is None for t in tensors):
            raise LayoutError(f"{self.name} layer {i}: a forward over text left this layer's "
                              f"{what} empty (state filled only by other inputs or "
                              f"conditions, e.g. cross-attention over an image); the engine "
                              f"maps only state a text forward fills")

    def _attention(self, i: int, layer: Any, window: int | None) -> AttentionCodec:
        k, v = layer.keys, layer.values
        self._filled(i, "attention K/V", k, v)
        if k.shape[:3] != v.shape[:3] or k.dtype != v.dtype:
            raise LayoutError(f"{self.name} layer {i}: K {tuple(k.shape)} {k.dtype} and V "
                              f"{tuple(v.shape)} {v.dtype} differ in more than the head dim; "
                              f"MHA pages hold K and V of the same heads and dtype")
        heads, head_dim, v_head_dim = k.shape[1], k.shape[3], v.shape[3]
        self.kv_geometry[i] = (heads, head_dim, v_head_dim)
        self._set(kv_dtype_bytes=k.element_size())
        if window:
            self._check_window(i, window, k.shape[-2])
            self._set(sliding_window=window)
            self.window = window
        return AttentionCodec(layer=i, component="swa" if window else "kv", heads=heads,
                              head_dim=head_dim, v_head_dim=v_head_dim, dtype=k.dtype,
                              window=window)

    def _check_window(self, i: int, window: int, held: int) -> None:
        """Refuse a sliding window whose cache does not keep exactly the last
        ``window - 1`` tokens after the probe forward: the codecs move exactly those rows
        (:meth:`AttentionCodec.live`), so a cache that keeps another number decodes
        differently once rebuilt from them. transformers (5.x) keeps ``[-(window - 1):]``,
        which for a window of 1 is ``[-0:]``, every token: its own chunked prefill then
        fails and its decode attends to the whole history, so no handoff can match it."""
        want = min(_PROBE_TOKENS, window - 1)
        if window < 1 or held != want:
            raise LayoutError(
                f"{self.name} layer {i}: sliding window {window}, but after the "
                f"{_PROBE_TOKENS}-token probe forward the transformers cache holds {held} "
                f"tokens of this layer, not the last window - 1 = {want} a decoder needs; "
                f"the engine hands off exactly those, so it refuses this window (a window "
                f"of 1 attends to the token itself alone, which transformers' "
                f"sliding-window cache does not implement): use a sliding window of at "
                f"least 2")

    def _latent(self, i: int, layer: Any, *, indexed: bool) -> LayerCodec:
        k, v = layer.keys, layer.values  # [1, 1, S, kv_lora], [1, 1, S, rope]
        self._filled(i, "MLA latent K/V", k, v)
        latent, rope = k.shape[-1], v.shape[-1]
        self._set(mla_row_bytes=(latent + rope) * k.element_size())
        index_dim = 0
        index_dtype = None
        if indexed:
            ik = layer.indexer_keys  # [1, S, index_head_dim]
            self._filled(i, "DSA indexer keys", ik)
            index_dim, index_dtype = ik.shape[-1], ik.dtype
            self._set(index_row_bytes=index_dim * ik.element_size())
        self.kinds.append(LayerKind.MLA)
        return LatentCodec(layer=i, latent=latent, rope=rope, dtype=k.dtype,
                           index_dim=index_dim, index_dtype=index_dtype)

    def _short_conv(self, i: int, layer: Any) -> ShortConvCodec:
        conv = layer.conv_states[0]  # [1, channels, K]
        channels, width = conv.shape[1], conv.shape[2]
        self._set(short_conv_channels=channels, short_conv_kernel=width,
                  conv_dtype_bytes=conv.element_size())
        self.kinds.append(LayerKind.SHORT_CONV)
        return ShortConvCodec(layer=i, convs=(ConvSlot("conv", 0, channels, width),),
                              dtype=conv.dtype)

    def _hybrid(self, i: int, kind: str, layer: Any, cfg: Any) -> HybridCodec:
        """Attention (full, or sliding for ``"hybrid_sliding"``) beside a linear state:
        a Mamba2 / Mamba1 slot (Falcon-H1, Zamba) or short convolutions only (Inkling)."""
        window = int(layer.sliding_window) if kind == "hybrid_sliding" else None
        attention = self._attention(i, layer, window)
        if _conv_only(layer):
            self.kinds.append(LayerKind.SWA_SHORT_CONV if window else LayerKind.ATTN_SHORT_CONV)
            return HybridCodec(attention, self._layer_convs(i, layer, cfg))
        codec, lk = self._linear(i, layer, cfg)
        pairs = {LayerKind.MAMBA2: LayerKind.ATTN_MAMBA2, LayerKind.MAMBA1: LayerKind.ATTN_MAMBA1}
        if window or lk not in pairs:
            what = "sliding-window attention" if window else "attention"
            raise LayoutError(f"{self.name} layer {i}: {what} beside a {lk.value} state in one "
                              f"cache layer; kvhandoff.lab.shapes has layer kinds for full "
                              f"attention beside a Mamba2 or Mamba1 slot, and for full or "
                              f"sliding attention beside short convolutions, not this one")
        self.kinds.append(pairs[lk])
        return HybridCodec(attention, codec)

    def _layer_convs(self, i: int, layer: Any, cfg: Any) -> ShortConvCodec:
        """Every conv state of an attention + short-conv layer, each classified by what it
        convolves, read off its channel count against the layer's own attention and the
        config's hidden size: ``kv_heads x head_dim`` (K), ``kv_heads x v_head_dim`` (V),
        ``hidden_size`` (the residual stream). A count that fits the hidden size and a K/V
        width is refused: their TP sharding differs (head-sharded vs replicated)."""
        heads, kd, vd = self.kv_geometry[i]
        hidden = int(cfg.hidden_size)
        fits = {ConvInput.KEYS: heads * kd, ConvInput.VALUES: heads * vd,
                ConvInput.HIDDEN: hidden}
        slots: list[ConvSlot] = []
        inputs: list[ConvInput] = []
        for j in range(layer.number_of_states):
            conv = layer.conv_states[j]
            channels, width = conv.shape[1], conv.shape[2]
            match = {x for x, n in fits.items() if n == channels}
            if match == {ConvInput.KEYS, ConvInput.VALUES}:
                match = {ConvInput.KEYS}  # K and V of one width: both shard by the KV heads
            if len(match) != 1:
                raise LayoutError(
                    f"{self.name} layer {i}: conv state {j} has {channels} channels, "
                    f"{'none' if not match else 'more than one'} of the layer's K width "
                    f"{heads}x{kd}, V width {heads}x{vd} and the hidden size {hidden}; the "
                    f"engine cannot tell how TP shards it")
            inputs.append(match.pop())
            slots.append(ConvSlot(f"conv{j}", j, channels, width))
            self._set(conv_dtype_bytes=conv.element_size(), hidden_size=hidden)
        convs = tuple(LayerConv(name=c.tensor, input=x, kernel=c.width)
                      for c, x in zip(slots, inputs, strict=True))
        self._set(layer_convs=convs)
        return ShortConvCodec(layer=i, convs=tuple(slots), dtype=layer.conv_states[0].dtype)

    def _linear_states(self, i: int, layer: Any) -> tuple[Any, Any]:
        """Linear-attention layer ``i``'s conv and recurrent state tensors, refused
        (naming the layer and what it holds) unless the engine maps them."""
        if layer.number_of_states != 1:
            raise LayoutError(f"{self.name} layer {i}: {layer.number_of_states} conv states "
                              f"per layer; the engine maps exactly one")
        conv, ssm = layer.conv_states[0], layer.recurrent_states[0]
        if conv is None and ssm is None:
            raise LayoutError(f"{self.name} layer {i}: the probe forward left this "
                              f"linear-attention layer empty (no conv, no recurrent state); "
                              f"the model did not fill the cache it was given")
        if conv is None or ssm is None or ssm.dim() not in (3, 4):
            got = "no" if ssm is None else f"a {ssm.dim()}-D"
            what = "no conv state" if conv is None else f"{got} recurrent state"
            raise LayoutError(
                f"{self.name} layer {i}: linear-attention layer with {what} (the engine maps "
                f"a conv state alone (short convolutions) or with a 3-D Mamba1 or 4-D "
                f"Mamba2 / GDN SSM state; kvhandoff.lab.shapes has no layer kind for this one)")
        return conv, ssm

    def _linear(self, i: int, layer: Any, cfg: Any) -> tuple[LinearCodec, LayerKind]:
        conv, ssm = self._linear_states(i, layer)
        channels, width = conv.shape[1], conv.shape[2]
        common = {"conv_kernel": width, "conv_dtype_bytes": conv.element_size(),
                  "ssm_dtype_bytes": ssm.element_size()}
        if ssm.dim() == 3:  # Mamba1: conv [d_inner, K], SSM [d_inner, d_state]
            inner, state = ssm.shape[1], ssm.shape[2]
            if channels != inner:
                raise LayoutError(f"{self.name} layer {i}: Mamba1 conv channels {channels} != "
                                  f"SSM rows {inner}; both are d_inner")
            self._set(mamba_intermediate=inner, mamba_state=state, **common)
            return (LinearCodec(layer=i, conv=(channels, width), ssm=(inner, state),
                                conv_dtype=conv.dtype, ssm_dtype=ssm.dtype), LayerKind.MAMBA1)
        heads, a, b = ssm.shape[1], ssm.shape[2], ssm.shape[3]
        qkv = delta_net_dims(cfg)
        groups = mamba2_groups(cfg)
        if qkv is not None:  # a delta net (GDN, KDA): conv [q | k | v], SSM [v heads, k, v]
            kh, kd, vh, vd = qkv
            want = (2 * kh * kd + vh * vd, vh, kd, vd)
            if (channels, heads, a, b) != want:
                raise LayoutError(
                    f"{self.name} layer {i}: conv channels {channels} and SSM state "
                    f"[{heads}, {a}, {b}] are not the config's delta net: conv [q|k|v] = "
                    f"2 x {kh}x{kd} + {vh}x{vd} channels, SSM [{vh}, {kd}, {vd}]")
            self._set(linear_k_heads=kh, linear_k_dim=kd, linear_v_heads=vh, linear_v_dim=vd,
                      **common)
            kind = LayerKind.GDN
        elif groups is not None:  # Mamba2: conv [x | B | C], x = heads x head_dim,
            g = groups  # B = C = n_groups x state
            if channels != heads * a + 2 * g * b:
                raise LayoutError(
                    f"{self.name} layer {i}: conv channels {channels} are not the config's "
                    f"Mamba2 [x|B|C] = {heads}x{a} + 2 x {g} groups x state {b}")
            self._set(mamba_heads=heads, mamba_head_dim=a, mamba_state=b, mamba_groups=g,
                      **common)
            kind = LayerKind.MAMBA2
        elif channels == heads * a:  # multi-head Mamba1 (Zamba): the conv holds x alone
            # (B, C come from x_proj), and the SSM [heads, head_dim, state] is
            # [d_inner, state] cut into heads: a Mamba1 slot, sharded by d_inner
            self._set(mamba_intermediate=channels, mamba_state=b, **common)
            return (LinearCodec(layer=i, conv=(channels, width), ssm=(heads, a, b),
                                conv_dtype=conv.dtype, ssm_dtype=ssm.dtype), LayerKind.MAMBA1)
        else:
            raise LayoutError(
                f"{self.name} layer {i}: a conv of {channels} channels beside an SSM state "
                f"[{heads}, {a}, {b}], and the config names no q/k/v split "
                f"({', '.join('/'.join(d) for d in DELTA_NET_DIMS)}) and no Mamba2 groups "
                f"({', '.join(MAMBA2_GROUPS)}): the engine cannot tell how "
                f"TP shards the conv's channels")
        return (LinearCodec(layer=i, conv=(channels, width), ssm=(heads, a, b),
                            conv_dtype=conv.dtype, ssm_dtype=ssm.dtype), kind)

    def _dsv4(self, i: int, kind: str, layer: Any, cfg: Any) -> LayerCodec:
        window = int(layer.sliding_window)
        d, di = cfg.head_dim, cfg.index_head_dim
        dtype = layer.keys.dtype
        isz = dtype.itemsize
        if dtype != torch.float32:
            raise LayoutError(f"{self.name}: DeepSeek-V4 compressor state rows are laid out "
                              f"as fp32 (kvhandoff.lab.shapes); run the model in float32")
        self._filled(i, "sliding-window K=V", layer.keys)
        self._check_window(i, window, layer.keys.shape[-2])
        self._set(sliding_window=window, dsv4_kv_row_bytes=d * isz, dsv4_head_dim=d,
                  dsv4_index_head_dim=di, index_row_bytes=di * isz)
        self.window = window
        rate = getattr(layer, "compress_rate", 0)
        table = {"DynamicSlidingWindowLayer": (LayerKind.DSV4_W, "w", 0),
                 "compressed_sparse_attention": (LayerKind.DSV4_C4, "c4", 4),
                 "heavily_compressed_attention": (LayerKind.DSV4_C128, "c128", 128)}
        if kind not in table:
            raise LayoutError(f"{self.name} layer {i}: unexpected DeepSeek-V4 cache layer {kind}")
        lk, short, want = table[kind]
        if want and rate != want:
            raise LayoutError(f"{self.name} layer {i}: compress rate {rate}, but the pools "
                              f"(kvhandoff.lab.shapes) hold C4 / C128 rows: use rates 4 and 128")
        self.kinds.append(lk)
        return DeepseekV4Codec(layer=i, kind=short, head_dim=d, index_dim=di, window=window,
                               dtype=dtype)

    def shape(self) -> ModelShape:
        return ModelShape(name=self.name, layers=tuple(self.kinds), aux_row_bytes=64,
                          **self._kv_fields(), **self.fields)

    def _kv_fields(self) -> dict[str, Any]:
        """The attention layers' K/V shapes: the first attention layer's is the default,
        every other shape a :class:`~kvhandoff.lab.shapes.KVGroup` of its layers (a pool
        per page shape: Gemma 4's 512-dim full layers beside 256-dim sliding ones)."""
        if not self.kv_geometry:
            return {}
        by: dict[tuple[int, int, int], list[int]] = {}
        for layer, geo in self.kv_geometry.items():
            by.setdefault(geo, []).append(layer)
        (heads, kd, vd), *others = by
        return {"kv_heads": heads, "head_dim": kd, "v_head_dim": vd if vd != kd else 0,
                "kv_groups": tuple(KVGroup(layers=tuple(by[g]), kv_heads=g[0], head_dim=g[1],
                                           v_head_dim=g[2] if g[2] != g[1] else 0)
                                   for g in others)}
