"""Session errors: why a request failed, as one branch of kvhandoff's error tree.

The classes live in :mod:`kvhandoff.errors` (the one error tree); this module
re-exports the session's branch under its historical path (the same objects)::

    HandoffError                       (kvhandoff.errors)
    └── SessionError                   a request (or an agent) could not do its part
        ├── HandshakeError             a (decode rank, prefill rank) pair cannot work
        ├── BootstrapFailed            the prefill ranks could not be found in time
        ├── PeerLost                   a control peer went silent or its transport died
        ├── RequestTimeout             a request spent too long in one state
        │   └── LeaseExpired           prefill freed a finished request no decode claimed
        ├── RequestAborted             the engine (or the peer's engine) aborted it
        ├── TransferFailed             a write failed, or the peer reported a failure
        │   ├── ChecksumMismatch       destination bytes differ from what was sent
        │   └── AuxMismatch            the aux row does not carry this request's guard
        ├── RequestRejected            the peer refused a request message (ErrorReply)
        └── AgentClosed                the agent shut down under the request

``PeerLost`` and ``TransferFailed`` are also :class:`TransportError`\\ s: a transport's
lost peer or failed write is the same class the request then fails with.

A request's failure is one of these; ``Sender.error`` / ``Receiver.error`` hold it and
``.reason`` is its message. Every message names the request, the peer rank or endpoint
and the values involved.
"""

from __future__ import annotations

from kvhandoff.errors import (
    AgentClosed,
    AuxMismatch,
    BootstrapFailed,
    ChecksumMismatch,
    HandshakeError,
    LeaseExpired,
    PeerLost,
    RequestAborted,
    RequestRejected,
    RequestTimeout,
    SessionError,
    TransferFailed,
)

__all__ = [
    "AgentClosed",
    "AuxMismatch",
    "BootstrapFailed",
    "ChecksumMismatch",
    "HandshakeError",
    "LeaseExpired",
    "PeerLost",
    "RequestAborted",
    "RequestRejected",
    "RequestTimeout",
    "SessionError",
    "TransferFailed",
]
