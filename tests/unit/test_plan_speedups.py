"""The planner's fast paths against its general path.

``plan`` builds entries from per-layout-pair templates, checks bounds once per units key
against the tightest tensor, and uses Python ints for small index arrays; the general
path (``_plan_general``) walks tensor by tensor as specified. They must agree on every
input: the same entries, notes and warnings, or the same error type and message (naming
the same component and tensor). Random cases come from the oracle tests' strategies,
then get mutated towards the edges: empty lists, one element, repeats, indices past the
end of a tensor or negative.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_plan_oracle import Case, build_all, cases  # type: ignore[import-not-found]

from kvhandoff.errors import OutOfBounds, PlanError
from kvhandoff.layout import Component, Layout, RowKind, ShardSpec, TensorSpec
from kvhandoff.plan import Indices, Plan, TensorPlan, plan
from kvhandoff.plan.build import _plan_general
from kvhandoff.plan.model import _entry
from kvhandoff.plan.pairing import check_unique
from kvhandoff.plan.request import as_indices, index_range
from kvhandoff.protocol import layout_from_msg, layout_to_msg
from kvhandoff.state_types import StateType

Outcome = tuple[str, Any, list[tuple[type, str]]]


def _run(fn: Any, src: Layout, dst: Layout, request: dict[str, Indices | None]) -> Outcome:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result: Any = fn(src, dst, request)
            kind = "plan"
        except Exception as e:  # compared below: type and message
            result, kind = (type(e), str(e)), "error"
    return kind, result, [(w.category, str(w.message)) for w in caught]


def _entry_fields(e: TensorPlan) -> tuple[Any, ...]:
    return (e.component, e.tensor, e.layer_id, e.src_ptr, e.dst_ptr, e.src_unit, e.dst_unit,
            e.src_idx.tolist(), e.dst_idx.tolist(), e.pieces.tolist(), e.bytes_per_unit,
            e.nbytes, e.num_segments, e.whole_units)


def assert_same(src: Layout, dst: Layout, request: dict[str, Indices | None]) -> str:
    fast = _run(plan, src, dst, request)
    general = _run(_plan_general, src, dst, request)
    assert fast[0] == general[0], (fast, general)
    assert fast[2] == general[2]  # warnings: same categories and messages, same order
    if fast[0] == "error":
        assert fast[1] == general[1]
        return f"error {fast[1][0].__name__}"
    p: Plan = fast[1]
    q: Plan = general[1]
    assert (p.src_tp_rank, p.dst_tp_rank, p.notes) == (q.src_tp_rank, q.dst_tp_rank, q.notes)
    assert [_entry_fields(e) for e in p.entries] == [_entry_fields(e) for e in q.entries]
    for e in p.entries:  # what the general constructor would have built
        assert e == TensorPlan(
            component=e.component, tensor=e.tensor, layer_id=e.layer_id, src_ptr=e.src_ptr,
            dst_ptr=e.dst_ptr, src_unit=e.src_unit, dst_unit=e.dst_unit, src_idx=e.src_idx,
            dst_idx=e.dst_idx, pieces=e.pieces) or _entry_fields(e)
    assert p.nbytes == q.nbytes and p.flatten().nbytes == q.flatten().nbytes
    return "plan"


@st.composite
def _mutated(draw: st.DrawFn, arr: np.ndarray) -> np.ndarray:
    vals = arr.tolist()
    how = draw(st.sampled_from(["keep", "keep", "empty", "one", "repeat", "past", "negative",
                                "far"]))
    if how == "empty":
        vals = []
    elif how == "one":
        vals = vals[:1] or [0]
    elif how == "repeat" and vals:
        vals = [*vals, vals[draw(st.integers(0, len(vals) - 1))]]
    elif how in ("past", "negative", "far"):
        bad = {"past": max(vals, default=0) + draw(st.integers(1, 8)), "negative": -1,
               "far": 2**40}[how]
        at = draw(st.integers(0, len(vals)))
        vals = [*vals[:at], bad, *vals[at + 1:]]
    return np.array(vals, dtype=np.int64)


@st.composite
def _edge_cases(draw: st.DrawFn) -> Case:
    case: Case = draw(cases())
    request: dict[str, Indices | None] = {}
    for name, idx in case.request.items():
        if idx is None or draw(st.booleans()):
            request[name] = idx
            continue
        request[name] = Indices(
            draw(_mutated(idx.src)), draw(_mutated(idx.dst)), src_first_row=idx.src_first_row,
            dst_first_row=idx.dst_first_row, num_rows=idx.num_rows, positions=idx.positions)
    return Case(case.comps, case.layers, case.tp, case.src_pp, case.dst_rank, request,
                case.seed)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_fast_path_matches_general_path(case: Case) -> None:
    srcs, dst = build_all(case)
    for r in srcs:
        event(assert_same(r.layout, dst.layout, case.request))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_edge_cases())
def test_fast_path_matches_general_path_at_the_edges(case: Case) -> None:
    srcs, dst = build_all(case)
    for r in srcs:
        event(assert_same(r.layout, dst.layout, case.request))


# ------------------------------------------------------------------ a hand-made pair


def _layout(nbytes: tuple[int, ...], base: int) -> Layout:
    """KV of three layers whose tensors hold different numbers of 64 B pages, so the
    second (smallest) tensor bounds the component; plus a mamba slot and an aux row."""
    kv = tuple(TensorSpec(name="k", layer_id=i, ptr=base + i * 4096, nbytes=n, item_bytes=64,
                          dtype="bf16", rows=4, row_kind=RowKind.TOKEN,
                          shard=ShardSpec(outer=4, groups=(2,), inner_bytes=8))
               for i, n in enumerate(nbytes))
    mamba = (TensorSpec(name="conv", layer_id=0, ptr=base + 20000, nbytes=96, item_bytes=32,
                        dtype="bf16"),)
    aux = (TensorSpec(name="aux", layer_id=-1, ptr=base + 30000, nbytes=64, item_bytes=16,
                      dtype="uint8"),)
    return Layout(components=(Component(type=StateType.KV, name="kv", tensors=kv),
                              Component(type=StateType.MAMBA, name="mamba", tensors=mamba),
                              Component(type=StateType.AUX, name="aux", tensors=aux)),
                  tp_rank=0, tp_size=1, page_size=4, layers=(0, 3))


SRC = _layout((640, 320, 640), 1 << 20)  # 10, 5, 10 pages
DST = _layout((640, 640, 256), 2 << 20)  # 10, 10, 4 pages


def _req(kv: tuple[list[int], list[int]], **kw: Any) -> dict[str, Indices | None]:
    return {"kv": Indices(*kv, **kw), "mamba": Indices([1], [2]), "aux": Indices([0], [3])}


@pytest.mark.parametrize(("kv", "kw", "err", "text"), [
    (([0, 1, 2], [0, 1, 2]), {}, None, ""),
    (([], []), {}, None, ""),
    (([4], [3]), {}, None, ""),
    (([5], [0]), {}, OutOfBounds, " tensor 'k' layer 1: prefill index 5"),
    (([0, 9], [0, 1]), {}, OutOfBounds, " tensor 'k' layer 1: prefill index 9"),
    (([-1], [0]), {}, OutOfBounds, " tensor 'k' layer 0: prefill index -1"),
    (([0], [4]), {}, OutOfBounds, " tensor 'k' layer 2: decode index 4"),
    (([0], [-3]), {}, OutOfBounds, " tensor 'k' layer 0: decode index -3"),
    (([0, 1], [2, 2]), {}, PlanError, ": decode index list repeats [2]"),
    (([1, 2], [0, 1]), {"src_first_row": 2, "num_rows": 5}, None, ""),
    (([1, 5], [0, 1]), {"src_first_row": 1, "num_rows": 7}, OutOfBounds,
         " tensor 'k' layer 1: prefill index 23"),
    (([0], [4]), {"dst_first_row": 3, "num_rows": 1}, OutOfBounds,
         " tensor 'k' layer 2: decode index 19"),
])
def test_hand_made_requests(kv: tuple[list[int], list[int]], kw: dict[str, int],
                            err: type[Exception] | None, text: str) -> None:
    request = _req(kv, **kw)
    assert assert_same(SRC, DST, request) == ("plan" if err is None else f"error {err.__name__}")
    if err is not None:
        with pytest.raises(err, match="component 'kv'" + text.replace("[", r"\[")):
            plan(SRC, DST, request)


def test_out_of_bounds_in_a_later_component_names_it() -> None:
    request = _req(([0], [0]))
    request["mamba"] = Indices([3], [0])
    with pytest.raises(OutOfBounds, match=re.escape(
            "component 'mamba' tensor 'conv' layer 0: prefill index 3 (unit 32 B) reaches "
            "byte 128 of a 96 B tensor")):
        plan(SRC, DST, request)
    assert assert_same(SRC, DST, request) == "error OutOfBounds"


def test_layouts_equal_to_the_cached_pair_are_compared_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent built again at the same addresses plans with layouts equal to, but not
    the objects of, the pair the planner's cache holds: the first plan may compare them,
    the next ones find the pair by identity (no field-by-field comparison per plan)."""
    src, dst = (layout_from_msg(layout_to_msg(x)) for x in (SRC, DST))
    assert (src, dst) == (SRC, DST) and src is not SRC and dst is not DST
    request = _req(([0, 1], [2, 3]))
    want = plan(SRC, DST, request)  # the cache now holds the first objects' pair
    compared = []
    eq = Layout.__eq__

    def counting(a: Layout, b: object) -> bool:
        compared.append(1)
        return eq(a, b)

    monkeypatch.setattr(Layout, "__eq__", counting)
    plan(src, dst, request)
    first = len(compared)
    for _ in range(5):
        got = plan(src, dst, request)
    assert len(compared) == first
    assert [_entry_fields(e) for e in got.entries] == [_entry_fields(e) for e in want.entries]


# ------------------------------------------------------------------ the small helpers


@settings(max_examples=300, deadline=None)
@given(vals=st.lists(st.integers(-(2**62), 2**62), max_size=80))
def test_small_range_matches_numpy(vals: list[int]) -> None:
    a = np.array(vals, dtype=np.int64)
    want = (int(a.min()), int(a.max())) if len(a) else (0, 0)
    assert index_range(a) == want
    assert all(type(v) is int for v in index_range(a))


@settings(max_examples=300, deadline=None)
@given(vals=st.lists(st.one_of(st.integers(0, 40), st.integers(-5, 2**40)), max_size=80))
def test_check_unique_small_and_large_agree(vals: list[int]) -> None:
    a = np.array(vals, dtype=np.int64)
    dups = sorted({v for v in vals if vals.count(v) > 1})
    if not dups:
        check_unique("c", "decode", a)
        return
    with pytest.raises(PlanError, match=r"component 'c': decode index list repeats "
                                        + r"\[" + ", ".join(map(str, dups[:5])) + r"\]"):
        check_unique("c", "decode", a)


def test_entry_equals_the_constructor() -> None:
    pcs = np.array([[0, 0, 8, 4, 16, 16], [8, 0, 4, 1, 0, 0]], dtype=np.int64)
    s, d = np.array([1, 2]), np.array([3, 4])
    fixed: dict[str, object] = dict(component="c", tensor="t", layer_id=2, src_ptr=100,
                                    dst_ptr=200, src_unit=64, dst_unit=32, pieces=pcs)
    slow = TensorPlan(src_idx=s, dst_idx=d, **fixed)  # type: ignore[arg-type]
    fast = _entry({**fixed, "_per_unit": 36}, s, d)
    assert fast == slow and repr(fast) == repr(slow)
    assert fast.bytes_per_unit == slow.bytes_per_unit == 36
    assert fast.nbytes == slow.nbytes == 72
    with pytest.raises(AttributeError):
        fast.src_ptr = 5  # type: ignore[misc]


@pytest.mark.parametrize("values", [
    np.array([3, 1, 2], dtype=np.int64), np.array([], dtype=np.int64),
    np.array([7], dtype=np.int64), np.arange(10, dtype=np.int64)[::2],
    np.array([1, 2], dtype=">i8"), np.array([1, 2], dtype=np.int32), [4, 5], (),
])
def test_as_indices_copies_read_only_int64(values: Any) -> None:
    out = as_indices(values, "x")
    assert out.dtype == np.int64 and out.ndim == 1 and not out.flags.writeable
    assert out.tolist() == list(np.asarray(values).tolist())
    if isinstance(values, np.ndarray):
        assert not np.shares_memory(out, values)


@pytest.mark.parametrize(("values", "msg"), [
    (np.zeros((2, 2), dtype=np.int64), "must be 1-D"),
    (np.array([1.5]), "must hold integers"),
])
def test_as_indices_still_refuses(values: Any, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        as_indices(values, "x")
