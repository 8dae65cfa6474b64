"""The layout model: what one rank registers, as frozen, validated records.

Vocabulary (DESIGN §3):

* An **item** is the unit an index addresses in one tensor: a page of one layer,
  one Mamba slot, one ring row, one aux row. ``addr = ptr + index * item_stride``,
  and the item is the ``item_bytes`` bytes from there. The stride is ``item_bytes``
  unless the tensor says otherwise: a *padded* opaque item (``stride > item_bytes``)
  leaves bytes between items that belong to something else or to nobody (vLLM stores
  a Mamba layer's conv and SSM state in one raw page each; two tensors of the same
  stride, one at the page's start and one at the SSM state's offset, describe them
  so that each shards on its own).
* An item may hold several **rows** (``rows``), laid out one after another:
  ``RowKind.TOKEN`` rows are token rows of a KV page (so a page of 16 tokens on
  prefill can be re-paged to 32 on decode); ``RowKind.RING`` rows are ring rows
  addressed by ``position % rows`` (so rings of 8 and 16 rows interoperate);
  ``RowKind.ITEM`` items are opaque and move whole.
* A **ShardSpec** says how an item is split across tensor-parallel ranks:
  ``outer`` rows × the sharded axis × ``inner_bytes``. The axis is the
  concatenation of ``groups`` (global lengths), each sharded on its own (GDN conv:
  ``[key_dim, key_dim, value_dim]``). When TP exceeds a group's length the group
  is replicated in blocks (GQA: rank r holds head ``r // (tp // heads)``).
  No ShardSpec means every rank holds identical bytes.

Records are immutable and validate themselves on construction; an inconsistent
number raises :class:`~kvhandoff.errors.LayoutError` naming the tensor and values.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, field

from kvhandoff.errors import LayoutError
from kvhandoff.state_types import StateType

NO_LAYER = -1
"""``layer_id`` of a tensor that belongs to no model layer (aux rows, request rows)."""


class MemoryKind(enum.StrEnum):
    HOST = "host"
    CUDA = "cuda"


class RowKind(enum.StrEnum):
    ITEM = "item"  # opaque item, moved whole
    TOKEN = "token"  # `rows` consecutive token rows (a KV page)
    RING = "ring"  # `rows` ring rows, row of position p is p % rows


@dataclass(frozen=True, slots=True)
class GroupRange:
    """The part of one sharded group a rank holds, in global axis units."""

    start: int
    length: int
    replicas: int  # how many ranks hold exactly this range
    replica: int  # which of them this rank is (0-based)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardSpec:
    """How one item splits across TP ranks: ``outer`` × axis × ``inner_bytes``.

    ``groups`` are the *global* lengths of the axis's independently sharded
    sub-blocks (one group for a plain axis). The same ShardSpec describes the
    tensor on every rank of both sides; the rank's share comes from
    :meth:`ranges`. ``labels`` optionally name each group's units (``"KV heads"``,
    ``"k channels"``) for the message that refuses a TP size; they are no part of the
    geometry (not compared, not sent).
    """

    outer: int
    groups: tuple[int, ...]
    inner_bytes: int
    labels: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.outer < 1 or self.inner_bytes < 1 or not self.groups:
            raise LayoutError(
                f"ShardSpec needs outer >= 1, inner_bytes >= 1 and at least one group; "
                f"got outer={self.outer}, groups={self.groups}, inner_bytes={self.inner_bytes}"
            )
        if any(g < 1 for g in self.groups):
            raise LayoutError(f"ShardSpec groups must be positive, got {self.groups}")
        if self.labels and len(self.labels) != len(self.groups):
            raise LayoutError(f"ShardSpec labels {self.labels} do not name its {len(self.groups)} "
                              f"groups {self.groups}")

    @classmethod
    def axis(
        cls, *, outer: int = 1, axis: int, inner_bytes: int, groups: tuple[int, ...] | None = None,
        labels: tuple[str, ...] = (),
    ) -> ShardSpec:
        """Build from a global axis length (optionally split into ``groups``)."""
        if groups is not None and sum(groups) != axis:
            raise LayoutError(f"ShardSpec groups {groups} sum to {sum(groups)}, not axis {axis}")
        return cls(
            outer=outer, groups=tuple(groups) if groups else (axis,), inner_bytes=inner_bytes,
            labels=labels,
        )

    def ranges(self, tp_rank: int, tp_size: int) -> tuple[GroupRange, ...]:
        """The global range of every group that rank ``tp_rank`` of ``tp_size`` holds.
        Raises :class:`LayoutError` naming the group, its length and the arithmetic when
        ``tp_size`` neither splits a group evenly nor replicates it evenly."""
        out = []
        for i, g in enumerate(self.groups):
            if tp_size <= g:
                if g % tp_size:
                    raise LayoutError(f"{self._what(i)} cannot be split evenly over TP "
                                      f"{tp_size} ({g} = {g // tp_size} x {tp_size} + "
                                      f"{g % tp_size})")
                n = g // tp_size
                out.append(GroupRange(tp_rank * n, n, 1, 0))
            else:
                if tp_size % g:
                    raise LayoutError(f"{self._what(i)} cannot be replicated evenly over TP "
                                      f"{tp_size}: each rank holds one, so TP must be a "
                                      f"multiple of {g} ({tp_size} = {tp_size // g} x {g} + "
                                      f"{tp_size % g})")
                rep = tp_size // g
                out.append(GroupRange(tp_rank // rep, 1, rep, tp_rank % rep))
        return tuple(out)

    def _what(self, i: int) -> str:
        """Group ``i`` in words: ``16 k channels (group 1 of [16, 16, 32])``."""
        g = self.groups[i]
        what = f"{g} {self.labels[i]}" if self.labels else f"a sharded group of length {g}"
        return what if len(self.groups) == 1 else f"{what} (group {i} of {list(self.groups)})"

    def local_item_bytes(self, tp_rank: int, tp_size: int) -> int:
        """Bytes of one item on that rank."""
        units = sum(r.length for r in self.ranges(tp_rank, tp_size))
        return self.outer * units * self.inner_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """One registered tensor: ``nbytes`` at ``ptr``, indexed in items of ``item_bytes``
    bytes, ``item_stride`` bytes apart.

    ``item_bytes == 0`` marks an *elided* tensor (a layer that keeps its place in
    the list but holds nothing, e.g. a DSA skip-top-k layer); it moves nothing.

    ``stride``: bytes from one item's start to the next; 0 (the default) means
    ``item_bytes`` (a stride equal to ``item_bytes`` is stored as 0, so the two
    spellings compare equal). A larger stride pads items: only the first
    ``item_bytes`` of each stride are the item; the rest is never read or written.
    Only opaque (``RowKind.ITEM``) tensors may pad: token and ring rows are addressed
    as consecutive rows. The stride is rank-local, like ``ptr`` and ``nbytes``
    (padding may differ by TP size): it is no part of :meth:`geometry`.
    """

    name: str
    layer_id: int
    ptr: int
    nbytes: int
    item_bytes: int
    stride: int = 0
    dtype: str = "uint8"
    rows: int = 1
    row_kind: RowKind = RowKind.ITEM
    shard: ShardSpec | None = None
    memory: MemoryKind = MemoryKind.HOST
    device: int = 0

    def __post_init__(self) -> None:
        where = f"tensor {self.name!r} (layer {self.layer_id})"
        if not self.name:
            raise LayoutError("a tensor needs a non-empty name")
        if self.ptr < 0 or self.nbytes < 0 or self.item_bytes < 0 or self.stride < 0:
            raise LayoutError(
                f"{where}: ptr, nbytes, item_bytes and stride must be >= 0, got ptr={self.ptr}, "
                f"nbytes={self.nbytes}, item_bytes={self.item_bytes}, stride={self.stride}"
            )
        if self.stride == self.item_bytes:
            object.__setattr__(self, "stride", 0)
        if self.stride and self.stride < self.item_bytes:
            raise LayoutError(
                f"{where}: stride {self.stride} is smaller than one item ({self.item_bytes} B); "
                f"items would overlap"
            )
        if self.layer_id < NO_LAYER:
            raise LayoutError(f"{where}: layer_id must be >= 0 or NO_LAYER (-1)")
        if self.rows < 1:
            raise LayoutError(f"{where}: rows must be >= 1, got {self.rows}")
        if self.row_kind is RowKind.ITEM and self.rows != 1:
            raise LayoutError(f"{where}: an opaque (ITEM) tensor has rows=1, got {self.rows}")
        if self.stride and self.row_kind is not RowKind.ITEM:
            raise LayoutError(
                f"{where}: stride {self.stride} != item_bytes {self.item_bytes}, but only opaque "
                f"(ITEM) tensors may pad their items; {self.row_kind.value} rows are contiguous"
            )
        if self.item_bytes and self.item_bytes % self.rows:
            raise LayoutError(
                f"{where}: item_bytes {self.item_bytes} is not a whole number of its "
                f"{self.rows} rows"
            )
        if self.item_bytes and self.nbytes < self.item_bytes and self.nbytes:
            raise LayoutError(
                f"{where}: nbytes {self.nbytes} is smaller than one item ({self.item_bytes} B)"
            )
        if self.shard is not None and self.shard.outer % self.rows:
            raise LayoutError(
                f"{where}: shard outer {self.shard.outer} is not a multiple of rows {self.rows}"
            )

    @property
    def key(self) -> tuple[str, int]:
        """What a tensor pairs by across prefill and decode: ``(name, layer_id)``."""
        return (self.name, self.layer_id)

    @property
    def elided(self) -> bool:
        return self.item_bytes == 0

    @property
    def item_stride(self) -> int:
        """Bytes from one item's start to the next: ``stride``, or ``item_bytes`` when 0."""
        return self.stride or self.item_bytes

    @property
    def capacity(self) -> int:
        """How many items fit in the tensor: item ``i`` spans
        ``[i * item_stride, i * item_stride + item_bytes)``, so the last one needs no
        padding after it."""
        if not self.item_bytes or self.nbytes < self.item_bytes:
            return 0
        return (self.nbytes - self.item_bytes) // self.item_stride + 1

    @property
    def row_bytes(self) -> int:
        return self.item_bytes // self.rows

    def geometry(self) -> tuple[object, ...]:
        """What both sides must agree on for this tensor, independent of TP, PP, page and
        ring size: dtype, row kind, and the global shape of one row."""
        if self.elided:
            return ("elided",)
        if self.shard is None:
            shape: tuple[object, ...] = ("replicated", self.row_bytes)
        else:
            s = self.shard
            shape = ("sharded", s.outer // self.rows, s.groups, s.inner_bytes)
        rows: tuple[object, ...] = () if self.row_kind is not RowKind.ITEM else ("item",)
        return (self.dtype, self.row_kind.value, *rows, *shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class Component:
    """One logical piece of a request's state: a type, a stable name, its tensors.

    Components pair across prefill and decode by ``name``; tensors pair by
    ``(name, layer_id)``.
    """

    type: StateType
    name: str
    tensors: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        if not self.name:
            raise LayoutError("a component needs a non-empty name")
        if not isinstance(self.type, StateType):
            raise LayoutError(
                f"component {self.name!r}: unknown state type {self.type!r}; "
                f"known: {[t.value for t in StateType]}"
            )
        object.__setattr__(self, "tensors", tuple(self.tensors))
        seen: set[tuple[str, int]] = set()
        for t in self.tensors:
            if t.key in seen:
                raise LayoutError(
                    f"component {self.name!r}: duplicate tensor {t.name!r} for layer {t.layer_id}"
                )
            seen.add(t.key)


@dataclass(frozen=True, slots=True, kw_only=True)
class Region:
    """A registered memory block; tensors are views into regions."""

    ptr: int
    nbytes: int
    memory: MemoryKind = MemoryKind.HOST
    device: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """Everything one rank registers.

    ``layers`` is the half-open range of global model layers this rank owns
    (its PP stage); tensors with a ``layer_id`` outside it are an error.
    ``regions`` are the memory blocks the transport registers; when omitted,
    each tensor is its own region. Every tensor must lie inside one region.
    ``identity`` is what an engine says both sides must share beyond shapes, as
    ``(field, value)`` pairs (model, dtype, block size, …); the handshake refuses a
    pair whose identities differ, naming each field and both values. ``model`` is what
    the engine calls the model, for messages only (not compared, hashed or sent): a
    refusal of this layout names it.
    """

    page_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    layers: tuple[int, int] = (0, 1 << 30)
    components: tuple[Component, ...] = ()
    regions: tuple[Region, ...] = ()
    identity: tuple[tuple[str, str], ...] = ()
    model: str = field(default="", compare=False)
    _hash: int = field(init=False, repr=False, compare=False, default=0)
    _signature: str = field(init=False, repr=False, compare=False, default="")
    _model_signature: str = field(init=False, repr=False, compare=False, default="")

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise LayoutError(f"page_size must be >= 1, got {self.page_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(f"tp_rank {self.tp_rank} is outside TP size {self.tp_size}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise LayoutError(f"pp_rank {self.pp_rank} is outside PP size {self.pp_size}")
        lo, hi = self.layers
        if not 0 <= lo <= hi:
            raise LayoutError(f"layers must be a range 0 <= start <= end, got {self.layers}")
        object.__setattr__(self, "components", tuple(self.components))
        object.__setattr__(self, "identity", tuple((str(k), str(v)) for k, v in self.identity))
        keys = [k for k, _ in self.identity]
        if len(set(keys)) != len(keys):
            raise LayoutError(f"identity fields repeat: {sorted(keys)}")
        names = [c.name for c in self.components]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise LayoutError(f"duplicate component names: {sorted(dup)}")
        if not self.regions:
            regions = tuple(
                Region(ptr=t.ptr, nbytes=t.nbytes, memory=t.memory, device=t.device)
                for c in self.components
                for t in c.tensors
                if t.nbytes
            )
            object.__setattr__(self, "regions", regions)
        for c in self.components:
            for t in c.tensors:
                self._check_tensor(c, t)
        object.__setattr__(self, "_signature", _signature(self))
        object.__setattr__(self, "_model_signature", _model_signature(self))
        object.__setattr__(
            self,
            "_hash",
            hash((self._signature, self.page_size, self.tp_rank, self.tp_size, self.pp_rank,
                  self.pp_size, self.layers, self.components)),
        )

    def _check_tensor(self, c: Component, t: TensorSpec) -> None:
        where = f"{self.model + ': ' if self.model else ''}component {c.name!r} tensor " \
                f"{t.name!r} (layer {t.layer_id})"
        lo, hi = self.layers
        if t.layer_id != NO_LAYER and not lo <= t.layer_id < hi:
            raise LayoutError(
                f"{where}: layer {t.layer_id} is outside this rank's layers {lo}..{hi}"
            )
        if t.shard is not None and not t.elided:
            try:
                want = t.shard.local_item_bytes(self.tp_rank, self.tp_size)
            except LayoutError as e:
                raise LayoutError(f"{where} at TP rank {self.tp_rank} of {self.tp_size}: {e}"
                                  ) from None
            if want != t.item_bytes:
                s = t.shard
                local = [r.length for r in s.ranges(self.tp_rank, self.tp_size)]
                raise LayoutError(
                    f"{where}: item_bytes {t.item_bytes} != outer {s.outer} x local axis "
                    f"{sum(local)} (groups {local} of {s.groups}) x inner {s.inner_bytes} B "
                    f"= {want} at TP rank {self.tp_rank}/{self.tp_size}"
                )
        if t.nbytes and not any(
            r.ptr <= t.ptr and t.ptr + t.nbytes <= r.ptr + r.nbytes and r.memory == t.memory
            and r.device == t.device
            for r in self.regions
        ):
            raise LayoutError(
                f"{where}: bytes [{t.ptr:#x}, {t.ptr + t.nbytes:#x}) lie outside every "
                f"registered {t.memory.value} region"
            )

    def __hash__(self) -> int:
        return self._hash

    @property
    def signature(self) -> str:
        """Stable hash over what prefill and decode must agree on (model-level shapes,
        component names and types, dtypes) and nothing that may differ (TP, PP, page
        size, ring sizes, addresses, capacities)."""
        return self._signature

    @property
    def model_signature(self) -> str:
        """Stable hash of the model's state as every rank of one deployment holds it,
        whatever layers its PP stage covers: component names and state types (a stage
        without attention layers still has the KV component, with no tensors).

        :attr:`signature` also covers the tensor kinds a rank holds, which differ between
        PP stages (no K/V tensors on a stage of linear-attention layers only; the draft
        ring on the last stage only), so stages of one model have different signatures.
        The bootstrap server keys a deployment by this one; the handshake checks
        :attr:`signature` and every tensor per rank pair, and that the PP stages cover
        every layer."""
        return self._model_signature

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        have = [c.name for c in self.components]
        raise KeyError(f"layout has no component {name!r}; it has {have}")

    def describe(self) -> dict[str, object]:
        """A JSON-friendly summary (used by handshakes, CLI output and tests)."""
        return {
            "page_size": self.page_size,
            "tp": [self.tp_rank, self.tp_size],
            "pp": [self.pp_rank, self.pp_size],
            "layers": list(self.layers),
            "components": {
                c.name: {"type": c.type.value, "tensors": len(c.tensors)} for c in self.components
            },
            "signature": self.signature,
        }


def _model_signature(layout: Layout) -> str:
    parts = sorted([c.name, c.type.value] for c in layout.components)
    return hashlib.sha256(json.dumps(["model", parts]).encode()).hexdigest()[:16]


def _signature(layout: Layout) -> str:
    parts: list[object] = []
    for c in sorted(layout.components, key=lambda c: c.name):
        kinds = sorted({json.dumps([t.name, *t.geometry()], default=str) for t in c.tensors})
        parts.append([c.name, c.type.value, kinds])
    if layout.identity:  # absent from the hash when unused, so older signatures stay put
        parts.append(["identity", [list(kv) for kv in sorted(layout.identity)]])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
