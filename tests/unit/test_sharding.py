"""The one home of recurrent-state sharding rules (:mod:`kvhandoff.sharding`): config
spellings, conv sub-blocks and the ShardSpecs built from them, checked against each
engine's own per-rank sharding written out by hand."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvhandoff.errors import LayoutError
from kvhandoff.layout import ShardSpec
from kvhandoff.sharding import (
    ConvKind,
    config_ints,
    conv_shard,
    delta_net_dims,
    extended_groups,
    gdn_conv,
    kda_conv,
    mamba1_conv,
    mamba2_conv,
    mamba2_groups,
    mamba2_state,
    ssm_shard,
)


def _positions(spec: ShardSpec, unit: int, r: int, tp: int) -> list[int]:
    """Global channels rank ``r`` holds, in its local order, from the ShardSpec."""
    out: list[int] = []
    base = 0
    for g, rng in zip(spec.groups, spec.ranges(r, tp), strict=True):
        for u in range(rng.start, rng.start + rng.length):
            out += range((base + u) * unit, (base + u + 1) * unit)
        base += g
    return out


def _engine_channels(blocks: tuple[int, ...], r: int, tp: int, *, group: int = 0,
                     n_groups: int = 0) -> list[int]:
    """What vLLM and SGLang give rank ``r``: each block cut in ``tp`` contiguous slices;
    Mamba2's B and C (blocks 1, 2) in whole groups, the rank's group replicated when TP
    exceeds the groups."""
    out: list[int] = []
    base = 0
    for i, size in enumerate(blocks):
        if group and i and tp > n_groups:
            g = r // (tp // n_groups)
            out += range(base + g * group, base + (g + 1) * group)
        else:
            n = size // tp
            out += range(base + r * n, base + (r + 1) * n)
        base += size
    return out


@pytest.mark.parametrize("cfg", [
    {"linear_num_key_heads": 4, "linear_key_head_dim": 16, "linear_num_value_heads": 8,
     "linear_value_head_dim": 32},
    SimpleNamespace(linear_num_key_heads=4, linear_key_head_dim=16,
                    linear_num_value_heads=8, linear_value_head_dim=32),
])
def test_delta_net_spellings_read_configs_and_config_json(cfg: object) -> None:
    assert delta_net_dims(cfg) == (4, 16, 8, 32)


def test_kimi_spelling_uses_one_head_count_for_keys_and_values() -> None:
    assert delta_net_dims({"linear_num_heads": 3, "linear_head_dim": 8}) == (3, 8, 3, 8)


def test_an_incomplete_or_non_integer_spelling_is_no_spelling() -> None:
    assert delta_net_dims({"linear_num_key_heads": 4, "linear_key_head_dim": 16}) is None
    assert config_ints({"a": True, "b": 2}, ("a", "b")) is None
    assert config_ints({"a": 1.0, "b": 2}, ("a", "b")) is None
    assert config_ints({"a": 1, "b": 2}, ("a", "b")) == (1, 2)


@pytest.mark.parametrize("name", ["n_groups", "mamba_n_groups", "ssm_n_groups", "mamba_ngroups"])
def test_every_engine_reads_every_group_spelling(name: str) -> None:
    """The spellings were three drifting tables; ``ssm_n_groups`` was known to the vLLM
    connector only."""
    assert mamba2_groups({name: 8}) == 8
    assert mamba2_groups(SimpleNamespace(**{name: 8})) == 8
    assert mamba2_groups({name: 0}) is None
    assert mamba2_state({"mamba_d_state": 64}) == 64 == mamba2_state({"ssm_state_size": 64})


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gdn_conv_cuts_q_k_and_v_each_on_its_own(tp: int) -> None:
    split = gdn_conv(64, 256)
    assert split.kind is ConvKind.GDN and split.blocks == (64, 64, 256)
    spec = conv_shard(split, channel_bytes=3 * 2)
    assert (spec.outer, spec.inner_bytes) == (1, 3 * 2)
    for r in range(tp):
        assert _positions(spec, 1, r, tp) == _engine_channels((64, 64, 256), r, tp)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_mamba2_whole_groups_replicate_when_tp_exceeds_them(tp: int) -> None:
    split = mamba2_conv(256, 2, 32)
    assert split.blocks == (8, 2, 2) and split.unit == 32 and split.channels == 384
    spec = conv_shard(split, channel_bytes=3 * 4)
    assert spec.inner_bytes == 32 * 3 * 4
    for r in range(tp):
        assert _positions(spec, 32, r, tp) == _engine_channels(
            (256, 64, 64), r, tp, group=32, n_groups=2)


def test_mamba2_in_channels_is_the_catalogues_form() -> None:
    assert mamba2_conv(256, 2, 32, whole_groups=False).blocks == (256, 64, 64)
    with pytest.raises(LayoutError, match=r"x of 100 channels .* 32-channel groups"):
        mamba2_conv(100, 2, 32)


def test_kda_is_stored_transposed() -> None:
    split = kda_conv(128, 64)
    assert split.blocks == (128, 64, 64)
    spec = conv_shard(split, channel_bytes=2, outer_rows=3)
    assert (spec.outer, spec.inner_bytes) == (3, 2)


def test_mamba1_and_ssm_shard_one_axis() -> None:
    assert mamba1_conv(96).blocks == (96,)
    spec = ssm_shard(8, 4096)
    assert spec == ShardSpec(outer=1, groups=(8,), inner_bytes=4096)
    assert spec.local_item_bytes(1, 4) == 2 * 4096


def test_bad_numbers_are_named() -> None:
    with pytest.raises(LayoutError, match=r"key 60 and value 256 .* 16-channel"):
        gdn_conv(60, 256, unit=16)
    with pytest.raises(LayoutError, match=r"sub-blocks \(0,\)"):
        mamba1_conv(0)
    with pytest.raises(LayoutError, match="TP 3 is neither"):
        extended_groups(2, 3)
    assert extended_groups(8, 2) == 8 and extended_groups(1, 4) == 4


def test_the_engines_read_the_one_table() -> None:
    """The reference engine, the catalogue and the vLLM adapter hold no spelling table of
    their own any more: the spellings are only here."""
    import kvhandoff

    root = Path(kvhandoff.__file__).parent
    for rel in ("lab/engine/arch.py", "lab/shapes.py", "integrations/vllm/connector.py",
                "integrations/vllm/layout.py"):
        src = (root / rel).read_text()
        assert "mamba_ngroups" not in src and "linear_num_key_heads" not in src, rel
