"""The planner against the naive oracle (``kvhandoff.lab.testing.oracle``), byte for byte.

Random models (components of every row kind, sharded/replicated/elided tensors,
GQA replication, grouped axes, outer rows, re-paging, ring resizing, PP splits,
padded items)
are laid out in real numpy buffers; every prefill rank is planned against one
decode rank and the union of the plans must move exactly the oracle's bytes.
A few hand-written cases pin the oracle itself to whole-array numpy reasoning.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvhandoff.errors import IndexLengthMismatch, OutOfBounds, PlanError, TrimWarning
from kvhandoff.lab.testing.oracle import ByteMap, expected_writes
from kvhandoff.layout import (
    NO_LAYER,
    Component,
    Layout,
    Region,
    RowKind,
    ShardSpec,
    TensorSpec,
)
from kvhandoff.plan import Indices, Plan, Segments, execute, plan
from kvhandoff.plan.execute import HostMemory
from kvhandoff.state_types import LengthPolicy, StateType, policy

I64 = npt.NDArray[np.int64]
SRC, DST = 0, 1  # which side of a CompDef's (prefill, decode) pairs
GAP = 5  # bytes left between tensors so an overrun lands on sentinel bytes

KIND_OF = {
    StateType.KV: RowKind.TOKEN,
    StateType.MLA: RowKind.TOKEN,
    StateType.SWA: RowKind.TOKEN,
    StateType.NSA: RowKind.TOKEN,
    StateType.MAMBA: RowKind.ITEM,
    StateType.AUX: RowKind.ITEM,
    StateType.REQUEST_ROW: RowKind.ITEM,
    StateType.DSV4_REQUEST: RowKind.ITEM,
    StateType.DSV4_SWA: RowKind.RING,
    StateType.DSV4_RING: RowKind.RING,
}
NO_LAYER_TYPES = {StateType.AUX, StateType.REQUEST_ROW}


# ------------------------------------------------------------------ model


@dataclass(frozen=True)
class TensorDef:
    """One tensor family: per layer, or a single NO_LAYER tensor."""

    name: str
    layered: bool
    shard: tuple[int, tuple[int, ...], int] | None  # (outer rows per row, groups, inner bytes)
    row_bytes: int  # bytes of one row when replicated
    elided: frozenset[int]  # layer ids (or NO_LAYER) where the tensor holds nothing
    pad: tuple[int, int] = (0, 0)  # (prefill, decode) padding after each ITEM item


@dataclass(frozen=True)
class CompDef:
    type: StateType
    name: str
    rows: tuple[int, int]  # (prefill, decode) rows per item
    caps: tuple[int, int]  # (prefill, decode) items per tensor
    tensors: tuple[TensorDef, ...]

    @property
    def kind(self) -> RowKind:
        return KIND_OF[self.type]


@dataclass(frozen=True)
class Case:
    comps: tuple[CompDef, ...]
    layers: int
    tp: tuple[int, int]
    src_pp: int
    dst_rank: int
    request: dict[str, Indices | None]
    seed: int


@dataclass
class Rank:
    """One rank's layout and the real memory behind it."""

    layout: Layout
    mem: HostMemory
    buf: np.ndarray


def stage_layers(layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Stage ``pp_rank`` owns an even, contiguous share of the layers."""
    per = layers // pp_size
    lo = pp_rank * per
    return lo, layers if pp_rank == pp_size - 1 else lo + per


def tensor_spec(td: TensorDef, c: CompDef, side: int, layer: int, tp_rank: int, tp_size: int,
                ptr: int) -> TensorSpec:
    rows = c.rows[side]
    if layer in td.elided:
        return TensorSpec(name=td.name, layer_id=layer, ptr=0, nbytes=0, item_bytes=0,
                          rows=rows, row_kind=c.kind)
    shard = None
    if td.shard is None:
        item = rows * td.row_bytes
    else:
        per_row, groups, inner = td.shard
        shard = ShardSpec(outer=per_row * rows, groups=groups, inner_bytes=inner)
        item = shard.local_item_bytes(tp_rank, tp_size)
    # padded items: the last one ends the tensor (no padding after it)
    stride = item + td.pad[side] if c.kind is RowKind.ITEM else item
    return TensorSpec(name=td.name, layer_id=layer, ptr=ptr,
                      nbytes=stride * (c.caps[side] - 1) + item, item_bytes=item,
                      stride=stride, rows=rows, row_kind=c.kind, shard=shard)


def build_rank(case: Case, side: int, tp_rank: int, pp_rank: int, rng: np.random.Generator
               ) -> Rank:
    """All tensors of one rank carved out of one buffer, with gaps between them.

    Prefill buffers hold random bytes, decode buffers a sentinel pattern.
    """
    tp_size = case.tp[side]
    pp_size = case.src_pp if side == SRC else 1
    lo, hi = stage_layers(case.layers, pp_rank, pp_size)
    # First pass at ptr 0 only sizes the tensors.
    sizes = [
        tensor_spec(td, c, side, layer, tp_rank, tp_size, 0).nbytes
        for c in case.comps for td in c.tensors for layer in _layer_ids(td, lo, hi)
    ]
    buf = np.empty(sum(sizes) + GAP * (len(sizes) + 1), dtype=np.uint8)
    if side == SRC:
        buf[:] = rng.integers(0, 256, size=len(buf), dtype=np.uint8)
    else:
        buf[:] = (np.arange(len(buf)) * 7 + 3) % 256
    mem = HostMemory()
    ptr = mem.add(buf) + GAP
    comps = []
    for c in case.comps:
        tensors = []
        for td in c.tensors:
            for layer in _layer_ids(td, lo, hi):
                t = tensor_spec(td, c, side, layer, tp_rank, tp_size, ptr)
                tensors.append(t)
                ptr += t.nbytes + GAP
        comps.append(Component(type=c.type, name=c.name, tensors=tuple(tensors)))
    layout = Layout(page_size=page_size(case, side), tp_rank=tp_rank, tp_size=tp_size,
                    pp_rank=pp_rank, pp_size=pp_size, layers=(lo, hi), components=tuple(comps))
    return Rank(layout, mem, buf)


def page_size(case: Case, side: int) -> int:
    """The rank's nominal page size: its first token component's rows (informational
    only; tensors carry their own ``rows``)."""
    token = [c.rows[side] for c in case.comps if c.kind is RowKind.TOKEN]
    return token[0] if token else 1


def _layer_ids(td: TensorDef, lo: int, hi: int) -> list[int]:
    return list(range(lo, hi)) if td.layered else [NO_LAYER]


def build_all(case: Case) -> tuple[list[Rank], Rank]:
    """Every prefill rank (stage-major, then TP) and the one decode rank."""
    rng = np.random.default_rng(case.seed)
    srcs = [build_rank(case, SRC, r, pp, rng)
            for pp in range(case.src_pp) for r in range(case.tp[SRC])]
    return srcs, build_rank(case, DST, case.dst_rank, 0, rng)


# ------------------------------------------------------------------ strategies


def tiles(g: int, tp: int) -> bool:
    """A group of length ``g`` shards evenly (or replicates in blocks) over ``tp``."""
    return g % tp == 0 if tp <= g else tp % g == 0


TPS = st.sampled_from([1, 1, 2, 2, 4, 8, 3, 6, 5, 7])


def rarely() -> st.SearchStrategy[bool]:
    """True about one draw in eight. (Hypothesis favours small integers, so
    ``integers(0, 7) == 0`` would be far more frequent than that.)"""
    return st.sampled_from([False] * 7 + [True])


@st.composite
def lengths(draw: st.DrawFn, hi: int) -> int:
    """An index-list length: 0 about one draw in eight, else 1..hi."""
    if hi == 0 or draw(rarely()):
        return 0
    return draw(st.integers(1, hi))


@st.composite
def tensor_defs(draw: st.DrawFn, name: str, tp: tuple[int, int], layered: bool,
                layers: int) -> TensorDef:
    shard = None
    if not draw(rarely()):  # mostly sharded
        fits = [g for g in range(1, 9) if tiles(g, tp[0]) and tiles(g, tp[1])]
        groups = tuple(draw(st.lists(st.sampled_from(fits), min_size=1, max_size=3)))
        shard = (draw(st.integers(1, 2)), groups, draw(st.sampled_from([1, 2, 3])))
    ids = list(range(layers)) if layered else [NO_LAYER]
    elided = {draw(st.sampled_from(ids))} if draw(rarely()) else set()
    pads = st.sampled_from([0, 0, 1, 3, 8])
    return TensorDef(name, layered, shard, draw(st.integers(1, 5)), frozenset(elided),
                     (draw(pads), draw(pads)))


@st.composite
def comp_defs(draw: st.DrawFn, name: str, tp: tuple[int, int], layers: int) -> CompDef:
    typ = draw(st.sampled_from(list(KIND_OF)))
    kind = KIND_OF[typ]
    if kind is RowKind.TOKEN:
        rows = (draw(st.sampled_from([1, 2, 4, 3])), draw(st.sampled_from([1, 2, 4, 3])))
    elif kind is RowKind.RING:
        rows = (draw(st.integers(2, 5)), draw(st.integers(2, 5)))
    else:
        rows = (1, 1)
    caps = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    tensors = tuple(
        draw(tensor_defs(f"t{i}", tp, typ not in NO_LAYER_TYPES and not draw(rarely()),
                         layers))
        for i in range(draw(st.integers(1, 2)))
    )
    return CompDef(typ, name, rows, caps, tensors)


@st.composite
def item_lists(draw: st.DrawFn, c: CompDef) -> tuple[list[int], list[int]]:
    """Unique item lists paired per the component policy (trim may differ in length)."""
    pol = policy(c.type)
    s = draw(st.permutations(range(c.caps[SRC])))
    d = draw(st.permutations(range(c.caps[DST])))
    if pol.max_items == 1:
        return s[:1], d[:1]
    if pol.length is LengthPolicy.EXACT:
        n = draw(lengths(min(c.caps)))
        return s[:n], d[:n]
    same = draw(st.booleans())
    ns = draw(lengths(c.caps[SRC]))
    nd = min(ns, c.caps[DST]) if same else draw(lengths(c.caps[DST]))
    return s[:ns], d[:nd]


@st.composite
def token_indices(draw: st.DrawFn, c: CompDef) -> Indices | None:
    """Re-paged token rows, or ``None`` when the draw falls back to whole pages."""
    (rs, rd), (cap_s, cap_d) = c.rows, c.caps
    s = draw(st.permutations(range(cap_s)))[: draw(lengths(cap_s))]
    d = draw(st.permutations(range(cap_d)))[: draw(lengths(cap_d))]
    # First rows may skip whole pages: the semantics only index concatenated pages.
    fs = draw(st.integers(0, len(s) * rs))
    fd = draw(st.integers(0, len(d) * rd))
    cs, cd = len(s) * rs - fs, len(d) * rd - fd
    exact = policy(c.type).length is LengthPolicy.EXACT
    if rs == rd and fs == 0 and fd == 0:  # whole pages, unless num_rows says fewer rows
        if draw(st.booleans()):
            return None
        return Indices(np.array(s, dtype=np.int64), np.array(d, dtype=np.int64),
                       num_rows=draw(lengths(min(cs, cd))))
    if draw(st.booleans()) or (exact and cs != cd):
        n: int | None = draw(lengths(min(cs, cd)))
    else:
        n = None
    return Indices(np.array(s, dtype=np.int64), np.array(d, dtype=np.int64),
                   src_first_row=fs, dst_first_row=fd, num_rows=n)


@st.composite
def ring_positions(draw: st.DrawFn, rows: tuple[int, int]) -> list[int]:
    """Logical positions whose rows are distinct on both rings."""
    out: list[int] = []
    size = draw(lengths(6))
    for p in draw(st.lists(st.integers(0, 40), unique=True, min_size=size, max_size=size)):
        if all(p % r != q % r for q in out for r in rows):
            out.append(p)
    return out


@st.composite
def indices_for(draw: st.DrawFn, c: CompDef) -> Indices | None:
    if draw(rarely()):
        return None  # the component does not move in this call
    if c.kind is RowKind.TOKEN:
        idx = draw(token_indices(c))
        if idx is not None:
            return idx
    s, d = draw(item_lists(c))
    positions = None
    if c.kind is RowKind.RING and c.rows[SRC] != c.rows[DST]:
        positions = draw(ring_positions(c.rows))
    return Indices(np.array(s, dtype=np.int64), np.array(d, dtype=np.int64),
                   positions=positions)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    tp = (draw(TPS), draw(TPS))
    src_pp = draw(st.sampled_from([1, 1, 2]))
    layers = draw(st.integers(src_pp, 3))
    n = draw(st.integers(1, 3))
    comps = tuple(draw(comp_defs(f"c{i}", tp, layers)) for i in range(n))
    request = {c.name: draw(indices_for(c)) for c in comps}
    return Case(comps, layers, tp, src_pp, draw(st.integers(0, tp[DST] - 1)), request,
                draw(st.integers(0, 2**32 - 1)))


# ------------------------------------------------------------------ checks


def expand(seg: Segments) -> tuple[I64, I64]:
    """Byte-level ``(src, dst)`` address arrays of every segment, in order."""
    n = seg.length
    k = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    return np.repeat(seg.src, n) + k, np.repeat(seg.dst, n) + k


def planned_map(plans: Sequence[Plan]) -> tuple[I64, I64, I64]:
    """``(dst, layout, src)`` of every flattened planned byte, sorted by dst."""
    d_parts, l_parts, s_parts = [], [], []
    for i, p in enumerate(plans):
        s, d = expand(p.flatten())
        s_parts.append(s)
        d_parts.append(d)
        l_parts.append(np.full(len(d), i, dtype=np.int64))
    d, lay, s = (np.concatenate(x) if x else np.zeros(0, np.int64)
                 for x in (d_parts, l_parts, s_parts))
    order = np.argsort(d, kind="stable")
    return d[order], lay[order], s[order]


def assert_same_map(plans: Sequence[Plan], want: ByteMap) -> None:
    """(a): every oracle byte written exactly once, from the oracle's source, and
    nothing else written."""
    d, lay, s = planned_map(plans)
    twice = d[1:][np.diff(d) == 0]
    assert not len(twice), f"destination bytes written twice: {[hex(x) for x in twice[:5]]}"
    extra = np.setdiff1d(d, want.dst)
    missing = np.setdiff1d(want.dst, d)
    assert not len(extra), f"{len(extra)} bytes planned that the oracle does not write"
    assert not len(missing), f"{len(missing)} oracle bytes not planned"
    wrong = np.flatnonzero((lay != want.layout) | (s != want.src))
    assert not len(wrong), (
        f"{len(wrong)} bytes from the wrong source; first: dst {int(d[wrong[0]]):#x} got "
        f"layout {int(lay[wrong[0]])} {int(s[wrong[0]]):#x}, want layout "
        f"{int(want.layout[wrong[0]])} {int(want.src[wrong[0]]):#x}"
    )


def assert_coalesce_same(p: Plan) -> None:
    """(c): coalescing keeps the byte mapping and never adds segments."""
    flat, co = p.flatten(), p.coalesce()
    assert len(co) <= len(flat)
    fs, fd = expand(flat)
    cs, cd = expand(co)
    fo, co_ = np.argsort(fd, kind="stable"), np.argsort(cd, kind="stable")
    np.testing.assert_array_equal(fd[fo], cd[co_])
    np.testing.assert_array_equal(fs[fo], cs[co_])


def assert_execute_matches(plans: Sequence[Plan], srcs: Sequence[Rank], dst: Rank,
                           want: ByteMap) -> None:
    """(b): executing the plans equals applying the oracle, byte for byte, and
    leaves every other destination byte (and every source byte) as it was."""
    before = dst.buf.copy()
    src_before = [r.buf.copy() for r in srcs]
    for p, r in zip(plans, srcs, strict=True):
        execute(p, r.mem, dst.mem)
    got = dst.buf.copy()
    dst.buf[:] = before
    want.apply([r.mem for r in srcs], dst.mem)
    np.testing.assert_array_equal(got, dst.buf)
    for r, b in zip(srcs, src_before, strict=True):
        np.testing.assert_array_equal(r.buf, b)


def plan_all(srcs: Sequence[Rank], dst: Rank, request: dict[str, Indices | None]
             ) -> tuple[list[Plan], bool]:
    """One plan per prefill rank, and whether any call warned of a trim."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plans = [plan(r.layout, dst.layout, request) for r in srcs]
    return plans, any(issubclass(w.category, TrimWarning) for w in caught)


def snapshot(request: dict[str, Indices | None]) -> dict[str, list[I64]]:
    out: dict[str, list[I64]] = {}
    for name, idx in request.items():
        if idx is not None:
            arrays = [idx.src, idx.dst] + ([] if idx.positions is None else [idx.positions])
            out[name] = [a.copy() for a in arrays]
    return out


def assert_unchanged(request: dict[str, Indices | None], snap: dict[str, list[I64]]) -> None:
    """(d): the planner leaves the request's index arrays as they were."""
    for name, arrays in snapshot(request).items():
        for a, b in zip(arrays, snap[name], strict=True):
            np.testing.assert_array_equal(a, b)


def features(case: Case, want: ByteMap) -> list[str]:
    """Labels of what an example exercises (shown by --hypothesis-show-statistics)."""
    out = ["moves bytes" if len(want) else "moves nothing"]
    out += ["pp2"] if case.src_pp == 2 else []
    out += ["trim"] if want.trimmed & want.moved else []
    for c in case.comps:
        idx = case.request[c.name]
        if idx is None or c.name not in want.moved:
            continue
        if c.kind is RowKind.TOKEN and (c.rows[SRC] != c.rows[DST] or idx.src_first_row
                                        or idx.dst_first_row):
            out.append("token rows")
        if c.kind is RowKind.RING and c.rows[SRC] != c.rows[DST]:
            out.append("ring rows")
        for td in c.tensors:
            groups = td.shard[1] if td.shard else ()
            out += ["replicated"] if td.shard is None else []
            out += ["gqa"] if any(g < max(case.tp) for g in groups) else []
            out += ["groups"] if len(groups) > 1 else []
            out += ["outer"] if td.shard and td.shard[0] > 1 else []
            out += ["padded"] if c.kind is RowKind.ITEM and any(td.pad) else []
    return sorted(set(out))


# ------------------------------------------------------------------ properties


def could_trim(case: Case) -> bool:
    """Some trim-policy component of the request has lists of different lengths."""
    types = {c.name: c.type for c in case.comps}
    return any(
        idx is not None and policy(types[name]).length is LengthPolicy.TRIM
        and (len(idx.src) != len(idx.dst) or idx.num_rows is None)
        for name, idx in case.request.items()
    )


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_planner_matches_oracle(case: Case) -> None:
    srcs, dst = build_all(case)
    want = expected_writes([r.layout for r in srcs], dst.layout, case.request)
    for label in features(case, want):
        event(label)
    snap = snapshot(case.request)
    plans, warned = plan_all(srcs, dst, case.request)
    assert_unchanged(case.request, snap)
    assert_same_map(plans, want)
    for p in plans:
        assert_coalesce_same(p)
    # Every rank validates (and warns) alike, even one that moves nothing; a warning
    # therefore needs a trim-policy component whose lists really differ.
    trims = f"trimmed {sorted(want.trimmed)}, moved {sorted(want.moved)}, warned {warned}"
    assert bool(want.trimmed & want.moved) <= warned <= could_trim(case), trims
    assert_execute_matches(plans, srcs, dst, want)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), typ=st.sampled_from([StateType.KV, StateType.MLA, StateType.DSV4_REQUEST]),
       tp=st.tuples(TPS, TPS))
def test_exact_length_mismatch_raises(data: st.DataObject, typ: StateType,
                                      tp: tuple[int, int]) -> None:
    """Whole-item lists of an exact component that differ in length are refused
    by the planner and the oracle alike."""
    td = TensorDef("t", True, None, 2, frozenset())
    c = CompDef(typ, "c", (1, 1), (4, 4), (td,))
    ns = data.draw(st.integers(0, 4))
    nd = (ns + data.draw(st.integers(1, 4))) % 5
    case = Case((c,), 1, tp, 1, data.draw(st.integers(0, tp[DST] - 1)),
                {"c": Indices(list(range(ns)), list(range(nd)))}, 0)
    srcs, dst = build_all(case)
    with pytest.raises(IndexLengthMismatch):
        expected_writes([r.layout for r in srcs], dst.layout, case.request)
    # The rank that writes the replicated tensor; the others are checked below.
    writer = srcs[case.dst_rank * tp[SRC] // tp[DST]]
    with pytest.raises(IndexLengthMismatch):
        plan(writer.layout, dst.layout, case.request)


def test_exact_length_mismatch_raises_on_non_writing_rank() -> None:
    buf = np.zeros(8, dtype=np.uint8)

    def layout(tp_rank: int, tp_size: int) -> Layout:
        t = TensorSpec(name="k", layer_id=0, ptr=buf.ctypes.data, nbytes=8, item_bytes=2)
        kv = Component(type=StateType.KV, name="kv", tensors=(t,))
        return Layout(page_size=1, tp_rank=tp_rank, tp_size=tp_size, components=(kv,))

    with pytest.raises(IndexLengthMismatch):
        plan(layout(1, 2), layout(0, 1), {"kv": Indices([0], [0, 1])})


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_token_rows_past_the_pages_raise(data: st.DataObject) -> None:
    """``num_rows`` beyond what either side's pages hold is a PlanError on both."""
    rows = (data.draw(st.sampled_from([1, 2, 4])), data.draw(st.sampled_from([1, 2, 4])))
    c = CompDef(StateType.KV, "c", rows, (3, 3), (TensorDef("t", True, None, 2, frozenset()),))
    fs = data.draw(st.integers(0, 3 * rows[SRC]))
    fd = data.draw(st.integers(0, 3 * rows[DST]))
    n = min(3 * rows[SRC] - fs, 3 * rows[DST] - fd) + data.draw(st.integers(1, 3))
    idx = Indices([0, 1, 2], [2, 1, 0], src_first_row=fs, dst_first_row=fd, num_rows=n)
    srcs, dst = build_all(Case((c,), 1, (1, 1), 1, 0, {"c": idx}, 0))
    with pytest.raises(PlanError):
        expected_writes([srcs[0].layout], dst.layout, {"c": idx})
    with pytest.raises(PlanError):
        plan(srcs[0].layout, dst.layout, {"c": idx})


@pytest.mark.parametrize("n", [0, 1, 3, 4])
def test_num_rows_on_equal_whole_pages_moves_exactly_that_many(n: int) -> None:
    """Equal page sizes and no first row: ``num_rows`` still says how many token rows
    move (it used to be ignored, moving the whole 4-row page whatever it said)."""
    td = TensorDef("k", True, None, 3, frozenset())
    c = CompDef(StateType.KV, "kv", (4, 4), (2, 2), (td,))
    case = Case((c,), 1, (1, 1), 1, 0, {"kv": Indices([1], [0], num_rows=n)}, 4)
    before = tensor_bytes(build_all(case)[1], "kv", "k").reshape(2, 4, 3)[0].copy()
    srcs, dst, want = run_case(case)
    assert len(want) == n * 3
    s = tensor_bytes(srcs[0], "kv", "k").reshape(2, 4, 3)[1]
    d = tensor_bytes(dst, "kv", "k").reshape(2, 4, 3)[0]
    np.testing.assert_array_equal(d[:n], s[:n])
    np.testing.assert_array_equal(d[n:], before[n:])  # nothing past num_rows landed
    assert n == 4 or not np.array_equal(d[n:], s[n:])  # (the rows past it did differ)


@pytest.mark.parametrize("n", [5, 100])
def test_num_rows_past_equal_whole_pages_is_refused(n: int) -> None:
    """More rows than one 4-row page holds: refused by the planner and the oracle, the
    message naming the value."""
    td = TensorDef("k", True, None, 3, frozenset())
    c = CompDef(StateType.KV, "kv", (4, 4), (2, 2), (td,))
    idx = Indices([1], [0], num_rows=n)
    srcs, dst = build_all(Case((c,), 1, (1, 1), 1, 0, {"kv": idx}, 4))
    with pytest.raises(PlanError, match=f"num_rows {n} exceeds"):
        expected_writes([srcs[0].layout], dst.layout, {"kv": idx})
    with pytest.raises(PlanError, match=f"{n} token rows requested"):
        plan(srcs[0].layout, dst.layout, {"kv": idx})


def test_num_rows_on_a_component_without_token_rows_is_refused() -> None:
    """``num_rows`` counts token rows; a component of whole slots has none, so a value
    there is refused (naming it), never dropped."""
    td = TensorDef("conv", True, None, 6, frozenset())
    c = CompDef(StateType.MAMBA, "mamba", (1, 1), (2, 2), (td,))
    idx = Indices([1], [0], num_rows=1)
    srcs, dst = build_all(Case((c,), 1, (1, 1), 1, 0, {"mamba": idx}, 4))
    for run in (lambda: expected_writes([srcs[0].layout], dst.layout, {"mamba": idx}),
                lambda: plan(srcs[0].layout, dst.layout, {"mamba": idx})):
        with pytest.raises(PlanError, match="component 'mamba': num_rows 1 given, but "
                                            "none of its tensors holds token rows"):
            run()


def test_trim_warns_and_keeps_common_prefix() -> None:
    c = CompDef(StateType.SWA, "c", (2, 2), (4, 4), (TensorDef("t", True, None, 3, frozenset()),))
    case = Case((c,), 1, (1, 1), 1, 0, {"c": Indices([3, 1, 0], [2, 0])}, 0)
    srcs, dst = build_all(case)
    want = expected_writes([srcs[0].layout], dst.layout, case.request)
    assert want.trimmed == {"c"} and len(want) == 2 * 2 * 3
    with pytest.warns(TrimWarning):
        p = plan(srcs[0].layout, dst.layout, case.request)
    assert_same_map([p], want)


# ------------------------------------------------------------------ hand-written cases


def run_case(case: Case) -> tuple[list[Rank], Rank, ByteMap]:
    """Plan and execute every prefill rank into the decode rank; check against the
    oracle; return the ranks (decode memory holds the executed result)."""
    srcs, dst = build_all(case)
    want = expected_writes([r.layout for r in srcs], dst.layout, case.request)
    plans, _ = plan_all(srcs, dst, case.request)
    assert_same_map(plans, want)
    for p, r in zip(plans, srcs, strict=True):
        execute(p, r.mem, dst.mem)
    return srcs, dst, want


def tensor_bytes(rank: Rank, comp: str, name: str, layer: int = 0) -> np.ndarray:
    """The uint8 bytes of one tensor of a rank."""
    t = next(t for t in rank.layout.component(comp).tensors if t.key == (name, layer))
    return rank.mem.view(t.ptr)[: t.nbytes]


def kv_case(tp: tuple[int, int], heads: int, dst_rank: int, page: tuple[int, int] = (2, 2),
            request: Indices | None = None) -> Case:
    """One KV tensor: pages × page rows × heads × 2 bytes."""
    td = TensorDef("k", True, (1, (heads,), 2), 0, frozenset())
    c = CompDef(StateType.KV, "kv", page, (4, 4), (td,))
    idx = request if request is not None else Indices([1, 3, 0], [2, 0, 3])
    return Case((c,), 1, tp, 1, dst_rank, {"kv": idx}, 7)


def test_mha_tp2_to_tp1() -> None:
    """Decode TP 1 gets heads 0-1 from prefill rank 0 and heads 2-3 from rank 1."""
    srcs, dst, _ = run_case(kv_case((2, 1), heads=4, dst_rank=0))
    s = [tensor_bytes(r, "kv", "k").reshape(4, 2, 2, 2) for r in srcs]
    d = tensor_bytes(dst, "kv", "k").reshape(4, 2, 4, 2)
    for sp, dp in ((1, 2), (3, 0), (0, 3)):
        np.testing.assert_array_equal(d[dp, :, 0:2], s[0][sp])
        np.testing.assert_array_equal(d[dp, :, 2:4], s[1][sp])


def test_mha_tp1_to_tp2() -> None:
    """Decode rank 1 of 2 gets heads 2-3 of the single prefill rank; page 1 untouched."""
    case = kv_case((1, 2), heads=4, dst_rank=1)
    _, pristine = build_all(case)
    srcs, dst, _ = run_case(case)
    s = tensor_bytes(srcs[0], "kv", "k").reshape(4, 2, 4, 2)
    d = tensor_bytes(dst, "kv", "k").reshape(4, 2, 2, 2)
    for sp, dp in ((1, 2), (3, 0), (0, 3)):
        np.testing.assert_array_equal(d[dp], s[sp, :, 2:4])
    np.testing.assert_array_equal(d[1], tensor_bytes(pristine, "kv", "k").reshape(4, 2, 2, 2)[1])


@pytest.mark.parametrize("dst_rank", [0, 1])
def test_gqa_tp8_to_tp2(dst_rank: int) -> None:
    """4 KV heads over prefill TP 8: head h lives on ranks 2h and 2h+1. Decode rank r
    holds heads 2r, 2r+1 and takes each from replica ``(r * 8 // 2) % 2`` = 0."""
    srcs, dst, _ = run_case(kv_case((8, 2), heads=4, dst_rank=dst_rank))
    s = [tensor_bytes(r, "kv", "k").reshape(4, 2, 1, 2) for r in srcs]
    d = tensor_bytes(dst, "kv", "k").reshape(4, 2, 2, 2)
    for local, head in enumerate((2 * dst_rank, 2 * dst_rank + 1)):
        writer = 2 * head + (dst_rank * 8 // 2) % 2
        for sp, dp in ((1, 2), (3, 0), (0, 3)):
            np.testing.assert_array_equal(d[dp, :, local], s[writer][sp, :, 0])


def gdn_global(local: Sequence[np.ndarray], groups: tuple[int, ...], tp: int) -> np.ndarray:
    """Reassemble ``(..., outer, axis, inner)`` shards of a grouped axis (tp <= every group)."""
    parts = []
    start = 0
    for g in groups:
        n = g // tp
        parts.append(np.concatenate([x[..., start:start + n, :] for x in local], axis=-2))
        start += n
    return np.concatenate(parts, axis=-2)


@pytest.mark.parametrize("dst_rank", range(4))
def test_gdn_conv_groups_tp2_to_tp4(dst_rank: int) -> None:
    """Transposed GDN conv state: 3 kernel rows × [q 4 | k 4 | v 8] channels × 2 B,
    each sub-block sharded on its own; prefill TP 2, decode TP 4, one slot."""
    groups = (4, 4, 8)
    td = TensorDef("conv", True, (3, groups, 2), 0, frozenset())
    c = CompDef(StateType.MAMBA, "mamba", (1, 1), (3, 3), (td,))
    case = Case((c,), 1, (2, 4), 1, dst_rank, {"mamba": Indices([2], [1])}, 11)
    srcs, dst, _ = run_case(case)
    local = [tensor_bytes(r, "mamba", "conv").reshape(3, 3, 8, 2) for r in srcs]
    full = gdn_global(local, groups, 2)[2]  # slot 2, shape (3, 16, 2)
    want = np.concatenate([full[:, s:s + n] for s, n in ((dst_rank, 1), (4 + dst_rank, 1),
                                                          (8 + 2 * dst_rank, 2))], axis=1)
    np.testing.assert_array_equal(tensor_bytes(dst, "mamba", "conv").reshape(3, 3, 4, 2)[1], want)


def test_repage_2_to_4_with_first_rows() -> None:
    """Token rows [1, 6) of prefill pages [3, 0, 2] (page 2) land at rows [3, 8) of
    decode pages [1, 2, 0] (page 4)."""
    td = TensorDef("k", True, None, 3, frozenset())
    c = CompDef(StateType.KV, "kv", (2, 4), (4, 3), (td,))
    idx = Indices([3, 0, 2], [1, 2, 0], src_first_row=1, dst_first_row=3, num_rows=5)
    srcs, dst, want = run_case(Case((c,), 1, (1, 1), 1, 0, {"kv": idx}, 3))
    s = tensor_bytes(srcs[0], "kv", "k").reshape(4, 2, 3)[[3, 0, 2]].reshape(6, 3)
    d = tensor_bytes(dst, "kv", "k").reshape(3, 4, 3)[[1, 2, 0]].reshape(12, 3)
    np.testing.assert_array_equal(d[3:8], s[1:6])
    assert len(want) == 5 * 3


def test_ring_4_to_6_by_position() -> None:
    """Position p sits in row p % 4 on prefill and p % 6 on decode."""
    td = TensorDef("r", True, None, 2, frozenset())
    c = CompDef(StateType.DSV4_SWA, "ring", (4, 6), (2, 2), (td,))
    idx = Indices([1], [0], positions=[9, 10, 11])
    srcs, dst, _ = run_case(Case((c,), 1, (1, 1), 1, 0, {"ring": idx}, 5))
    s = tensor_bytes(srcs[0], "ring", "r").reshape(2, 4, 2)
    d = tensor_bytes(dst, "ring", "r").reshape(2, 6, 2)
    for p in (9, 10, 11):
        np.testing.assert_array_equal(d[0, p % 6], s[1, p % 4])


def test_pp2_layers_and_no_layer_rows() -> None:
    """Two prefill stages each write their own layer; only the last writes aux."""
    kv = CompDef(StateType.KV, "kv", (1, 1), (2, 2),
                 (TensorDef("k", True, None, 4, frozenset()),))
    aux = CompDef(StateType.AUX, "aux", (1, 1), (2, 2),
                  (TensorDef("a", False, None, 3, frozenset()),))
    case = Case((kv, aux), 2, (1, 1), 2, 0,
                {"kv": Indices([0, 1], [1, 0]), "aux": Indices([1], [0])}, 9)
    srcs, dst, want = run_case(case)
    assert set(want.layout.tolist()) == {0, 1}
    for stage, layer in ((0, 0), (1, 1)):
        s = tensor_bytes(srcs[stage], "kv", "k", layer).reshape(2, 4)
        np.testing.assert_array_equal(tensor_bytes(dst, "kv", "k", layer).reshape(2, 4), s[::-1])
    aux_src = tensor_bytes(srcs[1], "aux", "a", NO_LAYER).reshape(2, 3)
    np.testing.assert_array_equal(tensor_bytes(dst, "aux", "a", NO_LAYER).reshape(2, 3)[0],
                                  aux_src[1])
    aux_t = dst.layout.component("aux").tensors[0]
    stage0_dst, _ = want.of_layout(0)
    assert not ((stage0_dst >= aux_t.ptr) & (stage0_dst < aux_t.ptr + aux_t.nbytes)).any()


def test_caller_index_arrays_untouched() -> None:
    """(d), from the caller's side: the arrays handed to Indices stay as they were."""
    src_pages = np.array([3, 1, 2])
    dst_pages = np.array([0, 2, 1])
    case = kv_case((2, 2), heads=4, dst_rank=1, page=(2, 4),
                   request=Indices(src_pages, dst_pages, src_first_row=1, num_rows=4))
    run_case(case)
    np.testing.assert_array_equal(src_pages, [3, 1, 2])
    np.testing.assert_array_equal(dst_pages, [0, 2, 1])
    assert src_pages.flags.writeable and dst_pages.flags.writeable


# ------------------------------------------------------------------ padded items

CONV_SHARD = ShardSpec.axis(axis=256, inner_bytes=6, groups=(64, 64, 128))  # q | k | v
SSM_SHARD = ShardSpec.axis(axis=8, inner_bytes=128)  # 8 heads x 128 B
SLOTS = 4


def mamba_rank(tp_rank: int, tp_size: int, page: int, side: int, rng: np.random.Generator,
               ssm_short: int = 0) -> Rank:
    """vLLM's Mamba layout: one pool of ``SLOTS`` raw pages of ``page`` bytes, each holding
    the rank's conv state at offset 0, its SSM state right after it, then padding. Conv
    and SSM are two tensors over the same pages (same stride, different offsets), each
    sharded its own way. The SSM tensor ends with the last slot's SSM state (no padding
    after it), ``ssm_short`` bytes earlier when given."""
    conv = CONV_SHARD.local_item_bytes(tp_rank, tp_size)
    ssm = SSM_SHARD.local_item_bytes(tp_rank, tp_size)
    assert conv + ssm <= page
    buf = np.empty(GAP + page * SLOTS + GAP, dtype=np.uint8)
    if side == SRC:
        buf[:] = rng.integers(0, 256, size=len(buf), dtype=np.uint8)
    else:
        buf[:] = (np.arange(len(buf)) * 7 + 3) % 256
    mem = HostMemory()
    base = mem.add(buf) + GAP
    tensors = (
        TensorSpec(name="conv", layer_id=0, ptr=base, nbytes=page * SLOTS, item_bytes=conv,
                   stride=page, shard=CONV_SHARD),
        TensorSpec(name="ssm", layer_id=0, ptr=base + conv,
                   nbytes=page * (SLOTS - 1) + ssm - ssm_short, item_bytes=ssm, stride=page,
                   shard=SSM_SHARD),
    )
    layout = Layout(page_size=16, tp_rank=tp_rank, tp_size=tp_size,
                    components=(Component(type=StateType.MAMBA, name="mamba", tensors=tensors),),
                    regions=(Region(ptr=base, nbytes=page * SLOTS),))
    return Rank(layout, mem, buf)


def item_bytes_of(t: TensorSpec, slot: int) -> I64:
    """Absolute addresses of item ``slot`` of ``t``: its ``item_bytes`` and nothing else."""
    return np.arange(t.item_bytes, dtype=np.int64) + t.ptr + slot * t.item_stride


def global_state(srcs: Sequence[Rank], name: str, shard: ShardSpec, slot: int) -> np.ndarray:
    """Item ``slot`` of tensor ``name``, reassembled from every prefill rank as the global
    ``(axis, inner)`` array (each group concatenated from the ranks' shares)."""
    local = []
    for r in srcs:
        t = next(t for t in r.layout.component("mamba").tensors if t.name == name)
        local.append(r.mem.read(item_bytes_of(t, slot)).reshape(-1, shard.inner_bytes))
    return gdn_global(local, shard.groups, len(srcs))


def local_share(full: np.ndarray, shard: ShardSpec, tp_rank: int, tp_size: int) -> np.ndarray:
    """What rank ``tp_rank`` of ``tp_size`` holds of a global ``(axis, inner)`` item."""
    parts, start = [], 0
    for g, r in zip(shard.groups, shard.ranges(tp_rank, tp_size), strict=True):
        parts.append(full[start + r.start:start + r.start + r.length])
        start += g
    return np.concatenate(parts)


# (prefill TP, decode TP, prefill page bytes, decode page bytes): conv + SSM take 2560 B
# of a page at TP 1, 1280 at TP 2, 640 at TP 4; the padding differs by TP (and engine)
PADDED_CASES = [
    (1, 2, 4096, 2048),
    (2, 1, 2048, 4096),
    (2, 4, 2048, 1024),
    (2, 4, 1536, 640),  # decode: SSM state ends each page exactly
    (4, 2, 1024, 1280),  # decode: conv + SSM fill the page, no padding at all
    (2, 2, 2048, 2048),  # equal strides
    (2, 2, 1536, 2048),
]


@pytest.mark.parametrize(("tp_s", "tp_d", "page_s", "page_d"), PADDED_CASES)
def test_padded_conv_and_ssm_share_pages(tp_s: int, tp_d: int, page_s: int, page_d: int
                                         ) -> None:
    """Conv and SSM states of one Mamba layer in shared raw pages, sharded differently:
    every decode rank gets exactly its share of both, from the right prefill ranks, and
    no byte of the padding, of the other state or of another slot is written."""
    for dst_rank in range(tp_d):
        for s_slot, d_slot in ((SLOTS - 1, 1), (0, SLOTS - 1), (2, 2)):
            rng = np.random.default_rng(100 * dst_rank + 10 * s_slot + d_slot)
            srcs = [mamba_rank(r, tp_s, page_s, SRC, rng) for r in range(tp_s)]
            dst = mamba_rank(dst_rank, tp_d, page_d, DST, rng)
            request: dict[str, Indices | None] = {"mamba": Indices([s_slot], [d_slot])}
            want = expected_writes([r.layout for r in srcs], dst.layout, request)
            plans, _ = plan_all(srcs, dst, request)
            assert_same_map(plans, want)
            for p in plans:
                assert_coalesce_same(p)
            # every planned byte lies in its own tensor's items, on both sides
            for p, r in zip(plans, srcs, strict=True):
                for e in p.entries:
                    st_ = next(t for t in r.layout.component("mamba").tensors
                               if t.name == e.tensor)
                    dt_ = next(t for t in dst.layout.component("mamba").tensors
                               if t.name == e.tensor)
                    s, d = expand(e.segments())
                    assert np.isin(s, item_bytes_of(st_, s_slot)).all()
                    assert np.isin(d, item_bytes_of(dt_, d_slot)).all()
            # together the prefill ranks write the decode slot's two items, nothing else
            conv_t, ssm_t = dst.layout.component("mamba").tensors
            items = np.concatenate([item_bytes_of(conv_t, d_slot), item_bytes_of(ssm_t, d_slot)])
            np.testing.assert_array_equal(want.dst, np.sort(items))
            assert_execute_matches(plans, srcs, dst, want)
            # and the bytes are the right ones: the decode rank's share of the global states
            for t, shard in ((conv_t, CONV_SHARD), (ssm_t, SSM_SHARD)):
                full = global_state(srcs, t.name, shard, s_slot)
                got = dst.mem.read(item_bytes_of(t, d_slot)).reshape(-1, shard.inner_bytes)
                np.testing.assert_array_equal(got, local_share(full, shard, dst_rank, tp_d))


def test_padded_items_past_the_tensor_are_out_of_bounds() -> None:
    """Bounds count items by the stride, and the last item needs only its own bytes."""
    rng = np.random.default_rng(0)
    srcs = [mamba_rank(r, 2, 2048, SRC, rng) for r in range(2)]
    dst = mamba_rank(0, 1, 4096, DST, rng)
    for bad in ({"mamba": Indices([SLOTS], [0])}, {"mamba": Indices([0], [SLOTS])}):
        with pytest.raises(OutOfBounds, match=r"tensor \('conv', 0\)"):
            expected_writes([r.layout for r in srcs], dst.layout, bad)
        with pytest.raises(OutOfBounds, match="tensor 'conv' layer 0"):
            plan(srcs[0].layout, dst.layout, bad)
    # an SSM tensor one byte short of its last item: that slot is out of bounds for SSM
    short = mamba_rank(0, 1, 4096, DST, rng, ssm_short=1)
    assert [t.capacity for t in short.layout.component("mamba").tensors] == [SLOTS, SLOTS - 1]
    req: dict[str, Indices | None] = {"mamba": Indices([1], [SLOTS - 1])}
    with pytest.raises(OutOfBounds, match=r"destination tensor \('ssm', 0\)"):
        expected_writes([r.layout for r in srcs], short.layout, req)
    # prefill rank 1 writes heads 4-7, the item's last bytes; rank 0's half fits
    with pytest.raises(OutOfBounds, match=r"tensor 'ssm' layer 0: decode index 3"):
        plan(srcs[1].layout, short.layout, req)
    assert plan(srcs[0].layout, short.layout, req).nbytes == 768 + 512
    ok = {"mamba": Indices([1], [SLOTS - 2])}
    assert_same_map([plan(r.layout, short.layout, ok) for r in srcs],
                    expected_writes([r.layout for r in srcs], short.layout, ok))


def test_padded_rows_of_many_items_do_not_coalesce_over_the_padding() -> None:
    """Consecutive padded items on both sides are separate segments (the padding between
    them is not copied), while packed ones still merge into one run."""
    def case(pad: tuple[int, int]) -> Case:
        td = TensorDef("r", True, None, 16, frozenset(), pad)
        c = CompDef(StateType.DSV4_REQUEST, "req", (1, 1), (6, 6), (td,))
        return Case((c,), 1, (1, 1), 1, 0, {"req": Indices([1, 2, 3], [2, 3, 4])}, 1)

    padded = case((8, 5))
    srcs, dst = build_all(padded)
    want = expected_writes([srcs[0].layout], dst.layout, padded.request)
    p = plan(srcs[0].layout, dst.layout, padded.request)
    assert_same_map([p], want)
    assert len(p.coalesce()) == 3 and p.coalesce().nbytes == 3 * 16 == len(want)
    assert_execute_matches([p], srcs, dst, want)
    srcs, dst = build_all(case((0, 0)))
    assert len(plan(srcs[0].layout, dst.layout, case((0, 0)).request).coalesce()) == 1


MIXED_SHAPES = ["gemma4", "mimo_v2_flash", "inkling"]
MIXED_TP = [(2, 1), (1, 2), (4, 2), (2, 4)]


@pytest.mark.parametrize("tp", MIXED_TP, ids=[f"tp{a}to{b}" for a, b in MIXED_TP])
@pytest.mark.parametrize("name", MIXED_SHAPES)
def test_layers_of_mixed_kv_shapes_match_the_oracle(name: str, tp: tuple[int, int]) -> None:
    """Named shapes whose attention layers differ in KV heads / head dims (a pool per page
    shape), whose K and V differ in head dim, and whose layers keep short convs beside
    their attention (head-sharded over K/V, replicated over the hidden stream): the planner
    writes exactly the oracle's bytes into every decode rank, at TP 2→1, 1→2 and where a
    group is replicated on one side and sharded on the other."""
    from kvhandoff.lab import shapes

    shape = shapes.tiny(shapes.get(name))
    sizes = {"page_size": 4, "num_pages": 8, "num_slots": 3}
    srcs = [shapes.layout_for(shape, tp_rank=r, tp_size=tp[0], **sizes) for r in range(tp[0])]
    for d in range(tp[1]):
        dst = shapes.layout_for(shape, tp_rank=d, tp_size=tp[1], **sizes)
        request = shapes.request_for(shape, srcs[0], dst, 13, seed=d)
        want = expected_writes(srcs, dst, request)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TrimWarning)
            plans = [plan(s, dst, request) for s in srcs]
        assert_same_map(plans, want)
        assert {"kv", "swa"} <= want.moved
        assert ("short_conv" in want.moved) == (name == "inkling")
