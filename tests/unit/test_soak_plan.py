"""The soak's pure parts: its plan from a seed, and the fill and where it lands."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from kvhandoff.lab.soak import pattern
from kvhandoff.lab.soak.plan import WARMUP, Fault, Settings, chaos_schedule, request_spec
from kvhandoff.lab.testing.handoff import AUX, first_token, stamp_prefill_aux
from kvhandoff.lab.testing.oracle import ByteMap


def test_the_same_seed_gives_the_same_soak() -> None:
    s = Settings(seconds=600, seed=7)
    assert chaos_schedule(s) == chaos_schedule(Settings(seconds=600, seed=7))
    assert [request_spec(s, i) for i in range(50)] == [request_spec(s, i) for i in range(50)]
    other = Settings(seconds=600, seed=8)
    assert chaos_schedule(s) != chaos_schedule(other)
    assert request_spec(s, 0) != request_spec(other, 0)


@pytest.mark.parametrize("seed", range(5))
def test_the_schedule_keeps_its_rules(seed: int) -> None:
    s = Settings(seconds=900, seed=seed, chaos_every=3.0)
    events = chaos_schedule(s)
    assert {e.fault for e in events} == {Fault.KILL, Fault.FREEZE}
    assert {e.role for e in events} == {"prefill", "decode"}
    assert [e.at for e in events] == sorted(e.at for e in events)
    for e in events:
        assert e.at >= WARMUP and e.at + e.hold < 0.8 * s.seconds  # quiet head and tail
        top = s.max_down if e.fault is Fault.KILL else s.max_freeze
        assert 0.5 <= e.hold <= top
    # never both workers of a role down at once (a killed one counts until restarted)
    spans = [(e.role, e.worker, e.at, e.at + e.hold + (5.0 if e.fault is Fault.KILL else 0))
             for e in events]
    for i, (role, w, a, b) in enumerate(spans):
        for role2, w2, a2, _ in spans[i + 1:]:
            if role2 == role and a <= a2 < b:
                pytest.fail(f"{role}{w2} faulted at {a2} while {role}{w} is down until {b}")


def test_requests_fit_the_geometry_and_mix_the_faults() -> None:
    s = Settings(seconds=60, seed=3, abort_rate=0.2, flip_rate=0.2)
    specs = [request_spec(s, i) for i in range(2000)]
    geo = s.geometry
    assert len({r.rid for r in specs}) == len(specs)
    for r in specs:
        assert 1 <= r.num_tokens <= geo.max_tokens
        assert 1 <= r.chunk_pages <= -(-r.num_tokens // geo.page_size)
        assert r.transport in s.transports and r.prefill < s.prefills and r.decode < s.decodes
        assert r.abort is None or (r.abort.side in ("prefill", "decode")
                                   and 0 <= r.abort.after <= 0.3)
    aborts = sum(r.abort is not None for r in specs) / len(specs)
    flips = sum(r.flip for r in specs) / len(specs)
    assert 0.15 < aborts < 0.25 and 0.15 < flips < 0.25
    assert {r.abort.side for r in specs if r.abort} == {"prefill", "decode"}


def test_netcut_adds_link_cuts_and_a_lane_without_changing_the_rest() -> None:
    plain = Settings(seconds=600, seed=4)
    cut = dataclasses.replace(plain, netcut=True)
    events = chaos_schedule(cut)
    cuts = [e for e in events if e.fault is Fault.CUT]
    assert cuts and [e for e in events if e.fault is not Fault.CUT] == list(
        chaos_schedule(plain))
    for a, b in itertools.pairwise(cuts):
        assert a.at + a.hold <= b.at  # one cut at a time
    assert all(e.role == "link" and e.at + e.hold < 0.8 * cut.seconds for e in cuts)
    lane = [request_spec(cut, i) for i in range(500)]
    on_lane = [r for r in lane if r.lane]
    assert 50 < len(on_lane) < 150
    assert all(r.transport == "tcp" and (r.prefill, r.decode) == (2, 2) for r in on_lane)
    for r in lane:
        if not r.lane:
            assert r == request_spec(plain, r.index)
    with pytest.raises(ValueError):
        Settings(seconds=10, transports=("shm",), netcut=True)


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError):
        Settings(seconds=0)
    with pytest.raises(ValueError):
        Settings(seconds=10, transports=())
    with pytest.raises(ValueError):
        Settings(seconds=10, flip_rate=2)


GEO = pattern.Geometry(blocks=4, block_pages=6)


def test_blocks_never_share_a_byte() -> None:
    maps = [pattern.byte_map(GEO, pattern.indices(GEO, GEO.max_tokens, b, b))
            for b in range(GEO.blocks)]
    for i, a in enumerate(maps):
        for b in maps[i + 1:]:
            assert not np.intersect1d(a.dst, b.dst).size
            assert not np.intersect1d(a.src, b.src).size
    with pytest.raises(ValueError):
        pattern.indices(GEO, GEO.max_tokens + 1, 0, 0)
    with pytest.raises(ValueError):
        pattern.indices(GEO, 4, GEO.blocks, 0)


def test_the_fill_depends_on_the_request_and_the_address() -> None:
    addrs = np.arange(1 << 44, (1 << 44) + 4096, dtype=np.int64)
    a = pattern.fill(pattern.request_key("r1"), addrs)
    assert (a == pattern.fill(pattern.request_key("r1"), addrs)).all()
    assert (a != pattern.fill(pattern.request_key("r2"), addrs)).mean() > 0.9
    assert len(np.unique(a)) > 200  # not a constant, not a short cycle


def _transfer(geo: pattern.Geometry, rid: str, pblock: int, dblock: int
              ) -> tuple[pattern.MirrorArena, ByteMap]:
    """What a faithful transfer does: prefill fills, packs and stamps its aux row; every
    mapped byte is copied to decode."""
    srcs = [pattern.MirrorArena(geo.fake_base("prefill", t)) for t in range(geo.prefill_tp)]
    lays = [geo.layout("prefill", t, a) for t, a in enumerate(srcs)]
    dst = pattern.MirrorArena(geo.fake_base("decode", 0))
    geo.layout("decode", 0, dst)
    req = pattern.indices(geo, 23, pblock, dblock)
    bm = pattern.byte_map(geo, req)
    key = pattern.request_key(rid)
    for li, arena in enumerate(srcs):
        _, src = bm.of_layout(li)
        arena.write(src, pattern.fill(key, src))
        aux = lays[li].component("aux").tensors[0]
        stride = aux.item_stride or aux.item_bytes
        ptr = arena.fake(aux.ptr)
        row_addrs = np.arange(ptr + (pblock + 1) * stride,
                              ptr + (pblock + 1) * stride + aux.item_bytes, dtype=np.int64)
        row = arena.read(row_addrs)
        AUX.pack(row, first_token=first_token(rid), first_logprob=-0.5)
        if li == 0:
            stamp_prefill_aux(row, rid)  # what the Sender stamps
        arena.write(row_addrs, row)
    for li, arena in enumerate(srcs):
        d, s = bm.of_layout(li)
        dst.write(d, arena.read(s))
    return dst, bm


def test_a_faithful_transfer_matches_the_expected_bytes_and_a_flip_does_not() -> None:
    dst, bm = _transfer(GEO, "req-a", 1, 2)
    got = dst.read(bm.dst)
    assert (got == pattern.expected(GEO, "req-a", bm)).all()
    assert (got != pattern.expected(GEO, "req-b", bm)).mean() > 0.9
    one = bm.dst[len(bm.dst) // 3: len(bm.dst) // 3 + 1]
    dst.write(one, dst.read(one) ^ np.uint8(1))
    got = dst.read(bm.dst)
    assert int((got != pattern.expected(GEO, "req-a", bm)).sum()) == 1


def test_a_mirror_arena_refuses_addresses_outside_it() -> None:
    a = pattern.MirrorArena(1 << 44)
    a(100)
    a.write(np.array([(1 << 44) + 99], np.int64), np.array([7], np.uint8))
    assert a.read(np.array([(1 << 44) + 99], np.int64)).tolist() == [7]
    with pytest.raises(ValueError):
        a.read(np.array([(1 << 44) + 100], np.int64))
    with pytest.raises(ValueError):
        a.read(np.array([(1 << 44) - 1], np.int64))


def test_geometry_is_a_value() -> None:
    assert dataclasses.replace(GEO) == GEO and hash(GEO) == hash(dataclasses.replace(GEO))
