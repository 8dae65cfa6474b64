"""Control messages: exact round trips, layouts on the wire, and a decoder that only ever
returns a Message or raises ProtocolError, whatever bytes arrive."""

from __future__ import annotations

import contextlib
import inspect
import subprocess
import sys
import typing

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

import kvhandoff
import kvhandoff.errors as errors
import kvhandoff.session as session
import kvhandoff.session.errors as session_errors
import kvhandoff.transport as transport
import kvhandoff.transport.errors as transport_errors
from kvhandoff import protocol
from kvhandoff.lab import shapes
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
from kvhandoff.plan import Indices
from kvhandoff.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    ErrorReply,
    Heartbeat,
    HeartbeatAck,
    Hello,
    HelloAck,
    HelloReject,
    IndexListMsg,
    LocalProtocolError,
    Message,
    Outcome,
    ProtocolError,
    RankId,
    TransferInit,
    TransferInits,
    TransferStatus,
    decode_message,
    encode_message,
    layout_from_msg,
    layout_to_msg,
    pack_indices,
    unpack_indices,
)
from kvhandoff.state_types import StateType

DECODE = RankId(instance="decode-0", dp_rank=0, tp_rank=1, tp_size=2)
PREFILL = RankId(instance="prefill-0", dp_rank=1, tp_rank=3, tp_size=4, pp_rank=1, pp_size=2)


def tiny_layout(name: str = "qwen3_next", *, tp_rank: int = 1, tp_size: int = 2,
                pp_rank: int = 0, pp_size: int = 1) -> Layout:
    return shapes.layout_for(
        shapes.tiny(shapes.get(name)), tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
        pp_size=pp_size, page_size=128 if name == "deepseek_v4" else 4, num_pages=8,
        num_slots=4,
    )


def examples() -> list[Message]:
    """One instance of every message type, with every optional field exercised."""
    lay = layout_to_msg(tiny_layout())
    init = TransferInit(
        request_id="req-7", rank=DECODE,
        indices={
            "kv": IndexListMsg.of([5, 9, 2], first_row=3, num_rows=10),
            "mamba": IndexListMsg.of([1]),
            "swa": IndexListMsg.of([], positions=[4, 5, 6]),
            "aux": None,
        },
        decode_prefix_len=16, expect_checksum=True,
    )
    return [
        Hello(protocol_version=PROTOCOL_VERSION, rank=DECODE, layout=lay, transport="tcp",
              transport_endpoint=b"\x00\x01tcp://x", control_endpoint="tcp://10.0.0.2:5555"),
        HelloAck(protocol_version=PROTOCOL_VERSION, rank=PREFILL, layout_signature="abc",
                 writes=True),
        HelloReject(protocol_version=PROTOCOL_VERSION, rank=PREFILL,
                    problems=("component 'mamba' exists on prefill only", "another")),
        init,
        replace(init, request_id=2**63 + 5),
        TransferInits(inits=(init, replace(init, request_id=8, indices={"kv": None}))),
        TransferStatus(request_id="req-7", rank=PREFILL, chunk=2, last=True,
                       outcome=Outcome.SUCCESS, nbytes=4096, checksums={"kv": 123, "aux": 0}),
        TransferStatus(request_id=-3, rank=PREFILL, chunk=0, last=False,
                       outcome=Outcome.FAILED, reason="peer lost"),
        Abort(request_id="req-7", rank=DECODE, reason="aborted by engine"),
        AbortAck(request_id="req-7", rank=PREFILL),
        Heartbeat(seq=41, sender="decode-0"),
        HeartbeatAck(seq=41, sender="prefill-0"),
        ErrorReply(reason="malformed", request_id=None),
        ErrorReply(reason="unknown request", request_id="req-8"),
    ]


EXAMPLES = examples()
ENCODED = [encode_message(m) for m in EXAMPLES]


# ---------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_exactly(msg: Message) -> None:
    buf = encode_message(msg)
    back = decode_message(buf)
    assert type(back) is type(msg)
    assert back == msg
    assert decode_message(bytearray(buf)) == msg
    assert decode_message(memoryview(buf)) == msg


def test_every_union_member_has_an_example_and_a_class_name_tag() -> None:
    members = set(typing.get_args(Message))
    assert {type(m) for m in EXAMPLES} == members
    for msg, buf in zip(EXAMPLES, ENCODED, strict=True):
        raw = msgspec.msgpack.decode(buf)
        assert raw["type"] == type(msg).__name__  # fields by name, never by position


def test_messages_are_frozen() -> None:
    msg = ErrorReply(reason="x")
    with pytest.raises(AttributeError):
        msg.reason = "y"  # type: ignore[misc]


def test_index_list_helpers_feed_the_planner() -> None:
    msg = IndexListMsg.of(np.array([7, 8, 9], dtype=np.int32), first_row=2, num_rows=5,
                          positions=[10, 11])
    assert msg.num_items == 3 and IndexListMsg.of([]).num_items == 0
    back = decode_message(encode_message(replace(EXAMPLES[3], indices={"kv": msg})))
    assert isinstance(back, TransferInit)
    got = back.indices["kv"]
    assert got is not None
    idx = got.to_indices([1, 2, 3], src_first_row=1)
    assert isinstance(idx, Indices)
    assert idx.dst.tolist() == [7, 8, 9] and idx.src.tolist() == [1, 2, 3]
    assert (idx.src_first_row, idx.dst_first_row, idx.num_rows) == (1, 2, 5)
    assert idx.positions is not None and idx.positions.tolist() == [10, 11]
    assert IndexListMsg.of([3]).positions_array() is None


# ---------------------------------------------------------------------------------------
# Index arrays


def test_pack_indices_is_little_endian_int64() -> None:
    assert pack_indices([1, -1]) == b"\x01" + b"\x00" * 7 + b"\xff" * 8
    assert pack_indices(np.array([], dtype=np.int32)) == b""
    assert pack_indices(np.array([2**40], dtype=np.uint64)) == (2**40).to_bytes(8, "little")


def test_pack_indices_of_an_int64_array_or_a_strided_view_is_its_values() -> None:
    a = np.arange(8, dtype=np.int64)
    assert pack_indices(a) == pack_indices(a.tolist())
    assert pack_indices(a[::3]) == pack_indices([0, 3, 6])  # not contiguous
    assert IndexListMsg.one(7) == IndexListMsg.of([7]) and IndexListMsg.one(7).num_items == 1


def test_unpack_indices_round_trips_read_only() -> None:
    values = np.array([0, 5, 2**62, -7], dtype=np.int64)
    packed = pack_indices(values)
    for buf in (packed, bytearray(packed), memoryview(packed)):
        out = unpack_indices(buf)
        assert out.dtype == np.int64 and out.tolist() == values.tolist()
        assert not out.flags.writeable
        with pytest.raises(ValueError):
            out.setflags(write=True)  # over immutable bytes: no one can write it
    mutable = bytearray(packed)
    out = unpack_indices(mutable)
    mutable[:8] = bytes(8)  # the caller's buffer changes; the list does not
    assert out.tolist() == values.tolist()
    assert unpack_indices(b"").shape == (0,)


def test_unpack_indices_rejects_partial_entries() -> None:
    with pytest.raises(ProtocolError, match="13 bytes is not a whole number"):
        unpack_indices(b"\x00" * 13)


@pytest.mark.parametrize("bad", [np.zeros((2, 2), dtype=np.int64), [1.5, 2.0],
                                 np.array([2**63], dtype=np.uint64)])
def test_pack_indices_rejects_what_is_not_int64_indices(bad: object) -> None:
    with pytest.raises(ValueError):
        pack_indices(bad)


# ---------------------------------------------------------------------------------------
# Layouts


def _layouts() -> list[Layout]:
    out = []
    for name in sorted(shapes.SHAPES):
        out.append(tiny_layout(name))
        out.append(tiny_layout(name, tp_rank=0, tp_size=1, pp_rank=1, pp_size=2))
    # full-size shape: real numbers, many tensors
    out.append(shapes.layout_for(shapes.get("deepseek_v4"), tp_rank=0, tp_size=1,
                                 page_size=256, num_pages=64, num_slots=8, spec_decode=True))
    base = 1 << 40
    shard = ShardSpec.axis(outer=4, axis=8, inner_bytes=16, groups=(2, 2, 4))
    conv = ShardSpec.axis(axis=8, inner_bytes=6, groups=(2, 2, 4))
    out.append(Layout(
        page_size=4, tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, layers=(0, 3),
        components=(
            Component(type=StateType.KV, name="kv", tensors=(
                TensorSpec(name="k", layer_id=2, ptr=base, nbytes=256 * 8, item_bytes=256,
                           dtype="bf16", rows=4, row_kind=RowKind.TOKEN, shard=shard,
                           memory=MemoryKind.CUDA, device=3),
                TensorSpec(name="skip", layer_id=1, ptr=base, nbytes=0, item_bytes=0,
                           memory=MemoryKind.CUDA, device=3),
            )),
            Component(type=StateType.DSV4_RING, name="ring", tensors=(
                TensorSpec(name="r", layer_id=0, ptr=base + 4096, nbytes=64 * 16,
                           item_bytes=64 * 8, rows=8, row_kind=RowKind.RING,
                           memory=MemoryKind.CUDA, device=3),
            )),
            Component(type=StateType.AUX, name="aux", tensors=(
                TensorSpec(name="aux", layer_id=NO_LAYER, ptr=2**63 + 64, nbytes=64,
                           item_bytes=64),
            )),
            # padded items: conv and SSM states sharing 512 B pages, sharded differently
            Component(type=StateType.MAMBA, name="mamba", tensors=(
                TensorSpec(name="conv", layer_id=1, ptr=2**63 + 1024, nbytes=4 * 512,
                           item_bytes=4 * 6, stride=512, shard=conv),
                TensorSpec(name="ssm", layer_id=1, ptr=2**63 + 1024 + 24,
                           nbytes=3 * 512 + 256, item_bytes=2 * 128, stride=512,
                           shard=ShardSpec.axis(axis=4, inner_bytes=128)),
            )),
        ),
        regions=(Region(ptr=base, nbytes=1 << 20, memory=MemoryKind.CUDA, device=3),
                 Region(ptr=2**63, nbytes=4096)),
    ))
    return out


@pytest.mark.parametrize("layout", _layouts(), ids=lambda lay: lay.signature)
def test_layouts_round_trip_through_the_wire(layout: Layout) -> None:
    hello = replace(EXAMPLES[0], layout=layout_to_msg(layout))
    back = decode_message(encode_message(hello))
    assert isinstance(back, Hello)
    got = layout_from_msg(back.layout)
    assert got == layout
    assert got.signature == layout.signature
    assert got.regions == layout.regions
    assert hash(got) == hash(layout)
    assert [t for c in got.components for t in c.tensors] == [
        t for c in layout.components for t in c.tensors]


def test_a_stride_travels_and_a_packed_tensor_encodes_as_before() -> None:
    """``stride`` round-trips; 0 (packed items) is left off the wire, so layouts without
    padded items encode as they did before the field existed, and a message without it
    decodes as packed."""
    layout = _layouts()[-1]
    msg = layout_to_msg(layout)
    mamba = next(c for c in msg.components if c.name == "mamba")
    assert [t.stride for t in mamba.tensors] == [512, 512]
    got = layout_from_msg(msg).component("mamba").tensors
    assert [(t.stride, t.item_stride, t.capacity) for t in got] == [(512, 512, 4)] * 2
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(msg))
    strides = [["stride" in t for t in c["tensors"]] for c in raw["components"]]
    assert strides == [[False, False], [False], [False], [True, True]]
    packed = msgspec.msgpack.encode(replace(mamba.tensors[0], stride=0))
    assert b"stride" not in packed
    assert msgspec.msgpack.decode(packed, type=protocol.TensorMsg).stride == 0


def test_a_stride_smaller_than_the_item_is_a_protocol_error() -> None:
    msg = layout_to_msg(_layouts()[-1])
    comps = list(msg.components)
    i = next(i for i, c in enumerate(comps) if c.name == "mamba")
    comps[i] = replace(comps[i], tensors=(replace(comps[i].tensors[0], stride=8),
                                          *comps[i].tensors[1:]))
    with pytest.raises(ProtocolError, match=r"'conv'.*stride 8 is smaller than one item"):
        layout_from_msg(replace(msg, components=tuple(comps)))


def test_an_invalid_layout_is_a_protocol_error_with_the_reason() -> None:
    msg = layout_to_msg(tiny_layout())
    comps = list(msg.components)
    mamba = next(i for i, c in enumerate(comps) if c.name == "mamba")
    bad_t = replace(comps[mamba].tensors[0], item_bytes=comps[mamba].tensors[0].item_bytes * 2)
    comps[mamba] = replace(comps[mamba], tensors=(bad_t, *comps[mamba].tensors[1:]))
    with pytest.raises(ProtocolError, match=r"peer layout is invalid: .*'conv'.*item_bytes"):
        layout_from_msg(replace(msg, components=tuple(comps)))
    with pytest.raises(ProtocolError, match="tp_rank 5 is outside TP size 2"):
        layout_from_msg(replace(msg, tp_rank=5))


def test_a_layout_signature_that_differs_is_refused() -> None:
    msg = layout_to_msg(tiny_layout())
    with pytest.raises(ProtocolError, match="signature"):
        layout_from_msg(replace(msg, signature="0" * 16))


# ---------------------------------------------------------------------------------------
# What the decoder refuses, and how it says so


def _raw(msg: Message, **changes: object) -> bytes:
    obj = msgspec.msgpack.decode(encode_message(msg))
    obj.update(changes)
    return msgspec.msgpack.encode(obj)


@pytest.mark.parametrize(("buf", "match"), [
    (b"", "malformed"),
    (b"\xc1", "malformed"),
    (msgspec.msgpack.encode([1, 2, 3]), "malformed"),
    (msgspec.msgpack.encode({"type": "Nope", "seq": 1}), "Invalid value 'Nope'"),
    (msgspec.msgpack.encode({"seq": 1, "sender": "x"}), "missing required field `type`"),
    (_raw(Heartbeat(seq=1, sender="x"), seq=-1), r"Expected `int` >= 0"),
    (_raw(Heartbeat(seq=1, sender="x"), seq="1"), r"Expected `int`, got `str`"),
    (_raw(Heartbeat(seq=1, sender="x"), extra=1), "unknown field `extra`"),
    (_raw(AbortAck(request_id=1, rank=DECODE), rank={"instance": "d", "tp_rank": 2,
                                                     "tp_size": 2}), "rank outside its group"),
    (_raw(HelloReject(protocol_version=1, rank=DECODE, problems=("x",)), problems=[]),
     "at least one problem"),
    (_raw(TransferStatus(request_id=1, rank=DECODE, chunk=0, last=True,
                         outcome=Outcome.SUCCESS), outcome="failed"), "must say why"),
    (_raw(TransferStatus(request_id=1, rank=DECODE, chunk=0, last=True,
                         outcome=Outcome.SUCCESS), outcome="maybe"), "Invalid enum value"),
    (_raw(EXAMPLES[3], indices={"kv": {"items": b"\x00" * 7}}), "whole number of int64"),
    (_raw(EXAMPLES[3], request_id=1.5), r"Expected `int \| str`, got `float` - at `\$.request_id`"),
])
def test_bad_input_is_a_protocol_error_naming_the_cause(buf: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_message(buf)


@pytest.mark.parametrize("depth", [10, 1000, 100_000])
def test_deeply_nested_junk_is_a_protocol_error(depth: int) -> None:
    nest = b"\x91" * depth + b"\x00"
    hello = msgspec.msgpack.encode({"type": "Hello", "protocol_version": 1})
    for buf in (nest, b"\x83" + hello[1:] + b"\xa4junk" + nest):
        with pytest.raises(ProtocolError):
            decode_message(buf)


@pytest.mark.parametrize("value", [None, 42, "text", [b"x"], object()])
def test_input_that_is_not_bytes_is_a_protocol_error(value: object) -> None:
    with pytest.raises(ProtocolError, match="expected bytes"):
        decode_message(value)  # type: ignore[arg-type]


def test_non_contiguous_buffers_are_read_correctly() -> None:
    buf = np.frombuffer(ENCODED[-1], dtype=np.uint8).repeat(2)[::2]
    assert decode_message(buf.data) == EXAMPLES[-1]


def test_oversized_messages_are_refused_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MAX_MESSAGE_BYTES >= 16 << 20
    monkeypatch.setattr(protocol, "MAX_MESSAGE_BYTES", 1000)
    big = TransferInit(request_id=1, rank=DECODE, indices={"kv": IndexListMsg.of(range(200))})
    with pytest.raises(LocalProtocolError, match="over MAX_MESSAGE_BYTES"):
        encode_message(big)
    monkeypatch.setattr(protocol, "MAX_MESSAGE_BYTES", 10**6)
    buf = encode_message(big)
    monkeypatch.setattr(protocol, "MAX_MESSAGE_BYTES", 1000)
    with pytest.raises(ProtocolError, match="exceeds MAX_MESSAGE_BYTES"):
        decode_message(buf)


def test_a_transfer_inits_carries_one_to_max_batched_inits_both_ways() -> None:
    """An empty pack, or one past the bound, is refused when built here and when it
    arrives: a peer cannot make prefill's control thread take an unbounded message."""
    one = TransferInit(request_id=1, rank=DECODE, indices={"kv": None})
    cap = protocol.MAX_BATCHED_INITS
    assert decode_message(encode_message(TransferInits(inits=(one,) * cap))).inits[-1] == one
    for n in (0, cap + 1):
        with pytest.raises(ValueError, match=f"1 to {cap} TransferInit, got {n}"):
            TransferInits(inits=(one,) * n)
        raw = msgspec.msgpack.encode({"type": "TransferInits",
                                      "inits": [msgspec.to_builtins(one)] * n})
        with pytest.raises(ProtocolError, match=f"got {n}"):
            decode_message(raw)


def test_a_hello_from_another_protocol_version_says_so() -> None:
    future = {"type": "Hello", "protocol_version": PROTOCOL_VERSION + 1, "capabilities": [1]}
    with pytest.raises(ProtocolError, match=f"version {PROTOCOL_VERSION + 1}, this side "
                                            f"{PROTOCOL_VERSION}"):
        decode_message(msgspec.msgpack.encode(future))


def test_unencodable_messages_are_local_errors() -> None:
    with pytest.raises(LocalProtocolError, match="cannot encode Heartbeat"):
        encode_message(Heartbeat(seq=np.int64(3), sender="x"))  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError):
        encode_message(Heartbeat(seq=2**70, sender="x"))


def test_constructor_checks_run_locally_too() -> None:
    with pytest.raises(ValueError, match="rank outside its group"):
        RankId(instance="x", tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="whole number"):
        IndexListMsg(items=b"\x00" * 3)


def test_the_protocol_module_does_no_io() -> None:
    code = ("import sys, kvhandoff.protocol; "
            "bad = {'socket', 'zmq', 'threading', 'asyncio', 'aiohttp'} & set(sys.modules); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------
# Fuzz: whatever arrives, a Message or a ProtocolError


def _decode_or_protocol_error(buf: bytes) -> None:
    try:
        msg = decode_message(buf)
    except ProtocolError:
        return
    assert isinstance(msg, typing.get_args(Message))


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(buf: bytes) -> None:
    _decode_or_protocol_error(buf)


@FUZZ
@given(st.sampled_from(ENCODED), st.data())
def test_fuzz_truncated_and_mutated_messages(buf: bytes, data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(buf)))
    _decode_or_protocol_error(buf[:cut])
    pos = data.draw(st.integers(0, len(buf) - 1))
    byte = data.draw(st.integers(0, 255))
    _decode_or_protocol_error(buf[:pos] + bytes([byte]) + buf[pos + 1:])


_TAGS = [cls.__name__ for cls in typing.get_args(Message)]
_FIELDS = sorted({f for cls in typing.get_args(Message) for f in cls.__struct_fields__}
                 | {"instance", "tp_rank", "tp_size", "items", "positions", "type"})
_leaf = (st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats()
         | st.text(max_size=8) | st.binary(max_size=24) | st.sampled_from(_TAGS))
_value = st.recursive(
    _leaf,
    lambda kids: st.lists(kids, max_size=4)
    | st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=4), kids, max_size=6),
    max_leaves=20,
)


@FUZZ
@given(st.sampled_from(_TAGS), st.dictionaries(st.sampled_from(_FIELDS), _value, max_size=8))
def test_fuzz_valid_msgpack_of_wrong_shapes(tag: str, fields: dict[str, object]) -> None:
    try:
        buf = msgspec.msgpack.encode({**fields, "type": tag})
    except (OverflowError, msgspec.EncodeError):
        return  # integers beyond msgpack's range cannot be sent at all
    _decode_or_protocol_error(buf)


@FUZZ
@given(st.sampled_from(EXAMPLES), st.sampled_from(_FIELDS), _value)
def test_fuzz_one_field_replaced(msg: Message, field: str, value: object) -> None:
    obj = msgspec.msgpack.decode(encode_message(msg))
    obj[field] = value
    try:
        buf = msgspec.msgpack.encode(obj)
    except (OverflowError, msgspec.EncodeError):
        return
    _decode_or_protocol_error(buf)


_LAYOUT_MSG = layout_to_msg(_layouts()[-1])
_INTS = st.integers(-(2**63), 2**64 - 1)


@FUZZ
@given(st.data())
def test_fuzz_layout_fields_give_a_layout_or_a_protocol_error(data: st.DataObject) -> None:
    msg = _LAYOUT_MSG
    comps = list(msg.components)
    ci = data.draw(st.integers(0, len(comps) - 1))
    tensors = list(comps[ci].tensors)
    ti = data.draw(st.integers(0, len(tensors) - 1))
    t = tensors[ti]
    field = data.draw(st.sampled_from(["layer_id", "ptr", "nbytes", "item_bytes", "stride",
                                       "rows", "device", "shard"]))
    if field == "shard":
        value: object = data.draw(st.none() | st.builds(
            protocol.ShardMsg, outer=_INTS, groups=st.lists(_INTS, max_size=3).map(tuple),
            inner_bytes=_INTS))
    else:
        value = data.draw(_INTS)
    tensors[ti] = replace(t, **{field: value})
    comps[ci] = replace(comps[ci], tensors=tuple(tensors))
    top = data.draw(st.sampled_from(["page_size", "tp_rank", "tp_size", "pp_rank", "pp_size",
                                     "none"]))
    changes: dict[str, object] = {"components": tuple(comps)}
    if top != "none":
        changes[top] = data.draw(st.integers(-4, 2**40))
    hello = replace(EXAMPLES[0], layout=replace(msg, **changes))
    try:
        back = decode_message(encode_message(hello))
    except (ProtocolError, LocalProtocolError):
        return
    assert isinstance(back, Hello)
    with contextlib.suppress(ProtocolError):
        assert isinstance(layout_from_msg(back.layout), Layout)


# --- one error tree: the classes live in kvhandoff.errors; old paths re-export them -------


OLD_HOMES = [transport_errors, session_errors, protocol, transport, session, kvhandoff]


def _exceptions(module: object) -> dict[str, type]:
    return {n: v for n, v in vars(module).items()
            if inspect.isclass(v) and issubclass(v, BaseException)}


@pytest.mark.parametrize("module", OLD_HOMES, ids=lambda m: m.__name__)
def test_every_error_class_is_the_one_from_kvhandoff_errors(module: object) -> None:
    found = _exceptions(module)
    ours = {n: v for n, v in found.items() if v.__module__.startswith("kvhandoff")}
    assert ours
    for name, cls in ours.items():
        assert cls.__module__ == "kvhandoff.errors", f"{module}.{name} is defined elsewhere"
        assert getattr(errors, name) is cls


def test_the_shared_concepts_are_one_class_each() -> None:
    assert transport_errors.PeerLost is session_errors.PeerLost is errors.PeerLost
    assert transport_errors.TransferFailed is session_errors.TransferFailed
    assert transport_errors.ProtocolError is protocol.ProtocolError is errors.ProtocolError
    assert protocol.LocalProtocolError is errors.LocalProtocolError
    for cls in (errors.PeerLost, errors.TransferFailed, errors.ProtocolError):
        assert issubclass(cls, errors.TransportError) and issubclass(cls, errors.SessionError)
    assert issubclass(errors.ProtocolError, ValueError)
    assert issubclass(errors.ChecksumMismatch, errors.TransferFailed)
    assert issubclass(errors.RemoteOutOfBounds, errors.RemoteRefused)
    assert not issubclass(errors.TransportClosed, errors.SessionError)
    assert not issubclass(errors.RequestTimeout, errors.TransportError)


def test_an_except_on_either_path_catches_the_other_layers_error() -> None:
    with pytest.raises(session_errors.PeerLost):
        raise transport_errors.PeerLost("lost tcp://x")
    with pytest.raises(transport_errors.ProtocolError):
        raise protocol.ProtocolError("junk")
