"""In-band statuses: a chunk's ``TransferStatus`` delivered by the transport itself.

On a transport with ``capabilities.notices`` a successful status rides with the
chunk's writes as their notice (a :class:`~kvhandoff.protocol.StatusNotice`): the
receiving transport hands it over right after the bytes landed. That saves the
control-socket hop (the write's acknowledgement to prefill, a ZeroMQ message back,
decode's I/O thread) on the latency path of a small handoff. Failures, aborts and
empty chunks still go over the control socket.

Several decode agents may share one transport (the engine's emulated TP ranks), so a
transport gets one :class:`NoticeRouter`, which passes each notice to the agent whose
control endpoint it names (with every status it carries: a batch's notice carries
several, ``StatusNotice.more``). A notice that does not decode or names no agent here is
logged and dropped: it cannot be trusted more than a control message from nowhere.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

from kvhandoff.protocol import (
    ProtocolError,
    StatusNotice,
    TransferStatus,
    decode_notice,
    encode_notice,
)
from kvhandoff.transport.base import MAX_NOTICE, Transport

log = logging.getLogger("kvhandoff.session.rank.notices")

Handler = Callable[[StatusNotice], None]

_routers: weakref.WeakKeyDictionary[Transport, NoticeRouter] = weakref.WeakKeyDictionary()
_routers_lock = threading.Lock()


def in_band(status: TransferStatus, *, to: str, sender: str, transport: Transport,
            accepted: bool) -> bytes | None:
    """``status`` as the in-band notice of its chunk's writes to the decode rank at
    ``to`` (which ``accepted`` notices at handshake), from the prefill rank at ``sender``;
    None when it goes over the control socket (no notices, or too long for one)."""
    return in_band_all([status], to=to, sender=sender, transport=transport,
                       accepted=accepted)


def in_band_all(statuses: list[TransferStatus], *, to: str, sender: str,
                transport: Transport, accepted: bool) -> bytes | None:
    """As :func:`in_band`, for the statuses of several chunks whose writes go in one
    submit (a batch, :mod:`kvhandoff.session.control.write_batch`): one notice carries them all,
    in order. None when they go over the control socket (no notices, or too long)."""
    if not (statuses and accepted and transport.capabilities.notices):
        return None
    data = encode_notice(StatusNotice(to=to, sender=sender, status=statuses[0],
                                      more=tuple(statuses[1:])))
    return data if len(data) <= MAX_NOTICE else None


class NoticeRouter:
    """The notice handler of one transport. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._agents: dict[str, Handler] = {}

    @staticmethod
    def of(transport: Transport) -> NoticeRouter | None:
        """The transport's router (installed as its notice handler on first use), or
        None when the transport has no notices."""
        if not transport.capabilities.notices:
            return None
        with _routers_lock:
            router = _routers.get(transport)
            if router is None:
                router = _routers[transport] = NoticeRouter()
                transport.on_notice(router.deliver)
            return router

    def add(self, endpoint: str, handler: Handler) -> None:
        with self._lock:
            self._agents[endpoint] = handler

    def remove(self, endpoint: str) -> None:
        with self._lock:
            self._agents.pop(endpoint, None)

    def deliver(self, data: bytes) -> None:
        """The transport's notice handler (a transport thread; never raises)."""
        try:
            notice = decode_notice(data)
        except ProtocolError as e:
            log.warning("dropping an in-band notice: %s", e)
            return
        with self._lock:
            handler = self._agents.get(notice.to)
        if handler is None:
            log.debug("in-band status for %s, which is not an agent here (closed?): dropped",
                      notice.to)
            return
        handler(notice)
