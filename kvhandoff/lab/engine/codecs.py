"""Adapters between a Hugging Face cache layer and the engine's rows, one per cache-layer kind.

``transformers`` (5.x) builds every model's ``DynamicCache`` from a handful of cache-layer
classes chosen by ``config.layer_types``; each codec here maps one of those kinds, so a
new family made of the same kinds needs no code:

=====================================  ===================================================
cache layer                            codec and what it moves
=====================================  ===================================================
``DynamicLayer`` (MHA/GQA)             :class:`AttentionCodec`: ``k``/``v`` token rows
                                       ``[heads, head_dim]`` (component ``kv``)
``DynamicSlidingWindowLayer``          :class:`AttentionCodec` with a window: the last
                                       ``window-1`` token rows (component ``swa``)
``DynamicLayer`` of an MLA model       :class:`LatentCodec`: one ``kv`` row
                                       ``[kv_lora | rope]`` per token (component ``kv``)
``DynamicIndexedLayer`` (DSA)          :class:`LatentCodec` + ``index_k`` rows (``nsa``)
``LinearAttentionLayer``               :class:`LinearCodec`: ``conv`` ``[channels, K-1]``
                                       and ``ssm`` state of the request slot (``mamba``):
                                       Mamba2 / GDN ``[heads, a, b]``, Mamba1
                                       ``[d_inner, d_state]``
``LinearAttentionLayer`` with no       :class:`ShortConvCodec`: ``conv`` ``[channels, K-1]``
recurrent state (short conv, LFM2)     of the request slot (component ``short_conv``)
``LinearAttentionAndFullAttention``    :class:`HybridCodec`: attention and a linear state
``Layer`` (``"hybrid"``)               in one layer (``kv`` rows and the ``mamba`` slot,
                                       or ``kv`` rows and ``short_conv`` slots: Inkling)
``LinearAttentionAndSlidingWindow``    :class:`HybridCodec`: sliding-window attention and
``AttentionLayer`` (``"hybrid_sliding"``)  short-conv slots (``swa`` rows, ``short_conv``)
DeepSeek-V4 sliding / CSA / HCA        :class:`DeepseekV4Codec`: window rows, compressed
                                       entries, compressor rings
``DummyLayer``                         nothing
=====================================  ===================================================

A codec speaks in **rows**: ``uint8`` arrays ``[m, row_bytes]`` of the *global*
(unsharded) state, each row tagged with a logical id — a token position
(:attr:`Series.TOKENS`), a compressed entry (:attr:`Series.ENTRIES`), a position whose
compressor state is pending (:attr:`Series.RING`) or the request slot
(:attr:`Series.SLOT`). The engine places rows in pools and shards them across TP ranks;
codecs never see pages or ranks.

Conv state: HF keeps ``K`` columns but the next step only reads the last ``K-1`` (the
oldest falls off before the convolution), so only those move, as in sglang's
``(conv_dim, K-1)`` slots; the rebuilt column 0 is zero.
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch

from kvhandoff.indices import compress_state_positions

IdArray = npt.NDArray[np.int64]
RowArray = npt.NDArray[np.uint8]
Key = tuple[str, str, int]  # (component, tensor, layer)


class Series(enum.StrEnum):
    TOKENS = "tokens"  # one row per token position
    ENTRIES = "entries"  # one row per compressed entry of `ratio` positions
    RING = "ring"  # one row per position whose compressor state is still pending
    SLOT = "slot"  # the request's one state unit (id 0)


@dataclass(frozen=True, slots=True)
class Field:
    """One tensor of one layer as a codec produces it."""

    component: str
    tensor: str
    layer: int
    series: Series
    row_bytes: int  # bytes of one global (unsharded) row as the model stores it
    ratio: int = 1  # positions per ENTRIES row
    itemsize: int = 4  # bytes of one element (where a float's exponent byte is)

    @property
    def key(self) -> Key:
        return (self.component, self.tensor, self.layer)


def to_rows(t: torch.Tensor) -> RowArray:
    """``t`` (``[m, ...]``) as ``m`` rows of raw bytes (a copy)."""
    t = t.detach().to("cpu").contiguous()
    row = math.prod(t.shape[1:]) * t.element_size()
    if t.numel() == 0:
        return np.zeros((t.shape[0], row), dtype=np.uint8)
    out: RowArray = t.view(torch.uint8).reshape(t.shape[0], row).numpy().copy()
    return out


def from_rows(rows: RowArray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Rows of raw bytes back as a tensor of ``dtype`` and ``shape`` (a copy)."""
    arr = np.ascontiguousarray(rows, dtype=np.uint8).reshape(-1)
    if arr.size == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.from_numpy(arr.copy()).view(dtype).reshape(shape)


def _arange(lo: int, hi: int) -> IdArray:
    return np.arange(lo, max(lo, hi), dtype=np.int64)


class LayerCodec(abc.ABC):
    """Reads one HF cache layer as rows and fills a fresh one from rows."""

    layer: int
    fields: tuple[Field, ...]

    @abc.abstractmethod
    def read(self, cache_layer: Any, f: Field, since: int = 0) -> tuple[IdArray, RowArray]:
        """The rows of ``f`` the cache layer holds whose id is ``>= since``."""

    @abc.abstractmethod
    def live(self, f: Field, n: int) -> IdArray:
        """Ids of ``f`` a decoder needs after ``n`` positions (exactly what :meth:`read`
        returns for a cache that has seen ``n`` positions)."""

    @abc.abstractmethod
    def fill(self, cache_layer: Any, n: int, rows: Mapping[Key, RowArray]) -> None:
        """Make the fresh ``cache_layer`` hold ``n`` positions, from the :meth:`live`
        rows of every field (in id order)."""


class AttentionCodec(LayerCodec):
    """MHA / GQA K and V, full (``window=None``) or sliding window. K and V may differ in
    head dim (``v_head_dim``; MiMo-V2-Flash: K 192, V 128)."""

    def __init__(self, *, layer: int, component: str, heads: int, head_dim: int,
                 dtype: torch.dtype, window: int | None, v_head_dim: int | None = None
                 ) -> None:
        self.layer, self.heads, self.dtype = layer, heads, dtype
        self.dims = {"k": head_dim, "v": v_head_dim or head_dim}
        self.window = window
        isz = dtype.itemsize
        self.fields = tuple(Field(component, n, layer, Series.TOKENS, heads * d * isz,
                                  itemsize=isz) for n, d in self.dims.items())

    def read(self, cache_layer: Any, f: Field, since: int = 0) -> tuple[IdArray, RowArray]:
        t = cache_layer.keys if f.tensor == "k" else cache_layer.values
        held = t.shape[-2]
        end = cache_layer.cumulative_length if self.window else held
        lo = max(since, end - held)
        return _arange(lo, end), to_rows(t[0, :, lo - (end - held):].transpose(0, 1))

    def live(self, f: Field, n: int) -> IdArray:
        return _arange(max(0, n - self.window + 1) if self.window else 0, n)

    def fill(self, cache_layer: Any, n: int, rows: Mapping[Key, RowArray]) -> None:
        k, v = (self._tensor(rows[f.key], self.dims[f.tensor]) for f in self.fields)
        cache_layer.lazy_initialization(k, v)
        cache_layer.keys, cache_layer.values = k, v
        if self.window:
            cache_layer.cumulative_length = n

    def _tensor(self, rows: RowArray, head_dim: int) -> torch.Tensor:
        m = len(rows)
        t = from_rows(rows, self.dtype, (m, self.heads, head_dim))
        return t.transpose(0, 1).unsqueeze(0).contiguous()


class LatentCodec(LayerCodec):
    """MLA: the compressed latent and the shared rope key, one row per token; with a DSA
    indexer (``index_dim``), its key too (component ``nsa``)."""

    def __init__(self, *, layer: int, latent: int, rope: int, dtype: torch.dtype,
                 index_dim: int = 0, index_dtype: torch.dtype | None = None) -> None:
        self.layer, self.latent, self.rope, self.dtype = layer, latent, rope, dtype
        self.index_dim, self.index_dtype = index_dim, index_dtype or dtype
        fields = [Field("kv", "kv", layer, Series.TOKENS, (latent + rope) * dtype.itemsize,
                        itemsize=dtype.itemsize)]
        if index_dim:
            isz = self.index_dtype.itemsize
            fields.append(Field("nsa", "index_k", layer, Series.TOKENS, index_dim * isz,
                                itemsize=isz))
        self.fields = tuple(fields)

    def read(self, cache_layer: Any, f: Field, since: int = 0) -> tuple[IdArray, RowArray]:
        if f.tensor == "index_k":
            t = cache_layer.indexer_keys[0, since:]
        else:
            t = torch.cat([cache_layer.keys[0, 0, since:], cache_layer.values[0, 0, since:]], -1)
        return _arange(since, since + t.shape[0]), to_rows(t)

    def live(self, f: Field, n: int) -> IdArray:
        return _arange(0, n)

    def fill(self, cache_layer: Any, n: int, rows: Mapping[Key, RowArray]) -> None:
        kv = from_rows(rows[self.fields[0].key], self.dtype, (1, 1, n, self.latent + self.rope))
        k, v = kv[..., :self.latent].contiguous(), kv[..., self.latent:].contiguous()
        cache_layer.lazy_initialization(k, v)
        cache_layer.keys, cache_layer.values = k, v
        if self.index_dim:
            ik = from_rows(rows[self.fields[1].key], self.index_dtype, (1, n, self.index_dim))
            cache_layer.lazy_initialization_indexer(ik)
            cache_layer.indexer_keys = ik


class LinearCodec(LayerCodec):
    """Mamba2 / gated-delta-net / Mamba1 state of one layer: conv window and recurrent
    (SSM) state, whatever the SSM state's shape (``[heads, a, b]``, ``[d_inner, state]``)."""

    def __init__(self, *, layer: int, conv: tuple[int, int], ssm: tuple[int, ...],
                 conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> None:
        self.layer, self.conv, self.ssm = layer, conv, ssm
        self.conv_dtype, self.ssm_dtype = conv_dtype, ssm_dtype
        channels, width = conv
        self.fields = (
            Field("mamba", "conv", layer, Series.SLOT,
                  channels * (width - 1) * conv_dtype.itemsize, itemsize=conv_dtype.itemsize),
            Field("mamba", "ssm", layer, Series.SLOT, math.prod(ssm) * ssm_dtype.itemsize,
                  itemsize=ssm_dtype.itemsize),
        )

    def read(self, cache_layer: Any, f: Field, since: int = 0) -> tuple[IdArray, RowArray]:
        if since > 0:
            return _arange(0, 0), np.zeros((0, f.row_bytes), np.uint8)
        if f.tensor == "conv":
            t = cache_layer.conv_states[0][0, :, 1:]
        else:
            t = cache_layer.recurrent_states[0][0]
        return _arange(0, 1), to_rows(t.unsqueeze(0))

    def live(self, f: Field, n: int) -> IdArray:
        return _arange(0, 1)

    def fill(self, cache_layer: Any, n: int, rows: Mapping[Key, RowArray]) -> None:
        channels, width = self.conv
        conv = torch.zeros((1, channels, width), dtype=self.conv_dtype)
        conv[0, :, 1:] = from_rows(rows[self.fields[0].key], self.conv_dtype,
                                   (channels, width - 1))
        ssm = from_rows(rows[self.fields[1].key], self.ssm_dtype, (1, *self.ssm))
        cache_layer.lazy_initialization(conv_states=conv, recurrent_states=ssm,
                                        conv_kernel_size=width)
        cache_layer.conv_states[0].copy_(conv)
        cache_layer.recurrent_states[0].copy_(ssm)
        cache_layer.has_previous_state[0] = True


@dataclass(frozen=True, slots=True)
class ConvSlot:
    """One conv state of a layer: HF's ``conv_states[state]``, ``[channels, width]``,
    moved as tensor ``tensor`` of the slot."""

    tensor: str
    state: int
    channels: int
    width: int


class ShortConvCodec(LayerCodec):
    """A layer's short-convolution states (no recurrent state): the conv windows alone,
    one slot tensor each (component ``short_conv``). LFM2 keeps one (``conv``); Inkling
    keeps four beside its attention (over K, V, and the residual stream twice)."""

    def __init__(self, *, layer: int, convs: tuple[ConvSlot, ...], dtype: torch.dtype) -> None:
        self.layer, self.convs, self.dtype = layer, convs, dtype
        isz = dtype.itemsize
        self.fields = tuple(Field("short_conv", c.tensor, layer, Series.SLOT,
                                  c.channels * (c.width - 1) * isz, itemsize=isz)
                            for c in convs)
        self._by = {c.tensor: c for c in convs}

    def read(self, cache_layer: Any, f: Field, since: int = 0) -> tuple[IdArray, RowArray]:
        if since > 0:
            return _arange(0, 0), np.zeros((0, f.row_bytes), np.uint8)
        c = self._by[f.tensor]
        return _arange(0, 1), to_rows(cache_layer.conv_states[c.state][0, :, 1:].unsqueeze(0))

    def live(self, f: Field, n: int) -> IdArray:
        return _arange(0, 1)

    def fill(self, cache_layer: Any, n: int, rows: Mapping[Key, RowArray]) -> None:
        for c, f in zip(self.convs, self.fields, strict=True):
            conv = torch.zeros((1, c.channels, c.width), dtype=self.dtype)
            conv[0, :, 1:] = from_rows(rows[f.key], self.dtype, (c.channels, c.width - 1))
            cache_layer.lazy_initialization(conv_states=conv, state_idx=c.state,
                                            conv_kernel_size=c.width)
            cache_layer.conv_states[c.state].copy_(conv)
            cache_layer.has_previous_state[c.state] = True


class HybridCodec(LayerCodec):
    """A layer that keeps attention K/V *and* a recurrent or conv slot (HF's ``"hybrid"``
    / ``"hybrid_sliding"`` cache layers: Falcon-H1's attention beside Mamba2, Zamba's
    beside Mamba1, Inkling's full or sliding attention beside short convolutions).
    Each field is handled by the codec of its part."""

    def __init__(self, attention: AttentionCodec, state: LinearCodec | ShortConvCodec) -> None:
        if attention.layer != state.layer:
            raise ValueError(f"hybrid codec parts disagree on the layer "
                             f"({attention.layer} vs {state.layer})")
        self.layer, self.attention, self.state = attention.layer, attention, state
        self.fields = attention.fields + state.fields
        self._part: dict[Key, LayerCodec] = {f.key: p for p in (attention, state)
                                             for f in p.fields}

    def read(self, cache_layer: Any, f: Field, since: int = 0) -> tuple[IdArray, RowArray]:
        return self._part[f.key].read(cache_layer, f, since)

    def live(self, f: Field, n: int) -> IdArray:
        return self._part[f.key].live(f, n)

    def fill(self, cache_layer: Any, n: int, rows: Mapping[Key, RowArray]) -> None:
        self.attention.fill(cache_layer, n, rows)
        self.state.fill(cache_layer, n, rows)


class DeepseekV4Codec(LayerCodec):
    """One DeepSeek-V4 layer: the shared K=V sliding window (every kind), and for
    compressed kinds the compressed entries and the compressor's pending state.

    * ``c4`` (CSA): ``kv`` and ``index_k`` entries (one per 4 positions, component
      ``kv``); ``c4_state`` / ``c4_index_state`` ring rows ``[kv 2d | gate 2d]`` for the
      positions :func:`~kvhandoff.indices.compress_state_positions` names: the last full
      window (only its ``Ca`` half ``[:d]`` is state: HF's ``overlap_*``) and the pending
      tail (HF's ``buffer_*``), component ``swa`` (page-scoped rings, as sglang's).
    * ``c128`` (HCA): ``kv`` entries (one per 128 positions) and ``c128_state`` rows
      ``[kv d | gate d]`` of the pending tail, a request-scoped ring (component
      ``c128_state``).
    """

    _COMPRESS: ClassVar[dict[str, int]] = {"c4": 4, "c128": 128}

    def __init__(self, *, layer: int, kind: str, head_dim: int, index_dim: int, window: int,
                 dtype: torch.dtype) -> None:
        self.layer, self.kind, self.d, self.di = layer, kind, head_dim, index_dim
        self.window, self.dtype = window, dtype
        isz = dtype.itemsize
        fields = [Field("swa", "swa_kv", layer, Series.TOKENS, head_dim * isz, 1, isz)]
        if kind == "c4":
            fields += [Field("kv", "kv", layer, Series.ENTRIES, head_dim * isz, 4, isz),
                       Field("kv", "index_k", layer, Series.ENTRIES, index_dim * isz, 4, isz),
                       Field("swa", "c4_state", layer, Series.RING, 4 * head_dim * isz, 1, isz),
                       Field("swa", "c4_index_state", layer, Series.RING, 4 * index_dim * isz,
                             1, isz)]
        elif kind == "c128":
            fields += [Field("kv", "kv", layer, Series.ENTRIES, head_dim * isz, 128, isz),
                       Field("c128_state", "c128_state", layer, Series.RING, 2 * head_dim * isz,
                             1, isz)]
        self.fields = tuple(fields)

    @staticmethod
    def _name(f: Field) -> str:
        return "indexer" if "index" in f.tensor else "compressor"

    def _width(self, f: Field) -> int:
        return self.di if "index" in f.tensor else self.d

    def read(self, cache_layer: Any, f: Field, since: int = 0) -> tuple[IdArray, RowArray]:
        if f.series is Series.TOKENS:
            keys = cache_layer.keys
            if not torch.equal(keys, cache_layer.values):
                raise ValueError(f"DeepSeek-V4 layer {self.layer}: keys and values differ; the "
                                 f"engine stores one shared K=V window")
            end, held = cache_layer.cumulative_length, keys.shape[-2]
            lo = max(since, end - held)
            return _arange(lo, end), to_rows(keys[0, 0, lo - (end - held):])
        if f.series is Series.ENTRIES:
            t = cache_layer.compressed_kv[self._name(f)]
            if t is None:
                return _arange(0, 0), np.zeros((0, f.row_bytes), np.uint8)
            return _arange(since, t.shape[1]), to_rows(t[0, since:])
        n = cache_layer.cumulative_length
        ids = self.live(f, n)
        return ids, to_rows(self._ring(cache_layer, f, n))

    def _ring(self, cache_layer: Any, f: Field, n: int) -> torch.Tensor:
        name = self._name(f)
        buf_kv, buf_gate = cache_layer.buffer_kv[name], cache_layer.buffer_gate[name]
        pending = n % self._COMPRESS[self.kind]
        empty = torch.zeros((0, f.row_bytes // self.dtype.itemsize), dtype=self.dtype)
        tail = (torch.cat([buf_kv[0], buf_gate[0]], -1) if pending else empty)
        if self.kind == "c128" or n < 4:
            return tail
        # the last full window's Ca half [:d] of kv and gate; the Cb half is spent
        ov_kv, ov_gate = cache_layer.overlap_kv[name][0], cache_layer.overlap_gate[name][0]
        zero = torch.zeros_like(ov_kv)
        return torch.cat([torch.cat([ov_kv, zero, ov_gate, zero], -1), tail])

    def live(self, f: Field, n: int) -> IdArray:
        if f.series is Series.TOKENS:
            return _arange(max(0, n - self.window + 1), n)
        if f.series is Series.ENTRIES:
            return _arange(0, n // f.ratio)
        if self.kind == "c4":
            return compress_state_positions(n, 4)
        return _arange(n - n % 128, n)

    def fill(self, cache_layer: Any, n: int, rows: Mapping[Key, RowArray]) -> None:
        by = {f.tensor: (f, rows[f.key]) for f in self.fields}
        f, r = by["swa_kv"]
        kv = from_rows(r, self.dtype, (1, 1, len(r), self.d))
        cache_layer.lazy_initialization(kv, kv)
        cache_layer.keys = cache_layer.values = kv
        cache_layer.cumulative_length = n
        if self.kind == "w":
            return
        ratio = self._COMPRESS[self.kind]
        pending = n % ratio
        for tensor, ring in (("kv", f"{self.kind}_state"), ("index_k", "c4_index_state")):
            if tensor not in by:
                continue
            f, r = by[tensor]
            name, d = self._name(f), self._width(f)
            cache_layer.compressed_kv[name] = from_rows(r, self.dtype, (1, len(r), d))
            cache_layer.entry_count[name] = len(r)
            f, r = by[ring]
            state = from_rows(r, self.dtype, (len(r), f.row_bytes // self.dtype.itemsize))
            half = state.shape[1] // 2
            tail = state[len(state) - pending:]
            cache_layer.buffer_kv[name] = tail[None, :, :half].contiguous()
            cache_layer.buffer_gate[name] = tail[None, :, half:].contiguous()
            if self.kind == "c4" and n >= 4:
                window = state[:4]
                cache_layer.overlap_kv[name] = window[None, :, :d].contiguous()
                cache_layer.overlap_gate[name] = window[None, :, 2 * d:3 * d].contiguous()
