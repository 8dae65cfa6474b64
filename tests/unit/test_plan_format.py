"""``format_plan``: what a plan looks like in a log; and the unit kinds behind it."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvhandoff.layout import NO_LAYER, Component, Layout, RowKind, TensorSpec
from kvhandoff.plan import Indices, Plan, format_plan, pair_layouts, plan
from kvhandoff.plan.compat import UnitKind, unit_kind
from kvhandoff.plan.format import human_size
from kvhandoff.plan.model import TensorPlan
from kvhandoff.state_types import StateType

PAGE, ROW = 4, 32


def layout(tp_rank: int = 0, *, rows: int = PAGE, ring: int = 8) -> Layout:
    """Two KV layers (token rows), one ring tensor and an aux row."""
    kv = Component(type=StateType.KV, name="kv", tensors=tuple(
        TensorSpec(name=f"kv{i}", layer_id=i, ptr=(1 << 20) * (i + 1), nbytes=rows * ROW * 16,
                   item_bytes=rows * ROW, rows=rows, row_kind=RowKind.TOKEN)
        for i in range(2)))
    swa = Component(type=StateType.SWA, name="swa", tensors=(
        TensorSpec(name="swa", layer_id=3, ptr=1 << 24, nbytes=ring * ROW * 4,
                   item_bytes=ring * ROW, rows=ring, row_kind=RowKind.RING),))
    aux = Component(type=StateType.AUX, name="aux", tensors=(
        TensorSpec(name="aux", layer_id=NO_LAYER, ptr=1 << 25, nbytes=64 * 8, item_bytes=64),))
    return Layout(page_size=rows, tp_rank=tp_rank, tp_size=1, components=(kv, swa, aux))


def test_a_plan_reads_as_ranks_totals_and_one_line_per_component() -> None:
    p = plan(layout(), layout(), {"kv": Indices([0, 1, 2], [5, 6, 7]), "swa": None,
                                  "aux": Indices([0], [3])})
    text = format_plan(p)
    head, kv, aux = text.splitlines()
    assert head == ("plan P0→D0: 3 entries, 7 units, 832 B, 3 pieces, 7 segments")
    assert kv.split() == ["kv", "2", "entries", "6", "units", "768", "B", "2", "pieces",
                          "layers", "0..1"]
    assert aux.split() == ["aux", "1", "entry", "1", "unit", "64", "B", "1", "piece"]
    assert str(p) == text


def test_the_ranks_a_single_layer_and_the_notes_are_shown() -> None:
    e = TensorPlan(component="swa", tensor="swa", layer_id=3, src_ptr=0, dst_ptr=0,
                   src_unit=ROW, dst_unit=ROW, src_idx=np.arange(2), dst_idx=np.arange(2),
                   pieces=np.array([[0, 0, ROW, 1, 0, 0]], dtype=np.int64))
    p = Plan(entries=(e,), src_tp_rank=1, dst_tp_rank=3, notes=("trimmed 2 rows",))
    lines = format_plan(p).splitlines()
    assert lines[0].startswith("plan P1→D3: 1 entry, 2 units, 64 B, 1 piece, 2 segments")
    assert lines[1].split()[-2:] == ["layer", "3"]
    assert lines[2] == "  note: trimmed 2 rows"


def test_an_empty_plan_says_nothing_moves() -> None:
    p = plan(layout(), layout(), {"kv": None, "swa": None, "aux": None})
    assert format_plan(p) == ("plan P0→D0: 0 entries, 0 units, 0 B, 0 pieces, 0 segments "
                              "(nothing moves)")


def test_a_plan_logs_readably_and_lazily(caplog: pytest.LogCaptureFixture) -> None:
    p = plan(layout(), layout(), {"kv": Indices([0], [1]), "swa": None, "aux": None})
    log = logging.getLogger("test_plan_format")
    with caplog.at_level(logging.DEBUG, logger="test_plan_format"):
        log.debug("%s", p)
    assert caplog.messages == [format_plan(p)]


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
                                         (3 << 20, "3.0 MiB"), (5 << 30, "5.0 GiB")])
def test_human_size(n: int, text: str) -> None:
    assert human_size(n) == text


def test_unit_kinds_are_an_enum_chosen_per_tensor_pair() -> None:
    same = pair_layouts(layout(), layout())
    repaged = pair_layouts(layout(), layout(rows=2 * PAGE, ring=16))
    kinds = {c.name: [unit_kind(tp, False)[0][0] for tp in c.tensors] for c in same.components}
    assert kinds == {"kv": [UnitKind.ITEM] * 2, "swa": [UnitKind.ITEM], "aux": [UnitKind.ITEM]}
    kv_rows = [unit_kind(tp, True)[0] for tp in same.components[0].tensors]
    assert kv_rows == [(UnitKind.TOKEN, PAGE, PAGE)] * 2
    by = {c.name: c for c in repaged.components}
    assert unit_kind(by["kv"].tensors[0], False) == ((UnitKind.TOKEN, PAGE, 2 * PAGE), True)
    assert unit_kind(by["swa"].tensors[0], False) == ((UnitKind.RING, 8, 16), True)
    # a units key is shared by every tensor with the same kind and row counts
    assert [g.key for g in by["kv"].tables[False].groups] == [(UnitKind.TOKEN, PAGE, 2 * PAGE)]
