"""Every control message kvhandoff sends, as typed, tagged, frozen msgspec Structs.

Bytes in, messages out, no I/O: :func:`encode_message` / :func:`decode_message`
are the only entry points, and a decoded message is always one member of
:data:`Message` (dispatch with ``match``). Fields travel by name (msgpack maps
tagged with ``type`` = the class name); nothing is parsed by position.

Conversation (decode ranks start every exchange; prefill ranks answer)::

    decode ──Hello──────────▶ prefill      once per (decode rank, prefill rank)
    decode ◀─HelloAck / HelloReject──
    decode ──TransferInit───▶ prefill      once per request, to every writing prefill rank
                                            (several in one TransferInits: an engine step's)
    decode ◀─TransferStatus──  prefill      per KV chunk; ``last`` closes the request
                                            (in band as a StatusNotice, when both can)
    either ──Abort──────────▶ either       the request is dead; no more writes
    decode ◀─AbortAck────────  prefill      no write for that request is in flight any more
    either ──Heartbeat──────▶ either       liveness; answered with HeartbeatAck
    either ◀─ErrorReply──────               the answer to bytes that did not decode

Wire rules:

* Index arrays are raw little-endian int64 bytes (:func:`pack_indices`), never
  msgpack arrays of ints: one copy, no per-element work.
* A :class:`~kvhandoff.layout.Layout` travels as a :class:`LayoutMsg` with every field
  (:func:`layout_to_msg` / :func:`layout_from_msg`, exact round trip).
* :data:`PROTOCOL_VERSION` is sent in ``Hello`` and checked at handshake. Unknown
  fields are rejected rather than ignored: two sides that disagree on a message's
  shape are a version mismatch, and guessing would be silent corruption.
* Anything that does not decode, is too large, or breaks a field constraint raises
  :class:`ProtocolError` (the peer's fault) and nothing else; a worker thread turns it
  into an :class:`ErrorReply` and carries on.

Struct constructors do not type-check (msgspec validates on decode only); the
cross-field checks in ``__post_init__`` run on construction and on decode alike.
"""

from __future__ import annotations

import enum
import struct
from typing import Annotated, Final

import msgspec
import numpy as np

from kvhandoff.errors import LayoutError
from kvhandoff.errors import LocalProtocolError as LocalProtocolError
from kvhandoff.errors import ProtocolError as ProtocolError
from kvhandoff.layout import (
    Component,
    Layout,
    MemoryKind,
    Region,
    RowKind,
    ShardSpec,
    TensorSpec,
)
from kvhandoff.plan.request import IndexArray, Indices
from kvhandoff.state_types import StateType

PROTOCOL_VERSION: Final = 6
"""Bumped on any change to a message's fields or meaning; compared at handshake.
2: ``ErrorReply.code``. 4: ``StatusNotice.more`` (a notice may carry several statuses;
a version-3 decode rank would drop such notices and time out). 5: ``TransferInits`` (a
version-4 prefill rank would refuse it). 6: ``TransferInit.proof`` (a request bound to
its decode, :mod:`kvhandoff.binding`)."""

MAX_BATCHED_INITS: Final = 256
"""Most ``TransferInit`` one :class:`TransferInits` carries: one message never holds the
control thread much longer than its neighbours."""

MAX_MESSAGE_BYTES: Final = 64 << 20
"""Largest control message accepted (or sent). Index lists of a 1M-token request at
page size 1 take 8 MiB per component; anything near this limit is a bug or an attack."""


# ProtocolError (the peer's fault; answer with ErrorReply) and LocalProtocolError (ours)
# live in kvhandoff.errors and are re-exported here.


# ---------------------------------------------------------------------------------------
# Field types

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Pos = Annotated[int, msgspec.Meta(ge=1)]
RequestId = str | int
"""A request's id, unique per prefill deployment (sglang's ``bootstrap_room``)."""


class _Record(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A nested (untagged) wire record."""


class _Msg(msgspec.Struct, tag=True, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A top-level message; its tag is the class name."""


class RankId(_Record, frozen=True):
    """Which rank speaks: ``instance`` names the prefill or decode deployment
    (e.g. its bootstrap address), the rest place the rank inside it."""

    instance: str
    dp_rank: NonNeg = 0
    tp_rank: NonNeg = 0
    tp_size: Pos = 1
    pp_rank: NonNeg = 0
    pp_size: Pos = 1

    def __post_init__(self) -> None:
        if self.tp_rank >= self.tp_size or self.pp_rank >= self.pp_size:
            raise ValueError(
                f"rank outside its group: tp {self.tp_rank}/{self.tp_size}, "
                f"pp {self.pp_rank}/{self.pp_size}"
            )

    def __str__(self) -> str:
        return (f"{self.instance} dp{self.dp_rank} tp{self.tp_rank}/{self.tp_size} "
                f"pp{self.pp_rank}/{self.pp_size}")


# ---------------------------------------------------------------------------------------
# Index arrays


_WIRE_I64 = np.dtype("<i8")  # index lists travel little-endian
_NATIVE = np.dtype(np.int64) == _WIRE_I64
_ONE = struct.Struct("<q")


def pack_indices(values: object) -> bytes:
    """A 1-D integer array (or sequence) as little-endian int64 bytes.

    Raises ``ValueError`` for anything that is not 1-D integers representable as
    int64 (a local bug: the caller built the list)."""
    if type(values) is np.ndarray and values.dtype == _WIRE_I64 and values.ndim == 1:
        return values.tobytes()  # the common case: already what travels
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"index list must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"index list must hold integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError("index list holds values above the int64 range")
    return arr.astype("<i8", copy=False).tobytes()


def unpack_indices(data: bytes | bytearray | memoryview, what: str = "index list") -> IndexArray:
    """The read-only int64 array packed in ``data``; :class:`ProtocolError` unless its
    length is a whole number of 8-byte entries."""
    if len(data) % 8:
        raise ProtocolError(f"{what}: {len(data)} bytes is not a whole number of int64 entries")
    # an array over bytes (immutable) is read-only already
    arr = np.frombuffer(data if type(data) is bytes else bytes(data), dtype=_WIRE_I64)
    if not _NATIVE:  # a big-endian host: a native copy, read-only too
        arr = arr.astype(np.int64)
        arr.flags.writeable = False
    return arr


class IndexListMsg(_Record, frozen=True):
    """One side's index list of one component, plus the row fields of
    :class:`~kvhandoff.plan.request.Indices` that side decides.

    ``items``: packed item indices (pages, slots or rows). ``first_row`` / ``num_rows``:
    token rows for re-paged TOKEN tensors. ``positions``: logical positions for RING
    tensors whose ring sizes differ (packed like ``items``)."""

    items: bytes
    first_row: NonNeg = 0
    num_rows: NonNeg | None = None
    positions: bytes | None = None

    def __post_init__(self) -> None:
        if len(self.items) % 8 or (self.positions is not None and len(self.positions) % 8):
            raise ValueError("packed index bytes must be a whole number of int64 entries")

    @classmethod
    def of(
        cls, items: object, *, first_row: int = 0, num_rows: int | None = None,
        positions: object | None = None,
    ) -> IndexListMsg:
        """Pack an index list (and optional positions) for the wire."""
        return cls(
            items=pack_indices(items), first_row=first_row, num_rows=num_rows,
            positions=None if positions is None else pack_indices(positions),
        )

    @classmethod
    def one(cls, item: int) -> IndexListMsg:
        """A one-item list (an aux row)."""
        return cls(items=_ONE.pack(item))

    @property
    def num_items(self) -> int:
        # a property, not __len__: an empty list must not be falsy like a missing one
        return len(self.items) // 8

    def array(self) -> IndexArray:
        return unpack_indices(self.items, "items")

    def positions_array(self) -> IndexArray | None:
        return None if self.positions is None else unpack_indices(self.positions, "positions")

    def to_indices(self, src: object, *, src_first_row: int = 0) -> Indices:
        """Planner input pairing the local source list ``src`` with this destination list."""
        return Indices(
            src, self.array(), src_first_row=src_first_row, dst_first_row=self.first_row,
            num_rows=self.num_rows, positions=self.positions_array(),
        )


class PlannedIndicesMsg(_Record, frozen=True):
    """One component's planner input for one chunk exactly as prefill planned it: both
    sides' packed items and the row fields of :class:`~kvhandoff.plan.request.Indices`.

    Sent back with checksums so decode can rebuild the same plan and read the destination
    bytes in the same order (:mod:`kvhandoff.session.request.checksum`)."""

    src: bytes
    dst: bytes
    src_first_row: NonNeg = 0
    dst_first_row: NonNeg = 0
    num_rows: NonNeg | None = None
    positions: bytes | None = None

    def __post_init__(self) -> None:
        for b in (self.src, self.dst, self.positions or b""):
            if len(b) % 8:
                raise ValueError("packed index bytes must be a whole number of int64 entries")

    @classmethod
    def of(cls, idx: Indices) -> PlannedIndicesMsg:
        return cls(
            src=pack_indices(idx.src), dst=pack_indices(idx.dst),
            src_first_row=idx.src_first_row, dst_first_row=idx.dst_first_row,
            num_rows=idx.num_rows,
            positions=None if idx.positions is None else pack_indices(idx.positions),
        )

    def to_indices(self) -> Indices:
        pos = None if self.positions is None else unpack_indices(self.positions, "positions")
        return Indices(
            unpack_indices(self.src, "src"), unpack_indices(self.dst, "dst"),
            src_first_row=self.src_first_row, dst_first_row=self.dst_first_row,
            num_rows=self.num_rows, positions=pos,
        )


# ---------------------------------------------------------------------------------------
# Layouts


class ShardMsg(_Record, frozen=True):
    outer: int
    groups: tuple[int, ...]
    inner_bytes: int


class TensorMsg(_Record, frozen=True, omit_defaults=True):
    """A :class:`~kvhandoff.layout.TensorSpec`. ``stride`` (padded items) was added
    without a protocol version bump: 0 is omitted on the wire, so a layout without
    padded items encodes as before, and a peer that predates the field refuses one
    with padded items (an unknown field) instead of misplacing its bytes."""

    name: str
    layer_id: int
    ptr: NonNeg
    nbytes: NonNeg
    item_bytes: NonNeg
    dtype: str
    rows: int
    row_kind: RowKind
    shard: ShardMsg | None
    memory: MemoryKind
    device: int
    stride: NonNeg = 0


class ComponentMsg(_Record, frozen=True):
    type: StateType
    name: str
    tensors: tuple[TensorMsg, ...]


class RegionMsg(_Record, frozen=True):
    ptr: NonNeg
    nbytes: NonNeg
    memory: MemoryKind
    device: int


class LayoutMsg(_Record, frozen=True):
    """Every field of a :class:`~kvhandoff.layout.Layout`, plus the sender's signature
    (checked on arrival: two builds that hash differently cannot compare layouts)."""

    page_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    layers: tuple[int, int]
    components: tuple[ComponentMsg, ...]
    regions: tuple[RegionMsg, ...]
    signature: str
    identity: tuple[tuple[str, str], ...] = ()


def layout_to_msg(layout: Layout) -> LayoutMsg:
    """The wire form of ``layout``; :func:`layout_from_msg` gives back an equal Layout."""
    return LayoutMsg(
        page_size=layout.page_size, tp_rank=layout.tp_rank, tp_size=layout.tp_size,
        pp_rank=layout.pp_rank, pp_size=layout.pp_size, layers=layout.layers,
        components=tuple(
            ComponentMsg(type=c.type, name=c.name, tensors=tuple(_tensor_msg(t) for t in c.tensors))
            for c in layout.components
        ),
        regions=tuple(
            RegionMsg(ptr=r.ptr, nbytes=r.nbytes, memory=r.memory, device=r.device)
            for r in layout.regions
        ),
        signature=layout.signature,
        identity=layout.identity,
    )


def _tensor_msg(t: TensorSpec) -> TensorMsg:
    s = t.shard
    return TensorMsg(
        name=t.name, layer_id=t.layer_id, ptr=t.ptr, nbytes=t.nbytes, item_bytes=t.item_bytes,
        stride=t.stride, dtype=t.dtype, rows=t.rows, row_kind=t.row_kind, memory=t.memory,
        device=t.device,
        shard=None if s is None else ShardMsg(outer=s.outer, groups=s.groups,
                                              inner_bytes=s.inner_bytes),
    )


def layout_from_msg(msg: LayoutMsg) -> Layout:
    """Rebuild the peer's Layout. :class:`ProtocolError` when it fails the Layout's own
    validation (with the reason) or its signature differs from the one the peer sent."""
    try:
        layout = Layout(
            page_size=msg.page_size, tp_rank=msg.tp_rank, tp_size=msg.tp_size,
            pp_rank=msg.pp_rank, pp_size=msg.pp_size, layers=msg.layers,
            components=tuple(
                Component(type=c.type, name=c.name,
                          tensors=tuple(_tensor_from(t) for t in c.tensors))
                for c in msg.components
            ),
            regions=tuple(
                Region(ptr=r.ptr, nbytes=r.nbytes, memory=r.memory, device=r.device)
                for r in msg.regions
            ),
            identity=msg.identity,
        )
    except LayoutError as e:
        raise ProtocolError(f"peer layout is invalid: {e}") from e
    if layout.signature != msg.signature:
        raise ProtocolError(
            f"peer layout signature {msg.signature} != {layout.signature} computed here from "
            f"the same fields; the two sides run incompatible kvhandoff builds"
        )
    return layout


def _tensor_from(t: TensorMsg) -> TensorSpec:
    s = t.shard
    return TensorSpec(
        name=t.name, layer_id=t.layer_id, ptr=t.ptr, nbytes=t.nbytes, item_bytes=t.item_bytes,
        stride=t.stride, dtype=t.dtype, rows=t.rows, row_kind=t.row_kind, memory=t.memory,
        device=t.device,
        shard=None if s is None else ShardSpec(outer=s.outer, groups=s.groups,
                                               inner_bytes=s.inner_bytes),
    )


# ---------------------------------------------------------------------------------------
# Messages


class Hello(_Msg, frozen=True):
    """decode → prefill, once per rank pair: who I am, what I registered, how to reach me."""

    protocol_version: int
    rank: RankId  # the decode rank
    layout: LayoutMsg
    transport: str  # transport name, e.g. "tcp", "mooncake"
    transport_endpoint: bytes  # what the prefill transport's connect() needs
    control_endpoint: str  # where this decode rank receives control messages
    notices: bool = False  # takes TransferStatus in band, as a StatusNotice (see there)


class HelloAck(_Msg, frozen=True):
    """prefill → decode: the pair is compatible and planned.

    ``writes``: whether this prefill rank writes any byte into the decode rank (the
    planner decides; see :mod:`kvhandoff.session.peers.mapping`). Decode sends
    :class:`TransferInit` to, and waits for :class:`TransferStatus` from, every
    handshaken candidate: a non-writer validates the request and reports success without
    writing, so every prefill rank of the request learns its outcome."""

    protocol_version: int
    rank: RankId  # the prefill rank
    layout_signature: str
    writes: bool
    layout: LayoutMsg | None = None  # the prefill rank's layout (decode rebuilds plans from it)


class HelloReject(_Msg, frozen=True):
    """prefill → decode: the pair cannot work; every reason, one actionable line each."""

    protocol_version: int
    rank: RankId  # the prefill rank
    problems: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.problems:
            raise ValueError("a HelloReject must list at least one problem")


class TransferInit(_Msg, frozen=True):
    """decode → prefill, per request: where the request's state goes on this decode rank.

    ``indices`` names every component of the decode layout (KV pages under the KV
    component, the aux row under the aux component): its destination list, or ``None``
    when that component does not move for this request. Prefill slices the KV list
    per chunk. ``decode_prefix_len``: tokens decode already holds (a prefix-cache hit).
    ``proof``: that the request was routed to this decode rank, when the request has a
    key (:meth:`kvhandoff.binding.RequestKey.prove`); a prefill Sender with a key takes
    no indices without it."""

    request_id: RequestId
    rank: RankId  # the decode rank
    indices: dict[str, IndexListMsg | None]
    decode_prefix_len: NonNeg = 0
    expect_checksum: bool = False
    proof: Annotated[bytes, msgspec.Meta(max_length=64)] | None = None


class TransferInits(_Msg, frozen=True):
    """decode → prefill: the ``TransferInit`` of several requests, in one message (the
    requests one engine step opened, for this prefill rank). Each is handled exactly as
    if it had come alone, in order."""

    inits: tuple[TransferInit, ...]

    def __post_init__(self) -> None:
        if not 0 < len(self.inits) <= MAX_BATCHED_INITS:
            raise ValueError(f"a TransferInits carries 1 to {MAX_BATCHED_INITS} "
                             f"TransferInit, got {len(self.inits)}")


class Outcome(enum.StrEnum):
    SUCCESS = "success"
    FAILED = "failed"


class TransferStatus(_Msg, frozen=True):
    """prefill → decode, per chunk: the writes of chunk ``chunk`` completed (or failed).

    ``last`` marks the final chunk (it carries state and aux and may carry no KV).
    ``nbytes``: bytes this rank wrote for the chunk. ``checksums``: per component name,
    a digest of the bytes written, when the TransferInit asked for them; ``indices`` then
    holds each checksummed component's planner input, so decode can rebuild the plan and
    digest the destination bytes in the same order."""

    request_id: RequestId
    rank: RankId  # the prefill rank
    chunk: NonNeg
    last: bool
    outcome: Outcome
    reason: str = ""
    nbytes: NonNeg = 0
    checksums: dict[str, int] | None = None
    indices: dict[str, PlannedIndicesMsg] | None = None  # the plan's input, with checksums

    def __post_init__(self) -> None:
        if self.outcome is Outcome.FAILED and not self.reason:
            raise ValueError("a failed TransferStatus must say why (reason)")


class Abort(_Msg, frozen=True):
    """Either direction: the request is dead; the receiver stops writing or waiting."""

    request_id: RequestId
    rank: RankId  # the sender
    reason: str


class AbortAck(_Msg, frozen=True):
    """prefill → decode: no write for ``request_id`` is in flight from this rank any more,
    so decode may reuse the request's destination pages."""

    request_id: RequestId
    rank: RankId  # the prefill rank


class Heartbeat(_Msg, frozen=True):
    seq: NonNeg
    sender: str


class HeartbeatAck(_Msg, frozen=True):
    seq: NonNeg  # the Heartbeat's seq
    sender: str


class ErrorCode(enum.StrEnum):
    """What an :class:`ErrorReply` lets the receiver act on (beyond reading ``reason``)."""

    UNKNOWN_PEER = "unknown_peer"  # no accepted Hello from the sender: handshake again


class ErrorReply(_Msg, frozen=True):
    """The answer to a message that did not decode or made no sense in context."""

    reason: str
    request_id: RequestId | None = None
    code: ErrorCode | None = None


Message = (
    Hello | HelloAck | HelloReject | TransferInit | TransferInits | TransferStatus | Abort
    | AbortAck | Heartbeat | HeartbeatAck | ErrorReply
)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


class StatusNotice(_Record, frozen=True, omit_defaults=True):
    """prefill → decode *in band*: a successful :class:`TransferStatus` carried by the
    transport as the notice of the chunk's own writes (transports with
    ``capabilities.notices``, to a decode rank whose ``Hello`` said ``notices``), so it
    lands right after the bytes, without a control-socket hop. Not a control message.
    ``to``: the decode rank's control endpoint (several decode agents may share one
    transport); ``sender``: the prefill rank's.

    ``more``: the statuses of the other chunks whose writes rode in the same submit
    (prefill batches the writes of requests that are ready together; see
    :mod:`kvhandoff.session.control.write_batch`). Omitted when empty, so a notice of one status
    is the same bytes as before batching existed."""

    to: str
    sender: str
    status: TransferStatus
    more: tuple[TransferStatus, ...] = ()

    @property
    def statuses(self) -> tuple[TransferStatus, ...]:
        """Every status the notice carries, in the order they were batched."""
        return (self.status, *self.more)


_NOTICE_DECODER = msgspec.msgpack.Decoder(StatusNotice)


def encode_notice(notice: StatusNotice) -> bytes:
    try:
        return _ENCODER.encode(notice)
    except (msgspec.EncodeError, TypeError, OverflowError, ValueError) as e:
        raise LocalProtocolError(f"cannot encode StatusNotice: {e}") from e


def decode_notice(buf: bytes) -> StatusNotice:
    """A :class:`StatusNotice` from its bytes; :class:`ProtocolError` (only) if they are
    not one."""
    try:
        return _NOTICE_DECODER.decode(buf)
    except _DECODE_ERRORS as e:
        raise ProtocolError(f"malformed status notice ({len(buf)} B): {e}") from None


class _VersionProbe(msgspec.Struct, tag="Hello"):
    """Just the version of a Hello that failed to decode, to name the real cause."""

    protocol_version: int


_PROBE = msgspec.msgpack.Decoder(_VersionProbe)


def encode_message(msg: Message) -> bytes:
    """The wire bytes of ``msg``. :class:`LocalProtocolError` if it cannot be encoded
    (a field of the wrong type) or exceeds :data:`MAX_MESSAGE_BYTES`."""
    try:
        buf = _ENCODER.encode(msg)
    except (msgspec.EncodeError, TypeError, OverflowError, ValueError) as e:
        raise LocalProtocolError(f"cannot encode {type(msg).__name__}: {e}") from e
    if len(buf) > MAX_MESSAGE_BYTES:
        raise LocalProtocolError(
            f"{type(msg).__name__} is {len(buf)} B, over MAX_MESSAGE_BYTES ({MAX_MESSAGE_BYTES})"
        )
    return buf


# msgspec reports bad input as DecodeError (ValidationError included), except invalid
# UTF-8 in a string (UnicodeDecodeError, a ValueError) and nesting deeper than its limit
# in a skipped value (RecursionError); the fuzz tests found both.
_DECODE_ERRORS = (msgspec.DecodeError, ValueError, RecursionError)


def decode_message(buf: bytes | bytearray | memoryview) -> Message:
    """One message from its wire bytes. Raises :class:`ProtocolError` (and nothing else)
    for input that is not bytes-like, oversized, malformed msgpack, an unknown tag, a
    missing, unknown or mistyped field, or a field outside its range."""
    try:
        view = memoryview(buf)
    except TypeError:
        raise ProtocolError(f"expected bytes, got {type(buf).__name__}") from None
    if view.nbytes > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            f"message of {view.nbytes} B exceeds MAX_MESSAGE_BYTES ({MAX_MESSAGE_BYTES})"
        )
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    try:
        msg: Message = _DECODER.decode(view)
    except _DECODE_ERRORS as e:
        raise ProtocolError(_why(view, e)) from None
    return msg


def _why(view: memoryview, err: Exception) -> str:
    try:
        version = _PROBE.decode(view).protocol_version
    except _DECODE_ERRORS:
        version = PROTOCOL_VERSION
    if version != PROTOCOL_VERSION:
        return (f"peer speaks control protocol version {version}, this side {PROTOCOL_VERSION}; "
                f"run the same kvhandoff release on prefill and decode ({err})")
    return f"malformed control message: {err}"
