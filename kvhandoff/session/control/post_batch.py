"""Decode's control messages of one engine step, held and sent together.

Why: an engine step that opens many requests used to send one ``TransferInit`` per
request to each prefill rank: one encode and one socket send here, and one read,
check, decode and dispatch on prefill's control thread, per request, while that
thread is the busiest part of a burst of handoffs. Inside :meth:`PostBatcher.held`
(``Agent.batched_writes()`` on decode), what the calling thread posts is held and, when
the outermost block exits, sent with the ``TransferInit`` of each prefill rank packed
into :class:`~kvhandoff.protocol.TransferInits` (:func:`pack`): one message per rank,
which prefill handles as the same messages one by one.

Rules (pure, :func:`pack`):

* messages to one endpoint keep their order; an ``Abort`` held after a request's
  ``TransferInit`` still follows it (consecutive inits are packed, never reordered
  around anything else);
* a pack holds at most :data:`~kvhandoff.protocol.MAX_BATCHED_INITS` inits and about
  half of :data:`~kvhandoff.protocol.MAX_MESSAGE_BYTES` of index lists, so it always
  encodes; a lone init goes as itself.

Only the holding thread's posts wait, and only until its block exits; other threads
(the I/O thread, a background group connection) post at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from kvhandoff.protocol import (
    MAX_BATCHED_INITS,
    MAX_MESSAGE_BYTES,
    Message,
    TransferInit,
    TransferInits,
)
from kvhandoff.session.control.holding import Holding

MAX_PACK_BYTES = MAX_MESSAGE_BYTES // 2
"""Index bytes one :class:`TransferInits` may carry (the rest of the limit is headroom
for the fields around them)."""

_FIXED_BYTES = 256  # more than an init's field names, numbers and flags take
_ENTRY_BYTES = 96  # more than an index entry's field names and numbers take


def init_bytes(m: TransferInit) -> int:
    """An upper bound of ``m``'s encoded size: its strings and index lists, plus more
    than its field names and numbers take (msgpack never inflates a string or bytes by
    more than its 5-byte header)."""
    n = _FIXED_BYTES + len(str(m.request_id).encode()) + len(m.rank.instance.encode())
    for name, v in m.indices.items():
        n += _ENTRY_BYTES + len(name.encode())
        if v is not None:
            n += len(v.items) + len(v.positions or b"")
    return n


def pack(posts: Sequence[tuple[str, Message]], *, max_inits: int = MAX_BATCHED_INITS,
         max_bytes: int = MAX_PACK_BYTES) -> list[tuple[str, Message]]:
    """``posts`` as they go out: per endpoint (in first-seen order), each endpoint's
    messages in their order, runs of ``TransferInit`` packed (see the module docstring)."""
    by_endpoint: dict[str, list[Message]] = {}
    for endpoint, msg in posts:
        by_endpoint.setdefault(endpoint, []).append(msg)
    out: list[tuple[str, Message]] = []
    for endpoint, msgs in by_endpoint.items():
        run: list[TransferInit] = []
        size = 0
        for msg in msgs:
            if isinstance(msg, TransferInit):
                n = init_bytes(msg)
                if run and (len(run) >= max_inits or size + n > max_bytes):
                    out.append((endpoint, _packed(run)))
                    run, size = [], 0
                run.append(msg)
                size += n
                continue
            if run:
                out.append((endpoint, _packed(run)))
                run, size = [], 0
            out.append((endpoint, msg))
        if run:
            out.append((endpoint, _packed(run)))
    return out


def _packed(run: list[TransferInit]) -> Message:
    return run[0] if len(run) == 1 else TransferInits(inits=tuple(run))


class _Held(Holding):
    posts: list[tuple[str, Message]]

    def __init__(self) -> None:
        self.posts = []


class PostBatcher:
    """Holds the control messages of threads inside :meth:`held`; ``send`` sends one."""

    def __init__(self, send: Callable[[str, Message], None]) -> None:
        self._send = send
        self._held = _Held()

    def held(self) -> contextlib.AbstractContextManager[None]:
        """Within this context, messages the calling thread posts wait, and go out packed
        when it exits (the outermost one, if nested)."""
        return self._held.block(self._release)

    def _release(self) -> None:
        mine, self._held.posts = self._held.posts, []
        self._send_all(pack(mine))

    def _send_all(self, posts: list[tuple[str, Message]]) -> None:
        """Send every one, even past one that cannot be encoded (a local bug, raised
        once the others are out)."""
        failed: Exception | None = None
        for endpoint, msg in posts:
            try:
                self._send(endpoint, msg)
            except Exception as e:  # re-raised below, after the others
                failed = failed or e
        if failed is not None:
            raise failed

    def hold(self, endpoint: str, msg: Message) -> bool:
        """Keep ``msg`` for the calling thread's block (True), or False when the thread
        is in none: the caller sends it now."""
        if not self._held.active:
            return False
        self._held.posts.append((endpoint, msg))
        return True
