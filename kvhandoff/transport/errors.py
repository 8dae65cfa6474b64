"""Transport errors: every engine failure becomes one of these, once, at the boundary.

The classes live in :mod:`kvhandoff.errors` (the one error tree); this module
re-exports the transport's branch under its historical path (the same objects)::

    HandoffError                      (kvhandoff.errors)
    └── TransportError                anything a transport raises or fails a handle with
        ├── TransportUnavailable      the engine is not installed / not usable here
        ├── TransportClosed           the transport (or peer) was closed by its owner
        ├── ConnectError              a peer endpoint could not be reached or handshaken
        ├── ProtocolError             a peer sent bytes we cannot parse (its fault)
        ├── PeerLost                  the peer vanished (EOF, reset, timeout) mid-operation
        └── TransferFailed            one transfer did not complete
            ├── TransferCancelled     the handle was released while pending
            └── RemoteRefused         the receiver rejected the write; nothing was written
                └── RemoteOutOfBounds a destination byte lies outside its registered memory

``ProtocolError``, ``PeerLost`` and ``TransferFailed`` are also :class:`SessionError`\\ s
(the session reports the same concepts with the same classes).

Sources outside the sender's own registered memory are the caller's bug and raise
:class:`kvhandoff.errors.OutOfBounds` from ``submit`` (nothing is sent).
"""

from __future__ import annotations

from kvhandoff.errors import (
    ConnectError,
    PeerLost,
    ProtocolError,
    RemoteOutOfBounds,
    RemoteRefused,
    TransferCancelled,
    TransferFailed,
    TransportClosed,
    TransportError,
    TransportUnavailable,
)

__all__ = [
    "ConnectError",
    "PeerLost",
    "ProtocolError",
    "RemoteOutOfBounds",
    "RemoteRefused",
    "TransferCancelled",
    "TransferFailed",
    "TransportClosed",
    "TransportError",
    "TransportUnavailable",
]
