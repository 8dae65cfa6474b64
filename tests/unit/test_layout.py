"""The layout model validates itself and names what is wrong."""

from __future__ import annotations

import pytest

import kvhandoff
from kvhandoff.errors import LayoutError
from kvhandoff.layout import (
    NO_LAYER,
    Component,
    GroupRange,
    Layout,
    Region,
    RowKind,
    ShardSpec,
    TensorSpec,
)
from kvhandoff.state_types import POLICIES, StateType

KV_SPEC = ShardSpec.axis(outer=16, axis=8, inner_bytes=256)  # 16 tokens x 8 heads x 128 bf16


def kv_tensor(
    name: str = "k", layer: int = 0, item: int = 16 * 4 * 256, **kw: object
) -> TensorSpec:
    args: dict[str, object] = dict(name=name, layer_id=layer, ptr=4096, nbytes=item * 10,
                                   item_bytes=item, rows=16, row_kind=RowKind.TOKEN, shard=KV_SPEC)
    args.update(kw)
    return TensorSpec(**args)  # type: ignore[arg-type]


def kv_layout(*tensors: TensorSpec, tp_rank: int = 0, tp_size: int = 2, **kw: object) -> Layout:
    comp = Component(type=StateType.KV, name="kv", tensors=tensors or (kv_tensor(),))
    return Layout(page_size=16, tp_rank=tp_rank, tp_size=tp_size, components=(comp,), **kw)  # type: ignore[arg-type]


def test_public_surface_is_pinned() -> None:
    assert set(kvhandoff.__all__) == {
        "NO_LAYER", "POLICIES", "Component", "HandoffError", "IndexKind", "IndexLengthMismatch",
        "Indices", "Layout", "LayoutError", "LayoutMismatch", "LengthPolicy", "MemoryKind",
        "OutOfBounds", "Plan", "PlanError", "Region", "RowKind", "Segments", "ShardSpec",
        "StateType", "TensorSpec", "TrimWarning", "__version__", "check_compatible", "plan",
    }
    for name in kvhandoff.__all__:
        assert hasattr(kvhandoff, name), name


def test_every_state_type_has_a_policy() -> None:
    assert set(POLICIES) == set(StateType)


def test_shard_ranges_plain_grouped_and_replicated() -> None:
    assert ShardSpec.axis(axis=8, inner_bytes=2).ranges(1, 4) == (GroupRange(2, 2, 1, 0),)
    gdn = ShardSpec.axis(axis=8192, inner_bytes=6, groups=(2048, 2048, 4096))
    assert [(r.start, r.length) for r in gdn.ranges(1, 2)] == [(1024, 1024), (1024, 1024),
                                                               (2048, 2048)]
    gqa = ShardSpec.axis(axis=4, inner_bytes=256)  # 4 KV heads over TP 8: pairs of ranks
    assert [gqa.ranges(r, 8)[0] for r in (0, 1, 2, 7)] == [
        GroupRange(0, 1, 2, 0), GroupRange(0, 1, 2, 1), GroupRange(1, 1, 2, 0),
        GroupRange(3, 1, 2, 1)]


def test_shard_that_does_not_tile_is_refused() -> None:
    with pytest.raises(LayoutError, match="length 6 cannot be split evenly over TP 4"):
        ShardSpec.axis(axis=6, inner_bytes=2).ranges(0, 4)
    with pytest.raises(LayoutError, match="TP must be a multiple of 4"):
        ShardSpec.axis(axis=4, inner_bytes=2).ranges(0, 6)
    with pytest.raises(LayoutError, match=r"groups \(1, 2\) sum to 3, not axis 4"):
        ShardSpec.axis(axis=4, inner_bytes=2, groups=(1, 2))


def test_item_bytes_must_equal_outer_axis_inner() -> None:
    with pytest.raises(LayoutError) as e:
        kv_layout(kv_tensor(item=16 * 8 * 256))  # full heads registered on a TP-2 rank
    msg = str(e.value)
    for part in ("component 'kv'", "tensor 'k'", "item_bytes 32768", "outer 16",
                 "local axis 4", "inner 256", "= 16384", "TP rank 0/2"):
        assert part in msg


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(item=100), "not a whole number of its 16 rows"),
        (dict(nbytes=10), "smaller than one item"),
        (dict(ptr=-1), "must be >= 0"),
        (dict(rows=2, row_kind=RowKind.ITEM), "opaque"),
        (dict(layer=-2), "layer_id"),
    ],
)
def test_tensor_records_reject_inconsistent_numbers(kw: dict[str, object], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        kv_tensor(**kw)  # type: ignore[arg-type]


def test_duplicate_tensors_and_components_are_named() -> None:
    with pytest.raises(LayoutError, match="duplicate tensor 'k' for layer 0"):
        Component(type=StateType.KV, name="kv", tensors=(kv_tensor(), kv_tensor()))
    comp = Component(type=StateType.KV, name="kv", tensors=(kv_tensor(),))
    with pytest.raises(LayoutError, match=r"duplicate component names: \['kv'\]"):
        Layout(page_size=16, tp_size=2, components=(comp, comp))


def test_unknown_state_type_is_refused() -> None:
    with pytest.raises(LayoutError, match="unknown state type 'paged_magic'"):
        Component(type="paged_magic", name="x", tensors=())  # type: ignore[arg-type]


def test_tensor_outside_its_region_is_refused() -> None:
    with pytest.raises(LayoutError, match="lie outside every registered host region"):
        kv_layout(regions=(Region(ptr=4096, nbytes=100),))


def test_tensor_outside_its_pp_stage_is_refused() -> None:
    with pytest.raises(LayoutError, match=r"layer 5 is outside this rank's layers 0\.\.4"):
        kv_layout(kv_tensor(layer=5), layers=(0, 4))


def test_rank_outside_tp_is_refused() -> None:
    with pytest.raises(LayoutError, match="tp_rank 2 is outside TP size 2"):
        kv_layout(tp_rank=2)


def test_signature_ignores_what_may_differ_and_sees_what_may_not() -> None:
    a = kv_layout(tp_rank=0)
    b = kv_layout(tp_rank=1)
    assert a.signature == b.signature  # TP rank, addresses: may differ
    one = Layout(page_size=16, components=(Component(type=StateType.KV, name="kv", tensors=(
        kv_tensor(item=16 * 8 * 256, nbytes=16 * 8 * 256 * 4),)),))
    assert one.signature == a.signature  # TP size may differ
    other_dtype = kv_layout(kv_tensor(dtype="fp8"))
    assert other_dtype.signature != a.signature
    assert hash(a) != hash(b) and a != b


def _stages(model: str, page: int) -> list[Layout]:
    from kvhandoff.lab import shapes
    m = shapes.tiny(shapes.get(model))
    return [shapes.layout_for(m, tp_rank=0, tp_size=1, page_size=page, num_pages=4,
                              num_slots=2, pp_rank=s, pp_size=2) for s in range(2)]


@pytest.mark.parametrize(("model", "page"), [("qwen3_next", 16), ("deepseek_v4", 128)])
def test_model_signature_is_shared_by_pp_stages_that_hold_different_tensors(
        model: str, page: int) -> None:
    a, b = _stages(model, page)
    assert a.signature != b.signature  # the stages hold different tensor kinds
    assert a.model_signature == b.model_signature


def test_model_signature_tells_models_apart() -> None:
    qwen, = {lay.model_signature for lay in _stages("qwen3_next", 16)}
    v4, = {lay.model_signature for lay in _stages("deepseek_v4", 128)}
    assert qwen != v4
    assert kv_layout().model_signature != qwen
    renamed = Layout(page_size=16, tp_size=2, components=(
        Component(type=StateType.KV, name="kv2", tensors=(kv_tensor(),)),))
    assert renamed.model_signature != kv_layout().model_signature
    assert kv_layout(tp_rank=1).model_signature == kv_layout().model_signature


def test_no_layer_tensors_and_elided_tensors_are_valid() -> None:
    aux = TensorSpec(name="aux", layer_id=NO_LAYER, ptr=0x1000, nbytes=256 * 4, item_bytes=256)
    elided = TensorSpec(name="index_k", layer_id=3, ptr=0, nbytes=0, item_bytes=0)
    lay = Layout(page_size=1, layers=(0, 4), components=(
        Component(type=StateType.AUX, name="aux", tensors=(aux,)),
        Component(type=StateType.NSA, name="nsa", tensors=(elided,)),
    ))
    assert lay.component("nsa").tensors[0].elided
    with pytest.raises(KeyError, match="no component 'kv'"):
        lay.component("kv")


# --- padded items: `stride` ------------------------------------------------------------

CONV = ShardSpec.axis(axis=256, inner_bytes=6, groups=(64, 64, 128))  # 1536 B at TP 1


def conv_tensor(**kw: object) -> TensorSpec:
    """A Mamba conv state at the start of 64 KiB pages: 768 B at TP rank 0/2."""
    args: dict[str, object] = dict(name="conv", layer_id=0, ptr=1 << 20, nbytes=4 * 65536,
                                   item_bytes=768, stride=65536, shard=CONV)
    args.update(kw)
    return TensorSpec(**args)  # type: ignore[arg-type]


def test_padded_items_are_addressed_by_the_stride() -> None:
    t = conv_tensor()
    assert (t.stride, t.item_stride, t.item_bytes) == (65536, 65536, 768)
    assert t.capacity == 4
    # the last item needs only its own bytes, not the padding after it
    assert conv_tensor(nbytes=3 * 65536 + 768).capacity == 4
    assert conv_tensor(nbytes=3 * 65536 + 767).capacity == 3
    packed = conv_tensor(stride=0)
    assert (packed.item_stride, packed.capacity) == (768, 4 * 65536 // 768)


def test_a_stride_equal_to_the_item_is_stored_as_zero() -> None:
    assert conv_tensor(stride=768) == conv_tensor(stride=0)
    assert conv_tensor(stride=768).stride == 0
    assert kv_tensor(stride=16 * 4 * 256).stride == 0  # also for token rows: no padding


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(stride=512), r"tensor 'conv' \(layer 0\): stride 512 is smaller than one item "
                           r"\(768 B\)"),
        (dict(stride=-1), r"tensor 'conv' \(layer 0\): .*stride=-1"),
        (dict(nbytes=767), "smaller than one item"),
    ],
)
def test_bad_strides_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        conv_tensor(**kw)


@pytest.mark.parametrize("kind", [RowKind.TOKEN, RowKind.RING])
def test_only_opaque_items_may_be_padded(kind: RowKind) -> None:
    with pytest.raises(LayoutError, match=rf"tensor 'k' \(layer 0\): stride 32768 != item_bytes "
                                          rf"16384, .*only opaque \(ITEM\).*{kind.value} rows"):
        kv_tensor(stride=32768, row_kind=kind)


def test_the_stride_is_no_part_of_the_signature() -> None:
    """Padding differs by TP size (and engine); both sides agree on the items only."""
    def lay(t: TensorSpec) -> Layout:
        comp = Component(type=StateType.MAMBA, name="mamba", tensors=(t,))
        return Layout(page_size=16, tp_size=2, components=(comp,))

    padded, other, packed = (lay(conv_tensor()), lay(conv_tensor(stride=4096)),
                             lay(conv_tensor(stride=0)))
    assert conv_tensor().geometry() == conv_tensor(stride=0).geometry()
    assert padded.signature == other.signature == packed.signature
    assert padded != packed
