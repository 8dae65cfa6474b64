"""Engine adapters (mooncake, nixl): the gotchas of each engine, checked directly.

The parametrised conformance suite covers the contract; these pin what is specific to
wrapping a real engine: endpoints that are not ours are refused, Mooncake's per-peer
queue is never overfilled (an overfill poisons its engine for good), NIXL's re-posted
requests carry the current bytes, and coalesced segments never straddle two regions.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import numpy as np
import pytest
from kvh_conformance import make

from kvhandoff.lab.testing.params import transport_params
from kvhandoff.layout import Region
from kvhandoff.plan.model import Plan, TensorPlan
from kvhandoff.transport import (
    ConnectError,
    TransferState,
    Transport,
    available_transports,
    create_transport,
)

ENGINES = ("mooncake", "nixl")
_AVAIL = available_transports()
TIMEOUT = 30.0


def engines() -> list[Any]:
    return transport_params(ENGINES)


def _pages(src: np.ndarray, dst: np.ndarray, unit: int, si: np.ndarray, di: np.ndarray,
           layer: int = 0) -> TensorPlan:
    return TensorPlan(component="kv", tensor=f"t{layer}", layer_id=layer,
                      src_ptr=int(src.ctypes.data), dst_ptr=int(dst.ctypes.data),
                      src_unit=unit, dst_unit=unit, src_idx=si.astype(np.int64),
                      dst_idx=di.astype(np.int64),
                      pieces=np.array([[0, 0, unit, 1, unit, unit]], np.int64))


def _send(t: Transport, peer: Any, p: Plan) -> None:
    h = t.submit(peer, p)
    assert t.wait(h, TIMEOUT) is TransferState.DONE, h.error
    h.release()


@pytest.mark.parametrize("engine", engines())
def test_foreign_endpoints_are_refused(engine: str) -> None:
    other = "nixl" if engine == "mooncake" else "mooncake"
    with make(engine) as t, create_transport("memory") as m:
        for bad in (b"", b"garbage", b'{"kind": "tcp"}', m.endpoint()):
            with pytest.raises(ConnectError):
                t.connect(bad)
        if _AVAIL[other].ok:
            with make(other) as o, pytest.raises(ConnectError, match=other):
                t.connect(o.endpoint())


@pytest.mark.parametrize("engine", engines())
def test_many_scattered_segments_then_more(engine: str) -> None:
    """5000 scattered pages: more than Mooncake's default queue + admissions (2048) in
    one plan, sent through a small window; the engine stays healthy afterwards."""
    opts = {"max_inflight": 64} if engine == "mooncake" else {}
    rng = np.random.default_rng(0)
    unit, cap, n = 512, 8000, 5000
    with make(engine, **opts) as s, make(engine) as r:
        src = rng.integers(0, 256, unit * cap, dtype=np.uint8)
        s.register(src)
        dst = r.allocate(unit * cap)
        peer = s.connect(r.endpoint())
        si, di = rng.choice(cap, n, replace=False), rng.choice(cap, n, replace=False)
        _send(s, peer, Plan(entries=(_pages(src, dst, unit, si, di),)))
        want = np.zeros_like(dst)
        want.reshape(cap, unit)[di] = src.reshape(cap, unit)[si]
        assert np.array_equal(dst, want)
        _send(s, peer, Plan(entries=(_pages(src, dst, unit, si[:3], di[:3]),)))


@pytest.mark.parametrize("engine", engines())
def test_repeated_plan_carries_current_bytes(engine: str) -> None:
    """NIXL re-posts the request of an identical plan; it must move today's bytes."""
    rng = np.random.default_rng(1)
    with make(engine) as s, make(engine) as r:
        src = np.zeros(64 << 10, np.uint8)
        s.register(src)
        dst = r.allocate(64 << 10)
        peer = s.connect(r.endpoint())
        p = Plan(entries=(_pages(src, dst, 4096, np.array([3, 1, 7]), np.array([0, 5, 2])),))
        for _ in range(3):
            src[:] = rng.integers(0, 256, len(src), dtype=np.uint8)
            _send(s, peer, p)
            for a, b in ((3, 0), (1, 5), (7, 2)):
                assert np.array_equal(dst[b * 4096:(b + 1) * 4096], src[a * 4096:(a + 1) * 4096])


@pytest.mark.parametrize("engine", engines())
def test_segments_never_straddle_adjacent_regions(engine: str) -> None:
    """Two tensors in two adjacent registered regions, contiguous on both sides: the
    plan would coalesce into one segment crossing the boundary; engines address one
    region per request, so it must be split there and still arrive intact."""
    rng = np.random.default_rng(2)
    half = 256 << 10
    with make(engine) as s, make(engine) as r:
        src = rng.integers(0, 256, 2 * half, dtype=np.uint8)
        dst_buf = np.zeros(2 * half, np.uint8)
        for t, a in ((s, src), (r, dst_buf)):
            base = int(a.ctypes.data)
            t.register([Region(ptr=base, nbytes=half), Region(ptr=base + half, nbytes=half)])
        peer = s.connect(r.endpoint())
        unit, per = 4096, half // 4096
        idx = np.arange(per)
        e0 = _pages(src[:half], dst_buf[:half], unit, idx, idx, 0)
        e1 = _pages(src[half:], dst_buf[half:], unit, idx, idx, 1)
        p = Plan(entries=(e0, e1))
        assert len(p.coalesce()) == 1  # what a naive engine adapter would send
        _send(s, peer, p)
        assert np.array_equal(dst_buf, src)


@pytest.mark.parametrize("engine", ENGINES)
def test_unavailable_reason_says_how_to_install(engine: str, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    mod = importlib.import_module(f"kvhandoff.transport.engines.{engine}")
    monkeypatch.setattr(importlib.util, "find_spec", lambda *a, **k: None)
    ok, reason = mod._probe()
    assert not ok
    assert "pip install" in reason
