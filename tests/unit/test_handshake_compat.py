"""Handshake compatibility: compatible real shapes produce no problem; each kind of
incompatibility produces a specific, actionable one; the Hello reply follows."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import msgspec
import pytest

from kvhandoff.lab import shapes
from kvhandoff.layout import Layout, MemoryKind
from kvhandoff.protocol import (
    PROTOCOL_VERSION,
    Hello,
    HelloAck,
    HelloReject,
    RankId,
    decode_message,
    encode_message,
    layout_to_msg,
)
from kvhandoff.session.peers.compat import answer_hello, handshake_report
from kvhandoff.session.peers.mapping import writes

QWEN = shapes.tiny(shapes.get("qwen3_next"))


def lay(shape: shapes.ModelShape = QWEN, *, tp_rank: int = 0, tp_size: int = 1,
        pp_rank: int = 0, pp_size: int = 1) -> Layout:
    return shapes.layout_for(
        shape, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
        page_size=128 if "v4" in shape.name else 4, num_pages=8, num_slots=4,
    )


def report(src: Layout, dst: Layout, *, prefill_transport: str = "tcp",
           decode_transport: str = "tcp", protocol_version: int = PROTOCOL_VERSION,
           memory_kinds: set[MemoryKind] | None = None) -> list[str]:
    return handshake_report(src, dst, prefill_transport=prefill_transport,
                            decode_transport=decode_transport,
                            protocol_version=protocol_version, memory_kinds=memory_kinds)


@pytest.mark.parametrize("name", sorted(shapes.SHAPES))
def test_compatible_shapes_report_nothing(name: str) -> None:
    sh = shapes.tiny(shapes.get(name))
    for (tp, td), (pp, pd) in itertools.product([(1, 1), (2, 1), (1, 2), (2, 4), (8, 2)],
                                                [(1, 1), (2, 1), (2, 2)]):
        for p, t, d in itertools.product(range(pp), range(tp), range(td)):
            src = lay(sh, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp)
            dst = lay(sh, tp_rank=d, tp_size=td, pp_rank=p if pd > 1 else 0, pp_size=pd)
            assert report(src, dst, memory_kinds={MemoryKind.HOST}) == []


def test_a_different_conv_state_names_tensor_layer_and_item_sizes() -> None:
    problems = report(lay(), lay(replace(QWEN, conv_kernel=3)))
    assert len(problems) == 3  # one per GDN layer
    assert problems[0].startswith("component 'mamba' tensor 'conv' layer 0: ")
    assert "prefill item 768 B vs decode item 512 B with TP 1 → 1" in problems[0]


def test_a_different_kv_dtype_is_named() -> None:
    problems = report(lay(), lay(replace(QWEN, kv_dtype_bytes=1)))
    assert problems == [f"component 'kv' tensor '{t}' layer 3: dtype bf16 on prefill vs fp8 on "
                        f"decode" for t in "kv"]


def test_a_different_model_lists_the_missing_components() -> None:
    problems = report(lay(), lay(shapes.tiny(shapes.get("llama"))))
    assert "component 'mamba' (mamba) exists on prefill only" in problems


def test_protocol_and_transport_mismatches() -> None:
    problems = report(lay(), lay(), decode_transport="mooncake",
                      protocol_version=PROTOCOL_VERSION + 1)
    assert problems == [
        f"protocol: decode speaks control protocol version {PROTOCOL_VERSION + 1}, prefill "
        f"{PROTOCOL_VERSION}; run the same kvhandoff release on both sides",
        "transport: prefill uses 'tcp', decode uses 'mooncake'; start both sides with the "
        "same transport",
    ]


def test_pp_topologies_that_cannot_pair() -> None:
    p4 = lay(pp_rank=0, pp_size=4)
    assert report(p4, lay(pp_rank=0, pp_size=2)) == [
        "PP: decode runs 2 pipeline stages and prefill 4; decode PP must be 1 (every prefill "
        "stage feeds it) or equal to prefill's (stage k feeds stage k)"]
    p2 = lay(pp_rank=0, pp_size=2)
    assert report(p2, lay(pp_rank=1, pp_size=2)) == [
        "PP: decode stage 1 handshook prefill stage 0; with equal PP (2) stage k pairs only "
        "with stage k"]
    assert report(p2, replace(p2, layers=(0, 3))) == [
        "PP stage 0: prefill owns layers 0..2, decode 0..3; with equal PP both sides must "
        "split the layers the same way"]
    short = replace(lay(), layers=(0, 3), components=p2.components, regions=())
    assert report(lay(pp_rank=1, pp_size=2), short) == [
        "PP: prefill stage 1 sends layers 2..4 but decode (PP 1) owns only layers 0..3"]


def test_memory_the_transport_cannot_move() -> None:
    def on_cuda(layout: Layout) -> Layout:
        comps = tuple(replace(c, tensors=tuple(replace(t, memory=MemoryKind.CUDA)
                                               for t in c.tensors))
                      for c in layout.components if c.name == "kv")
        rest = tuple(c for c in layout.components if c.name != "kv")
        return replace(layout, components=comps + rest, regions=())
    dst = on_cuda(lay())
    problems = report(lay(), dst, memory_kinds={MemoryKind.HOST})
    assert problems == [
        "component 'kv': 2 decode tensor(s) live in cuda memory (first: 'k' layer 3) but "
        "transport 'tcp' moves only host memory; pick a transport that supports cuda"]
    assert report(lay(), dst) == []  # memory not checked when not given
    assert report(lay(), dst, memory_kinds={MemoryKind.HOST, MemoryKind.CUDA}) == []


# ---------------------------------------------------------------------------------------
# The reply to a Hello


PREFILL = RankId(instance="prefill", tp_rank=1, tp_size=2)


def hello(layout: Layout, **kw: object) -> Hello:
    msg = Hello(protocol_version=PROTOCOL_VERSION,
                rank=RankId(instance="decode", tp_rank=layout.tp_rank, tp_size=layout.tp_size,
                            pp_rank=layout.pp_rank, pp_size=layout.pp_size),
                layout=layout_to_msg(layout), transport="tcp", transport_endpoint=b"ep",
                control_endpoint="tcp://127.0.0.1:1")
    # through the wire, as a prefill rank receives it
    out = decode_message(encode_message(msg))
    assert isinstance(out, Hello)
    return msgspec.structs.replace(out, **kw)


@pytest.mark.parametrize("d", range(4))
def test_a_compatible_hello_is_acked_with_the_planner_writes_bit(d: int) -> None:
    mine, theirs = lay(tp_rank=1, tp_size=2), lay(tp_rank=d, tp_size=4)
    reply, _ = answer_hello(hello(theirs), layout=mine, transport="tcp", rank=PREFILL)
    assert isinstance(reply, HelloAck)
    assert reply.writes is writes(mine, theirs)
    assert reply.writes is (d >= 2)  # decode d reads its head and aux from prefill d // 2
    assert (reply.rank, reply.layout_signature) == (PREFILL, mine.signature)


def test_an_incompatible_hello_is_rejected_with_every_problem() -> None:
    reply, _ = answer_hello(hello(lay(replace(QWEN, conv_kernel=3)), transport="nixl"),
                         layout=lay(), transport="tcp", rank=PREFILL)
    assert isinstance(reply, HelloReject)
    assert reply.problems[0].startswith("transport: prefill uses 'tcp', decode uses 'nixl'")
    assert len(reply.problems) == 4


def test_a_hello_whose_layout_does_not_rebuild_is_rejected() -> None:
    h = hello(lay())
    bad = msgspec.structs.replace(h, layout=msgspec.structs.replace(h.layout, signature="x"))
    reply, _ = answer_hello(bad, layout=lay(), transport="tcp", rank=PREFILL)
    assert isinstance(reply, HelloReject)
    assert "signature" in reply.problems[0]


def test_a_hello_whose_rank_disagrees_with_its_layout_is_rejected() -> None:
    h = hello(lay(tp_rank=1, tp_size=2), rank=RankId(instance="decode", tp_rank=0, tp_size=2))
    reply, _ = answer_hello(h, layout=lay(), transport="tcp", rank=PREFILL)
    assert isinstance(reply, HelloReject)
    assert reply.problems == ("decode rank decode dp0 tp0/2 pp0/1 sent a layout of tp 1/2 "
                              "pp 0/1",)


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v4"])
def test_a_different_sliding_window_is_named(name: str) -> None:
    """The window decides which pages each side's SWA list names, yet not one tensor's
    geometry: a pair whose windows differ would pair the wrong pages mid-request (the
    SWA lists trim to their common prefix), so the handshake refuses it, naming both."""
    sh = shapes.tiny(shapes.get(name))
    assert report(lay(sh), lay(replace(sh, sliding_window=sh.sliding_window))) == []
    problems = report(lay(sh), lay(replace(sh, sliding_window=2 * sh.sliding_window)))
    assert problems == [f"sliding_window: prefill has '{sh.sliding_window}', decode has "
                        f"'{2 * sh.sliding_window}'; both sides must run the same "
                        f"sliding_window"]


def test_all_sliding_window_layers_pair_without_a_kv_component() -> None:
    """Every layer sliding-window (Mistral-7B-v0.1): the layout holds window pages and no
    full KV component, on both sides alike, at every TP pair."""
    sh = shapes.ModelShape(name="all_swa", layers=(shapes.LayerKind.SWA,) * 4, kv_heads=2,
                           head_dim=8, sliding_window=8, aux_row_bytes=64)
    assert [c.name for c in lay(sh).components] == ["swa", "aux"]
    for tp, td in [(1, 1), (2, 1), (1, 2), (2, 4)]:
        for t, d in itertools.product(range(tp), range(td)):
            assert report(lay(sh, tp_rank=t, tp_size=tp), lay(sh, tp_rank=d, tp_size=td)) == []


class _Dialed:
    closed = False

    def close(self) -> None:
        self.closed = True


def test_an_accepted_rank_keeps_the_layout_its_hello_was_checked_with(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode layout a Hello carries is decoded once: the object the pair was checked
    with (filling the planner's pair cache) is the one the session plans every request
    with, so no plan compares two equal layouts field by field."""
    from types import SimpleNamespace

    import kvhandoff.session.peers.compat as compat_mod
    import kvhandoff.session.peers.decode_ranks as peers_mod

    checked: list[Layout] = []
    check = compat_mod.check_hello

    def spy(h: Hello, peer: Layout, **kw: Any) -> HelloAck | HelloReject:
        checked.append(peer)
        return check(h, peer, **kw)

    monkeypatch.setattr(compat_mod, "check_hello", spy)
    mine, theirs = lay(tp_rank=1, tp_size=2), lay(tp_rank=1, tp_size=2)
    dialed = _Dialed()
    transport = SimpleNamespace(name="tcp", capabilities=SimpleNamespace(memory=None),
                                connect=lambda endpoint: dialed)
    sent: list[tuple[str, object]] = []
    table = peers_mod.DecodePeers(layout=mine, transport=transport,  # type: ignore[arg-type]
                                  rank=PREFILL, send=lambda ep, m: sent.append((ep, m)))
    try:
        h = hello(theirs)
        table.answer(h.control_endpoint, h)
        assert [type(m) for _, m in sent] == [HelloAck]
        kept = table.get(h.control_endpoint)
        assert kept is not None and kept.transport_peer is dialed
        assert kept.layout == theirs and len(checked) == 1 and kept.layout is checked[0]
    finally:
        table.close()
