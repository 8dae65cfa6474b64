"""A request's kvhandoff status, as each engine must hear it: one table.

An engine frees a request's memory when it hears the handoff is over, so "over" must
mean that no write touches that memory any more, not merely that the status is final:

* prefill's source pages are still read until the Sender is **settled** (every write of
  the request acknowledged or given up);
* decode's destination pages may still be written after a failure until the Receiver is
  **released** (each prefill rank confirmed no write of the request is in flight, or the
  release timeout passed); a success means every write landed.

So the table is keyed by the status and whether the side is *quiet* (:func:`quiet`), and
gives the :class:`Outcome`, SGLang's ``KVPoll`` value (a final status that is not quiet
yet is held as ``Transferring``, so the scheduler keeps the pages) and the set vLLM's
``get_finished`` reports the request in, per role. Pure.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvhandoff.session.request.receiver import Receiver
from kvhandoff.session.request.sender import Sender
from kvhandoff.session.request.status import Status

__all__ = ["KVPOLL", "OUTCOMES", "Outcome", "Row", "kvpoll", "outcome", "quiet"]


class Outcome(enum.StrEnum):
    """What an engine may do with a request's memory."""

    PENDING = "pending"  # keep it: the handoff goes on, or its writes may still touch it
    SUCCEEDED = "succeeded"  # every byte moved; free (prefill) or use (decode) it
    FAILED = "failed"  # the handoff failed and nothing touches the memory any more


KVPOLL = {"Failed": 0, "Bootstrapping": 1, "WaitingForInput": 2, "Transferring": 3,
          "Success": 4}
"""SGLang's ``KVPoll`` values (``sglang.srt.disaggregation.base.conn.KVPoll``)."""


@dataclass(frozen=True, slots=True)
class Row:
    outcome: Outcome
    kvpoll: int  # SGLang's KVPoll
    vllm_prefill: str  # vLLM's get_finished set on prefill ("" while pending)
    vllm_decode: str  # and on decode


_P, _S, _F = Outcome.PENDING, Outcome.SUCCEEDED, Outcome.FAILED
OUTCOMES: dict[tuple[Status, bool], Row] = {
    # (status, quiet): outcome, KVPoll, vLLM prefill set, vLLM decode set
    (Status.BOOTSTRAPPING, False): Row(_P, KVPOLL["Bootstrapping"], "", ""),
    (Status.BOOTSTRAPPING, True): Row(_P, KVPOLL["Bootstrapping"], "", ""),
    (Status.WAITING_FOR_INPUT, False): Row(_P, KVPOLL["WaitingForInput"], "", ""),
    (Status.WAITING_FOR_INPUT, True): Row(_P, KVPOLL["WaitingForInput"], "", ""),
    (Status.TRANSFERRING, False): Row(_P, KVPOLL["Transferring"], "", ""),
    (Status.TRANSFERRING, True): Row(_P, KVPOLL["Transferring"], "", ""),
    (Status.SUCCESS, False): Row(_P, KVPOLL["Transferring"], "", ""),  # prefill: settling
    (Status.SUCCESS, True): Row(_S, KVPOLL["Success"], "finished_sending",
                                "finished_recving"),
    (Status.FAILED, False): Row(_P, KVPOLL["Transferring"], "", ""),  # held: late writes
    (Status.FAILED, True): Row(_F, KVPOLL["Failed"], "finished_sending", "failed_recving"),
}
"""Every (status, quiet) pair: the one place a kvhandoff status becomes an engine's."""


def quiet(side: Sender | Receiver) -> bool:
    """No write of the request touches this side's memory any more: a Sender settled;
    a Receiver that succeeded, or failed and released."""
    if isinstance(side, Sender):
        return side.settled
    return side.status is Status.SUCCESS or side.released


def outcome(side: Sender | Receiver) -> Row:
    """The table's row for ``side`` now (its status read before its quiet, so a side
    that finishes in between reads as pending, never as quiet too early)."""
    status = side.status
    return OUTCOMES[(status, quiet(side))]


def kvpoll(side: Sender | Receiver) -> int:
    """SGLang's ``KVPoll`` for ``side`` now."""
    return outcome(side).kvpoll
