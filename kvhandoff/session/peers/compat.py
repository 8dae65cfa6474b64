"""Handshake compatibility: every reason a (prefill rank, decode rank) pair cannot work.

Pure. The prefill rank runs :func:`handshake_report` on each ``Hello`` and answers
``HelloReject(problems=...)`` when the list is not empty, so an incompatible pair
fails at start-up with every problem named, never mid-request. Problem strings
follow the planner's: what (component, tensor, layer), each side's value, what to do.
"""

from __future__ import annotations

from collections.abc import Collection

from kvhandoff.errors import LayoutMismatch
from kvhandoff.layout import Layout, MemoryKind
from kvhandoff.plan import pair_layouts
from kvhandoff.protocol import (
    PROTOCOL_VERSION,
    Hello,
    HelloAck,
    HelloReject,
    ProtocolError,
    RankId,
    layout_from_msg,
)
from kvhandoff.session.peers.mapping import pp_stages, writes


def handshake_report(
    prefill_layout: Layout,
    decode_layout: Layout,
    *,
    prefill_transport: str,
    decode_transport: str,
    protocol_version: int,
    memory_kinds: Collection[MemoryKind] | None = None,
) -> list[str]:
    """Every problem that stops ``prefill_layout`` feeding ``decode_layout``; empty = accept.

    ``protocol_version`` is the decode side's (from its Hello); ``memory_kinds`` the
    memory the transport can move (``transport.capabilities.memory``; None skips that
    check). Checks, in order: protocol version, transport name, memory kinds, PP
    topology (decode PP 1, or equal PP with the same stage and layer split), then
    everything :func:`~kvhandoff.plan.pair_layouts` reports. Layout pairing is skipped
    when the PP topology is wrong: its per-tensor complaints would only restate that.
    """
    problems: list[str] = []
    if protocol_version != PROTOCOL_VERSION:
        problems.append(
            f"protocol: decode speaks control protocol version {protocol_version}, prefill "
            f"{PROTOCOL_VERSION}; run the same kvhandoff release on both sides"
        )
    if prefill_transport != decode_transport:
        problems.append(
            f"transport: prefill uses {prefill_transport!r}, decode uses {decode_transport!r}; "
            f"start both sides with the same transport"
        )
    if memory_kinds is not None:
        problems += _memory("prefill", prefill_layout, prefill_transport, memory_kinds)
        problems += _memory("decode", decode_layout, decode_transport, memory_kinds)
    problems += identity_problems(prefill_layout, decode_layout)
    topology = _pp(prefill_layout, decode_layout)
    problems += topology
    if not topology:
        try:
            pair_layouts(prefill_layout, decode_layout)
        except LayoutMismatch as e:
            problems += e.problems
    return problems


def identity_problems(prefill: Layout, decode: Layout) -> list[str]:
    """One problem per identity field the two layouts disagree on (a field only one side
    states counts: ``<unset>`` on the other)."""
    p, d = dict(prefill.identity), dict(decode.identity)
    return [
        f"{k}: prefill has {p.get(k, '<unset>')!r}, decode has {d.get(k, '<unset>')!r}; "
        f"both sides must run the same {k}"
        for k in sorted(p.keys() | d.keys()) if p.get(k) != d.get(k)
    ]


def _memory(side: str, layout: Layout, transport: str, kinds: Collection[MemoryKind]
            ) -> list[str]:
    out = []
    can = "/".join(sorted(k.value for k in kinds)) or "no"
    for c in layout.components:
        for mem in sorted({t.memory for t in c.tensors if t.nbytes} - set(kinds)):
            bad = [t for t in c.tensors if t.nbytes and t.memory is mem]
            out.append(
                f"component {c.name!r}: {len(bad)} {side} tensor(s) live in {mem.value} memory "
                f"(first: {bad[0].name!r} layer {bad[0].layer_id}) but transport {transport!r} "
                f"moves only {can} memory; pick a transport that supports {mem.value}"
            )
    return out


def _pp(src: Layout, dst: Layout) -> list[str]:
    try:
        stages = pp_stages(src_pp_size=src.pp_size, dst_pp_rank=dst.pp_rank,
                           dst_pp_size=dst.pp_size)
    except LayoutMismatch as e:
        return e.problems
    if src.pp_rank not in stages:
        return [
            f"PP: decode stage {dst.pp_rank} handshook prefill stage {src.pp_rank}; with equal "
            f"PP ({src.pp_size}) stage k pairs only with stage k"
        ]
    (lo, hi), (dlo, dhi) = src.layers, dst.layers
    if dst.pp_size > 1 and src.layers != dst.layers:
        return [
            f"PP stage {src.pp_rank}: prefill owns layers {lo}..{hi}, decode {dlo}..{dhi}; with "
            f"equal PP both sides must split the layers the same way"
        ]
    if src.pp_size > 1 and not dlo <= lo <= hi <= dhi:
        return [
            f"PP: prefill stage {src.pp_rank} sends layers {lo}..{hi} but decode (PP 1) owns "
            f"only layers {dlo}..{dhi}"
        ]
    return []


def answer_hello(
    hello: Hello,
    *,
    layout: Layout,
    transport: str,
    rank: RankId,
    memory_kinds: Collection[MemoryKind] | None = None,
) -> tuple[HelloAck | HelloReject, Layout | None]:
    """The prefill rank's reply to ``hello``, given its own ``layout``, ``transport``
    name and ``rank``, and the peer's layout once decoded (None when it does not: the
    reply then says why). Pure: decoding the peer's layout, then :func:`check_hello`."""
    try:
        peer = layout_from_msg(hello.layout)
    except ProtocolError as e:
        return HelloReject(protocol_version=PROTOCOL_VERSION, rank=rank,
                           problems=(str(e),)), None
    return check_hello(hello, peer, layout=layout, transport=transport, rank=rank,
                       memory_kinds=memory_kinds), peer


def check_hello(
    hello: Hello,
    peer: Layout,
    *,
    layout: Layout,
    transport: str,
    rank: RankId,
    memory_kinds: Collection[MemoryKind] | None = None,
) -> HelloAck | HelloReject:
    """:func:`answer_hello` with the peer's layout already decoded (``peer``, from
    ``hello.layout``): checking the pair, and asking the planner whether this rank
    writes into that decode rank. A caller that keeps ``peer`` then plans with the very
    object the planner's pair cache was filled with here."""
    problems = []
    said = (hello.rank.tp_rank, hello.rank.tp_size, hello.rank.pp_rank, hello.rank.pp_size)
    has = (peer.tp_rank, peer.tp_size, peer.pp_rank, peer.pp_size)
    if said != has:
        problems.append(
            f"decode rank {hello.rank} sent a layout of tp {has[0]}/{has[1]} pp {has[2]}/{has[3]}"
        )
    problems += handshake_report(
        layout, peer, prefill_transport=transport, decode_transport=hello.transport,
        protocol_version=hello.protocol_version, memory_kinds=memory_kinds,
    )
    if problems:
        return HelloReject(protocol_version=PROTOCOL_VERSION, rank=rank, problems=tuple(problems))
    return HelloAck(protocol_version=PROTOCOL_VERSION, rank=rank,
                    layout_signature=layout.signature, writes=writes(layout, peer))
