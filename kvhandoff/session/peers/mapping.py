"""Which prefill ranks feed which decode ranks. Pure: no I/O, no clocks.

The planner decides bytes, and so it decides peers: a prefill rank is a **writer**
for a decode rank when :func:`~kvhandoff.plan.pair_layouts` gives any tensor pair a
non-empty piece list (its TP range intersects, or it is the elected replica). This
module never restates the shard or election rules; it asks the planner.

* Decode side, before any layout is known: :func:`bootstrap_peers` — the prefill
  ranks whose registrations a decode rank needs (PP stages it pairs with × every TP
  rank that could write for *some* group geometry the two TP sizes admit). A
  superset of the writers, from TP/PP sizes only.
* Decode side, with prefill layouts (tests, in-process use): :func:`peers_for` marks
  which candidates write; :func:`expected_responses` counts them. Over the wire the
  same bit arrives as ``HelloAck.writes``, computed by the prefill rank with
  :func:`writes`.
* Prefill side, per request: :func:`decode_ranks_for` / :func:`expected_inits` — the
  decode ranks of a given TP/PP size it writes into, i.e. how many ``TransferInit``
  messages to wait for (sglang's ``required_dst_info_num``). Computed from the
  prefill's own layout with :func:`peer_view`, because who writes depends only on
  what a compatible peer shares: shard groups, replication, elision and rank numbers.

Pipeline parallelism: decode PP 1 pairs with every prefill stage; equal PP pairs
stage k with stage k; anything else is refused (:func:`pp_stages`). Prefill DP
groups: a request is routed to one group; its ``dp_rank`` is an input here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from kvhandoff.errors import LayoutError, LayoutMismatch
from kvhandoff.layout import Layout, ShardSpec, TensorSpec
from kvhandoff.plan import pair_layouts
from kvhandoff.plan.shard import Side, pieces


class RankKey(NamedTuple):
    """A prefill rank's place in its deployment (the bootstrap table's key)."""

    dp_rank: int
    tp_rank: int
    pp_rank: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PrefillPeer:
    """A prefill rank a decode rank contacts; ``writes``: it moves bytes into it."""

    dp_rank: int
    tp_rank: int
    pp_rank: int
    writes: bool

    @property
    def key(self) -> RankKey:
        return RankKey(self.dp_rank, self.tp_rank, self.pp_rank)


Sources = Mapping[tuple[int, int], Layout] | Callable[[int, int], Layout]
"""Prefill layouts by ``(tp_rank, pp_rank)``: a mapping or a factory."""


# ---------------------------------------------------------------------------------------
# Pure, from sizes only


def pp_stages(*, src_pp_size: int, dst_pp_rank: int, dst_pp_size: int) -> tuple[int, ...]:
    """The prefill PP stages that feed decode stage ``dst_pp_rank``.

    Raises :class:`LayoutMismatch` unless decode PP is 1 or equals prefill's."""
    _check_rank("decode PP", dst_pp_rank, dst_pp_size)
    _check_pp(src_pp_size, dst_pp_size)
    return (dst_pp_rank,) if dst_pp_size == src_pp_size else tuple(range(src_pp_size))


def _check_pp(src_pp_size: int, dst_pp_size: int) -> None:
    if src_pp_size < 1:
        raise ValueError(f"prefill PP size must be >= 1, got {src_pp_size}")
    if dst_pp_size in (1, src_pp_size):
        return
    raise LayoutMismatch(
        f"PP: decode runs {dst_pp_size} pipeline stages and prefill {src_pp_size}; decode PP "
        f"must be 1 (every prefill stage feeds it) or equal to prefill's (stage k feeds stage k)"
    )


@functools.lru_cache(maxsize=1024)
def tp_candidates(*, src_tp_size: int, dst_tp_rank: int, dst_tp_size: int) -> tuple[int, ...]:
    """Every prefill TP rank that writes into decode rank ``dst_tp_rank`` for *some*
    tensor geometry the two TP sizes admit: replicated, or one sharded group of any
    length both sizes can split or replicate. A superset of the writers of any real
    layout pair (each real group is one of these), from the planner's own shard math."""
    _check_rank("decode TP", dst_tp_rank, dst_tp_size)
    if src_tp_size < 1:
        raise ValueError(f"prefill TP size must be >= 1, got {src_tp_size}")
    shards: list[ShardSpec | None] = [None]
    shards += [ShardSpec(outer=1, groups=(g,), inner_bytes=1)
               for g in _group_lengths(src_tp_size, dst_tp_size)]
    dst = [_side(s, dst_tp_rank, dst_tp_size) for s in shards]
    return tuple(
        p for p in range(src_tp_size)
        if any(len(pieces(_side(s, p, src_tp_size), d)) for s, d in zip(shards, dst, strict=True))
    )


def _group_lengths(a: int, b: int) -> list[int]:
    """Group lengths both TP sizes accept. Beyond ``lcm(a, b)`` every admissible length
    is a multiple of it and intersects the same way, so the search stops there."""
    def fits(g: int, tp: int) -> bool:
        return g % tp == 0 if tp <= g else tp % g == 0
    return [g for g in range(1, math.lcm(a, b) + 1) if fits(g, a) and fits(g, b)]


def _side(shard: ShardSpec | None, rank: int, size: int) -> Side:
    unit = 1 if shard is None else shard.local_item_bytes(rank, size)
    return Side(unit, shard, 1, rank, size)


def bootstrap_peers(
    *, dp_rank: int = 0, src_tp_size: int, src_pp_size: int,
    dst_tp_rank: int, dst_tp_size: int, dst_pp_rank: int, dst_pp_size: int,
) -> tuple[RankKey, ...]:
    """The prefill ranks (of DP group ``dp_rank``) a decode rank looks up and handshakes
    with: :func:`pp_stages` × :func:`tp_candidates`. Order: by PP stage, then TP rank."""
    tps = tp_candidates(src_tp_size=src_tp_size, dst_tp_rank=dst_tp_rank,
                        dst_tp_size=dst_tp_size)
    stages = pp_stages(src_pp_size=src_pp_size, dst_pp_rank=dst_pp_rank,
                       dst_pp_size=dst_pp_size)
    return tuple(RankKey(dp_rank, tp, pp) for pp in stages for tp in tps)


@functools.lru_cache(maxsize=256)  # asked per request, from a handful of deployments
def decode_candidates(*, src_tp_rank: int, src_tp_size: int, src_pp_rank: int,
                      src_pp_size: int, dst_tp_size: int, dst_pp_size: int
                      ) -> tuple[tuple[int, int], ...]:
    """The decode ranks ``(tp_rank, pp_rank)`` whose :func:`bootstrap_peers` include this
    prefill rank: the mirror image of that function, from sizes only. These are the
    decode ranks that send this prefill rank a ``TransferInit`` per request (writer or
    not), so it is how many a prefill rank waits for. Raises :class:`LayoutMismatch`
    for an unsupported PP pair."""
    _check_rank("prefill TP", src_tp_rank, src_tp_size)
    _check_rank("prefill PP", src_pp_rank, src_pp_size)
    _check_pp(src_pp_size, dst_pp_size)
    out = []
    for dpp in range(dst_pp_size):
        if src_pp_rank not in pp_stages(src_pp_size=src_pp_size, dst_pp_rank=dpp,
                                        dst_pp_size=dst_pp_size):
            continue
        out += [(d, dpp) for d in range(dst_tp_size)
                if src_tp_rank in tp_candidates(src_tp_size=src_tp_size, dst_tp_rank=d,
                                                dst_tp_size=dst_tp_size)]
    return tuple(out)


# ---------------------------------------------------------------------------------------
# From the planner


def writes(src: Layout, dst: Layout) -> bool:
    """Whether prefill rank ``src`` moves any byte into decode rank ``dst`` (for a request
    that sends every component). Raises :class:`LayoutMismatch` if they cannot pair."""
    pair = pair_layouts(src, dst)
    return any(len(tp.item_pieces) for comp in pair.components for tp in comp.tensors)


def peers_for(dst: Layout, sources: Sources, *, src_tp_size: int, src_pp_size: int,
              dp_rank: int = 0) -> tuple[PrefillPeer, ...]:
    """The :func:`bootstrap_peers` of decode rank ``dst``, each marked with whether the
    planner has it write. ``sources`` gives each candidate's layout (checked to sit at
    the rank it is filed under)."""
    get = (lambda tp, pp: sources[(tp, pp)]) if isinstance(sources, Mapping) else sources
    out = []
    for key in bootstrap_peers(
        dp_rank=dp_rank, src_tp_size=src_tp_size, src_pp_size=src_pp_size,
        dst_tp_rank=dst.tp_rank, dst_tp_size=dst.tp_size,
        dst_pp_rank=dst.pp_rank, dst_pp_size=dst.pp_size,
    ):
        src = get(key.tp_rank, key.pp_rank)
        where = (src.tp_rank, src.tp_size, src.pp_rank, src.pp_size)
        if where != (key.tp_rank, src_tp_size, key.pp_rank, src_pp_size):
            raise ValueError(
                f"the layout given for prefill tp {key.tp_rank}/{src_tp_size} pp "
                f"{key.pp_rank}/{src_pp_size} is tp {where[0]}/{where[1]} pp {where[2]}/{where[3]}"
            )
        out.append(PrefillPeer(dp_rank=dp_rank, tp_rank=key.tp_rank, pp_rank=key.pp_rank,
                               writes=writes(src, dst)))
    return tuple(out)


def expected_responses(peers: Iterable[PrefillPeer]) -> int:
    """How many prefill ranks must report their last chunk before a decode rank may
    succeed: the writers (sglang's ``required_prefill_response_num``)."""
    return sum(p.writes for p in peers)


@functools.lru_cache(maxsize=64)
def decode_ranks_for(src: Layout, *, dst_tp_size: int, dst_pp_size: int
                     ) -> tuple[tuple[int, int], ...]:
    """The decode ranks ``(tp_rank, pp_rank)`` of a decode deployment with the given TP
    and PP sizes that prefill rank ``src`` writes into.

    Raises :class:`LayoutMismatch` for an unsupported PP pair and
    :class:`~kvhandoff.errors.LayoutError` for a TP size the model's groups cannot split."""
    _check_pp(src.pp_size, dst_pp_size)
    pp_rank = 0 if dst_pp_size == 1 else src.pp_rank
    return tuple(
        (d, pp_rank) for d in range(dst_tp_size)
        if writes(src, peer_view(src, tp_rank=d, tp_size=dst_tp_size, pp_rank=pp_rank,
                                 pp_size=dst_pp_size))
    )


def expected_inits(src: Layout, *, dst_tp_size: int, dst_pp_size: int) -> int:
    """How many decode ranks send prefill rank ``src`` a ``TransferInit`` per request
    (sglang's ``required_dst_info_num``). Zero: this rank moves nothing for such a
    decode deployment and may report success at once."""
    return len(decode_ranks_for(src, dst_tp_size=dst_tp_size, dst_pp_size=dst_pp_size))


def peer_view(layout: Layout, *, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int
              ) -> Layout:
    """The layout a rank of the same model would register at the given TP/PP place, as
    far as *who writes* is concerned: same components, tensors and shard specs, each
    tensor one item at address 0. Not a real peer's layout (its page size, capacities
    and addresses are unknown); only for asking the planner whether a pair writes."""
    where = f"{layout.model + ': ' if layout.model else ''}component"
    comps = tuple(
        dataclasses.replace(c, tensors=tuple(
            _one_item(t, tp_rank, tp_size, f"{where} {c.name!r}") for t in c.tensors))
        for c in layout.components
    )
    return dataclasses.replace(layout, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                               pp_size=pp_size, components=comps, regions=())


def _one_item(t: TensorSpec, tp_rank: int, tp_size: int, where: str) -> TensorSpec:
    item = t.item_bytes
    if t.shard is not None and not t.elided:
        try:
            item = t.shard.local_item_bytes(tp_rank, tp_size)
        except LayoutError as e:
            raise LayoutError(f"{where} tensor {t.name!r} (layer {t.layer_id}) at the peer's "
                              f"TP rank {tp_rank} of {tp_size}: {e}") from None
    # one packed item: a peer's padding (its stride) is unknown and may be smaller than
    # this item at another TP size
    return dataclasses.replace(t, ptr=0, nbytes=item, item_bytes=item, stride=0)


def _check_rank(what: str, rank: int, size: int) -> None:
    if not 0 <= rank < size:
        raise ValueError(f"{what} rank {rank} is outside size {size}")
