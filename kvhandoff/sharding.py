"""How recurrent (Mamba / linear-attention) state splits across tensor-parallel ranks:
the one home of these rules. Pure (no engine, no torch, no I/O).

A recurrent layer keeps two states per request slot, each sharded by tensor parallelism:

* the **conv state**, ``(channels, K-1)`` per rank (or transposed, ``(K-1, channels)``,
  Kimi's layout). Its channel axis is a concatenation of sub-blocks that are each split
  across the ranks *on their own* (so a rank holds a slice of every sub-block, not one
  contiguous slice of the whole axis):

  ==========  ==========================  =============================================
  kind        sub-blocks                  sizes (global channels)
  ==========  ==========================  =============================================
  Mamba1      ``[x]``                     ``d_inner``
  Mamba2      ``[x | B | C]``             ``heads·head_dim``, ``n_groups·state`` twice;
                                          B and C in whole groups of ``state`` channels,
                                          replicated when TP exceeds the groups
  GDN         ``[q | k | v]``             ``k_heads·k_dim`` twice, ``v_heads·v_dim``
  KDA (Kimi)  ``[v-proj | k | k]``        ``heads·head_dim``, ``k_heads·k_dim`` twice
  ==========  ==========================  =============================================

  Slicing such a conv as one contiguous axis across different TP sizes mixes the
  sub-blocks (the reference system's "1 in 1000 outputs wrong" bug).
* the **SSM / temporal state**, sharded by its first axis: heads (Mamba2
  ``(heads, head_dim, state)``, GDN ``(v_heads, v_dim, k_dim)``) or channels (Mamba1
  ``(d_inner, state)``).

A :class:`ConvSplit` states the sub-blocks in *units* of channels: one channel, or a
coarser unit that keeps what must stay together on one rank (a Mamba2 group of
``state`` channels; a whole head); :func:`conv_shard` and :func:`ssm_shard` turn them
into the :class:`~kvhandoff.layout.ShardSpec` the planner intersects.

Models name these dimensions differently in their configs; :data:`DELTA_NET_DIMS` and
:data:`MAMBA2_GROUPS` are the spelling tables every reader (the reference engine, the
model catalogue, the vLLM and SGLang adapters) consults, through :func:`delta_net_dims`
and :func:`mamba2_groups`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvhandoff.errors import LayoutError
from kvhandoff.layout import ShardSpec

__all__ = [
    "DELTA_NET_DIMS",
    "MAMBA2_GROUPS",
    "MAMBA2_STATE",
    "ConvKind",
    "ConvSplit",
    "config_ints",
    "conv_shard",
    "delta_net_dims",
    "extended_groups",
    "gdn_conv",
    "kda_conv",
    "mamba1_conv",
    "mamba2_conv",
    "mamba2_groups",
    "mamba2_state",
    "ssm_shard",
]


class ConvKind(enum.StrEnum):
    """How a recurrent layer's conv channels are made of sub-blocks."""

    MAMBA1 = "mamba1"  # [x]
    MAMBA2 = "mamba2"  # [x | B | C]
    GDN = "gdn"  # [q | k | v]
    KDA = "kda"  # [v-proj | k | k], stored (K-1, channels)


DELTA_NET_DIMS: tuple[tuple[str, str, str, str], ...] = (
    # (key heads, key head dim, value heads, value head dim) as each family's config names
    # them: conv [q | k | v] = (kh*kd, kh*kd, vh*vd)
    ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
     "linear_value_head_dim"),  # gated delta nets: Qwen3-Next, Qwen3.5, OLMo-hybrid
    ("linear_num_heads", "linear_head_dim", "linear_num_heads",
     "linear_head_dim"),  # Kimi delta attention: Kimi-Linear, Bailing-hybrid
)
"""Where delta-net configs keep their key and value head counts and sizes."""

MAMBA2_GROUPS: tuple[str, ...] = ("n_groups", "mamba_n_groups", "ssm_n_groups",
                                  "mamba_ngroups")
"""Where configs keep a Mamba2 mixer's B/C group count (conv ``[x | B | C]``)."""

MAMBA2_STATE: tuple[str, ...] = ("ssm_state_size", "mamba_d_state", "state_size", "d_state")
"""Where configs keep a Mamba2 mixer's state size (the channels of one B/C group)."""


def _get(cfg: object, name: str) -> object:
    """``cfg[name]`` for a mapping (a parsed ``config.json``), else ``cfg.name``; None
    when absent."""
    if isinstance(cfg, Mapping):
        return cfg.get(name)
    return getattr(cfg, name, None)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def config_ints(cfg: object, names: Sequence[str]) -> tuple[int, ...] | None:
    """The values of ``names`` in ``cfg`` (a config object or a ``config.json`` mapping)
    when every one is set to an int, else None."""
    values = [_int(_get(cfg, n)) for n in names]
    return None if any(v is None for v in values) else tuple(v for v in values if v is not None)


def delta_net_dims(cfg: object) -> tuple[int, int, int, int] | None:
    """``(key heads, key head dim, value heads, value head dim)`` of a delta-net config,
    by the first spelling of :data:`DELTA_NET_DIMS` it sets in full; None if none."""
    for names in DELTA_NET_DIMS:
        dims = config_ints(cfg, names)
        if dims is not None:
            kh, kd, vh, vd = dims
            return kh, kd, vh, vd
    return None


def _first(cfg: object, names: Sequence[str]) -> int | None:
    return next((v for v in (_int(_get(cfg, n)) for n in names) if v), None)


def mamba2_groups(cfg: object) -> int | None:
    """A Mamba2 config's B/C group count (:data:`MAMBA2_GROUPS`), or None if it names
    none (a positive value is required)."""
    return _first(cfg, MAMBA2_GROUPS)


def mamba2_state(cfg: object) -> int | None:
    """A Mamba2 config's state size (:data:`MAMBA2_STATE`), or None."""
    return _first(cfg, MAMBA2_STATE)


def extended_groups(n_groups: int, tp_size: int) -> int:
    """B/C groups a Mamba2 conv holds over ``tp_size`` ranks: ``n_groups``, extended to
    ``tp_size`` when fewer (each rank then holds a replica of the group its heads use),
    as vLLM and SGLang allocate them."""
    if n_groups < 1 or tp_size < 1:
        raise LayoutError(f"Mamba2 needs n_groups >= 1 and TP >= 1, got {n_groups}, {tp_size}")
    if n_groups % tp_size == 0:
        return n_groups
    if tp_size % n_groups:
        raise LayoutError(f"Mamba2: TP {tp_size} is neither a divisor nor a multiple of the "
                          f"{n_groups} B/C groups")
    return tp_size


@dataclass(frozen=True, slots=True, kw_only=True)
class ConvSplit:
    """A conv state's channel axis: sub-blocks of ``blocks`` units each (global, over
    every rank), a unit being ``unit`` channels that stay together on one rank."""

    kind: ConvKind
    blocks: tuple[int, ...]
    unit: int = 1

    def __post_init__(self) -> None:
        if not self.blocks or any(b < 1 for b in self.blocks) or self.unit < 1:
            raise LayoutError(f"{self.kind.value} conv: sub-blocks {self.blocks} of "
                              f"{self.unit}-channel units must all be positive")

    @property
    def channels(self) -> int:
        """Global channels (over every rank; Mamba2 B/C counted once per group)."""
        return sum(self.blocks) * self.unit


def mamba1_conv(d_inner: int) -> ConvSplit:
    """Mamba1: one channel axis ``[x]`` of ``d_inner`` channels (it also indexes the SSM
    state's rows)."""
    return ConvSplit(kind=ConvKind.MAMBA1, blocks=(d_inner,))


def mamba2_conv(x: int, n_groups: int, state: int, *, whole_groups: bool = True) -> ConvSplit:
    """Mamba2: ``[x | B | C]`` with ``x`` channels (heads × head_dim) and B, C of
    ``n_groups`` groups of ``state`` channels. ``whole_groups`` counts in units of one
    group (so a TP wider than the groups replicates them, as the engines do; ``x`` must
    then be a multiple of ``state``), else in channels (TP must divide every block)."""
    if not whole_groups:
        return ConvSplit(kind=ConvKind.MAMBA2, blocks=(x, n_groups * state, n_groups * state))
    if x % state:
        raise LayoutError(f"Mamba2 conv: x of {x} channels is not a whole number of "
                          f"{state}-channel groups, so B/C cannot be kept in whole groups")
    return ConvSplit(kind=ConvKind.MAMBA2, blocks=(x // state, n_groups, n_groups), unit=state)


def gdn_conv(key_dim: int, value_dim: int, *, unit: int = 1) -> ConvSplit:
    """Gated delta net: ``[q | k | v]``, q and k of ``key_dim`` channels, v of
    ``value_dim`` (k_heads·k_dim and v_heads·v_dim, global), in ``unit``-channel units
    (e.g. a head size common to keys and values, so a rank holds whole heads)."""
    if key_dim % unit or value_dim % unit:
        raise LayoutError(f"GDN conv: key {key_dim} and value {value_dim} channels are not "
                          f"whole {unit}-channel units")
    return ConvSplit(kind=ConvKind.GDN, blocks=(key_dim // unit, key_dim // unit,
                                                value_dim // unit), unit=unit)


def kda_conv(proj: int, proj_k: int) -> ConvSplit:
    """Kimi delta attention: ``[v-proj | k | k]`` (heads·head_dim, then k_heads·k_dim
    twice), stored transposed ``(K-1, channels)``."""
    return ConvSplit(kind=ConvKind.KDA, blocks=(proj, proj_k, proj_k))


def conv_shard(split: ConvSplit, *, channel_bytes: int, outer_rows: int = 1,
               labels: tuple[str, ...] = ()) -> ShardSpec:
    """The ShardSpec of one conv slot: ``outer_rows`` rows of ``split``'s channels,
    ``channel_bytes`` per channel in a row. A ``(channels, K-1)`` slot is one row of
    channels of ``(K-1)·dtype`` bytes each; a transposed ``(K-1, channels)`` slot is
    ``K-1`` rows of ``dtype``-byte channels. ``labels`` name the blocks in a refusal."""
    if channel_bytes < 1 or outer_rows < 1:
        raise LayoutError(f"{split.kind.value} conv: channel bytes {channel_bytes} and outer "
                          f"rows {outer_rows} must be positive")
    return ShardSpec(outer=outer_rows, groups=split.blocks, inner_bytes=split.unit * channel_bytes,
                     labels=labels)


def ssm_shard(heads: int, head_bytes: int, label: str = "SSM heads") -> ShardSpec:
    """The ShardSpec of one SSM / temporal slot: ``heads`` (global) along its first axis,
    ``head_bytes`` each (Mamba1: ``d_inner`` rows of ``state`` values); ``label`` names
    them in a refusal."""
    return ShardSpec(outer=1, groups=(heads,), inner_bytes=head_bytes, labels=(label,))

