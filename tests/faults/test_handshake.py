"""Incompatible pairs fail at handshake, with every problem named; nothing stays live."""

from __future__ import annotations

import dataclasses

import pytest

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab import shapes
from kvhandoff.lab.testing.handoff import DECODE, Arena, Topology, layout_of
from kvhandoff.lab.testing.rig import Rig, config
from kvhandoff.layout import Layout
from kvhandoff.session import Agent, HandshakeError, Receiver, Status
from kvhandoff.transport import create_transport


def _decode_layout(shape: shapes.ModelShape, arena: Arena) -> Layout:
    return shapes.layout_for(shape, tp_rank=0, tp_size=1, page_size=4, num_pages=64,
                             num_slots=8, alloc=arena)


@pytest.mark.parametrize("change", ["head_dim", "other_model"])
def test_incompatible_layouts_are_rejected_at_handshake(bootstrap: BootstrapServer,
                                                        instance: str, change: str) -> None:
    base = shapes.tiny(shapes.get("qwen3_next"))
    other = (dataclasses.replace(base, head_dim=base.head_dim * 2) if change == "head_dim"
             else shapes.tiny(shapes.get("gpt_oss")))
    dst = _decode_layout(other, Arena((9, DECODE, 0, 0, 0)))
    rig = Rig(bootstrap.url, instance, decode_layout=dst)
    try:
        r = rig.receiver(rig.plan(1), init=False)
        assert r.wait(10) is Status.FAILED
        assert isinstance(r.error, HandshakeError)
        assert r.error.problems and all("prefill" in p for p in r.error.problems)
        text = str(r.error)
        assert ("tensor 'k'" in text) if change == "head_dim" else ("'swa'" in text)
        assert r.released and rig.decode.live_requests == 0
        assert rig.prefill.stats["decode_peers"] == 0
    finally:
        rig.close()


def test_transport_mismatch_is_rejected(bootstrap: BootstrapServer, instance: str) -> None:
    topo = Topology(shape="qwen3_next", num_pages=64)
    rig = Rig(bootstrap.url, instance)
    try:
        dst = layout_of(topo, DECODE, 0, 0, Arena((1, DECODE, 0, 0, 0)))
        with Agent.decode(dst, config=config(instance),
                          transport=create_transport("memory")) as d:
            r = Receiver(d, bootstrap.url, 1)
            assert r.wait(10) is Status.FAILED
            assert "transport: prefill uses 'tcp', decode uses 'memory'" in (r.reason or "")
    finally:
        rig.close()


def test_a_rejected_pair_is_retried_for_the_next_request(rig: Rig) -> None:
    """A failed group is not cached: a later request handshakes afresh (and here works)."""
    rig.handoff(rig.plan(1))
    rig.handoff(rig.plan(2, block=1))
