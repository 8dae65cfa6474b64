"""Transport errors: every engine failure becomes one of these, once, at the boundary.

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

Sources outside the sender's own registered memory are the caller's bug and raise
:class:`kvhandoff.errors.OutOfBounds` from ``submit`` (nothing is sent).
"""

from __future__ import annotations

from kvhandoff.errors import HandoffError


class TransportError(HandoffError):
    """Base class of every transport failure."""


class TransportUnavailable(TransportError):
    """The transport cannot be used in this environment (missing package, no device...)."""


class TransportClosed(TransportError):
    """An operation was attempted on a transport or peer that its owner already closed."""


class ConnectError(TransportError):
    """A peer endpoint could not be reached, or its handshake failed."""


class ProtocolError(TransportError):
    """A peer sent a malformed or unexpected frame."""


class PeerLost(TransportError):
    """The peer disappeared (connection reset, EOF, or no progress within the timeout)."""


class TransferFailed(TransportError):
    """One transfer did not complete; some destination bytes may have been written
    unless the subclass says otherwise."""


class TransferCancelled(TransferFailed):
    """The handle was released before the transfer completed."""


class RemoteRefused(TransferFailed):
    """The receiver validated the write and refused it before writing anything."""


class RemoteOutOfBounds(RemoteRefused):
    """A destination byte lies outside every region the receiver registered."""
