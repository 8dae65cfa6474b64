"""What a prefill rank answers a decode rank itself, when no Sender of the request does.

Three answers, each one message or two, built and sent the same way wherever the
:class:`~kvhandoff.session.rank.prefill_desk.PrefillDesk` needs them:

* indices from an endpoint that is not a handshaken decode rank, or that handshook as
  another rank (:func:`unknown_peer`): an ``ErrorReply`` with ``UNKNOWN_PEER``, which
  tells it to handshake again;
* a request that failed here (:func:`tell_failed`): its last ``TransferStatus``,
  ``FAILED`` with the reason, then an ``AbortAck`` when no write to that rank is in
  flight;
* an abort with nothing of ours in flight to its sender (:func:`ack_abort`): an
  ``AbortAck``.

Only a handshaken decode rank is ever dialed: an answer to anyone else goes back on
the connection it came from.
"""

from __future__ import annotations

from kvhandoff.protocol import (
    AbortAck,
    ErrorCode,
    ErrorReply,
    RequestId,
    TransferInit,
)
from kvhandoff.session.control.channel import ControlChannel, Origin
from kvhandoff.session.peers.decode_ranks import DecodePeer, DecodePeers
from kvhandoff.session.request.host import RankHost
from kvhandoff.session.request.send_core import failed_answer


def unknown_peer(origin: Origin, msg: TransferInit, peer: DecodePeer | None) -> ErrorReply:
    """The answer to indices ``msg`` from ``origin``: no handshaken decode rank
    (``peer`` None), or one that handshook as another rank (``peer``)."""
    why = "no accepted Hello from it" if peer is None else \
        f"it handshook as {peer.rank}, not {msg.rank}"
    return ErrorReply(reason=f"unknown decode peer {origin} ({why}); handshake again",
                      request_id=msg.request_id, code=ErrorCode.UNKNOWN_PEER)


def tell_failed(host: RankHost, endpoint: str, rid: RequestId, reason: str, *,
                ack: bool) -> None:
    """Tell a decode rank ``rid`` failed here; ``ack``: and that no write to it is in
    flight (an ``AbortAck``). The same answer a Sender gives (:func:`failed_answer`)."""
    for msg in failed_answer(rid, host.rank_id, reason, ack=ack):
        host.post(endpoint, msg)


def ack_abort(host: RankHost, control: ControlChannel, peers: DecodePeers, origin: Origin,
              rid: RequestId) -> None:
    """Acknowledge an abort of ``rid`` from ``origin``: dialed if it is a handshaken
    decode rank, else answered on its connection."""
    ack = AbortAck(request_id=rid, rank=host.rank_id)
    if origin.endpoint is not None and peers.get(origin.endpoint) is not None:
        host.post(origin.endpoint, ack)  # dial handshaken ranks only
    else:
        control.reply(origin, ack)
