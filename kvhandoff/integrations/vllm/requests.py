"""Which blocks of a vLLM request move, and what travels between the connector's halves.

Pure: block-id arithmetic over plain lists, and the records the scheduler hands its
workers each step (:class:`StepMeta`). Both sides pick blocks by *token range*, so a
prefill and a decode block list pair one for one:

* full attention / MLA: the blocks of tokens ``[decode_prefix, num_tokens)`` (prefill
  hands pages from token 0; the session drops those below decode's prefix);
* sliding window: the blocks of ``[num_tokens - window, num_tokens)``, floored to a block;
* Mamba / linear attention: the one block holding the running state (vLLM may append
  speculative scratch blocks after it; they do not move).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvhandoff.indices import token_pages
from kvhandoff.integrations.vllm.layout import GroupInfo


@dataclass(frozen=True, slots=True)
class GroupRule:
    """How one transferable group picks a request's blocks."""

    kind: str
    block_size: int
    window: int = 0  # sliding: tokens
    spec_blocks: int = 0  # mamba: trailing speculative scratch blocks


def rules_for(groups: Sequence[GroupInfo], windows: Sequence[int],
              spec_blocks: Sequence[int]) -> tuple[GroupRule, ...]:
    return tuple(GroupRule(g.kind, g.block_size, w, s)
                 for g, w, s in zip(groups, windows, spec_blocks, strict=True))


def pick(rule: GroupRule, blocks: Sequence[int], *, start: int, end: int) -> list[int]:
    """The blocks of tokens ``[start, end)`` that move for this group (``start`` is a
    multiple of the block size: a prefix hit)."""
    if rule.kind == "mamba":
        if not blocks:
            raise ValueError("a Mamba group holds no block for this request")
        keep = len(blocks) - min(rule.spec_blocks, len(blocks) - 1)
        return [int(blocks[keep - 1])]
    span = token_pages(start, end, rule.block_size,
                       window=rule.window if rule.kind == "sliding" else 0)
    if span.stop > len(blocks):
        raise ValueError(f"{rule.kind} group: tokens [{start}, {end}) need blocks "
                         f"{span.start}..{span.stop - 1} but the request holds {len(blocks)}")
    return [int(b) for b in blocks[span.start:span.stop]]


def prompt_digest(token_ids: Sequence[int], n: int) -> str:
    """A digest of the first ``n`` prompt tokens: decode loads prefill's state only for
    the very tokens prefill computed."""
    h = hashlib.blake2b(digest_size=12)
    h.update(n.to_bytes(8, "little"))
    for t in token_ids[:n]:
        h.update(int(t).to_bytes(8, "little", signed=True))
    return h.hexdigest()


def backoff(*, has_mamba: bool, lookahead: int = 0) -> int:
    """Trailing prompt tokens prefill leaves for decode to compute: a recurrent state
    must stop one token short, so decode's own step over the last token yields the same
    state a colocated run holds."""
    return max(1 if has_mamba else 0, lookahead - 1)


@dataclass(frozen=True, slots=True)
class SendReq:
    """Prefill worker: hand this finished request's blocks to decode."""

    request_id: str
    blocks: tuple[tuple[int, ...], ...]  # per transferable group, from token 0
    num_tokens: int
    key: str = ""  # the request's key (kvhandoff.binding), hex; "": none


@dataclass(frozen=True, slots=True)
class RecvReq:
    """Decode worker: receive a request into these blocks."""

    request_id: str  # decode's vLLM id (what get_finished reports)
    remote_id: str  # the kvhandoff request id: prefill's vLLM id
    bootstrap: str
    instance: str
    blocks: tuple[tuple[int, ...], ...]  # per transferable group, the moving blocks
    prefix_tokens: int  # tokens decode already holds (a local prefix hit)
    num_tokens: int
    key: str = ""  # the request's key (kvhandoff.binding), hex, as prefill made it


@dataclass(slots=True)
class StepMeta:
    """What the scheduler tells its workers for one step."""

    sends: list[SendReq] = field(default_factory=list)
    recvs: list[RecvReq] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # decode ids whose receive must stop
