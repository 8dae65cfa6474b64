"""Transports: move a Plan's bytes into a peer's registered memory.

See :mod:`kvhandoff.transport.base` for the contract. Engines load lazily through
:func:`create_transport` / :func:`available_transports`.
"""

from kvhandoff.transport.base import (
    Availability,
    Capabilities,
    Handle,
    Peer,
    TransferState,
    Transport,
)
from kvhandoff.transport.errors import (
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
from kvhandoff.transport.registry import (
    available_transports,
    create_transport,
    describe_transports,
    register_transport,
    transport_class,
    transport_names,
)

__all__ = [
    "Availability",
    "Capabilities",
    "ConnectError",
    "Handle",
    "Peer",
    "PeerLost",
    "ProtocolError",
    "RemoteOutOfBounds",
    "RemoteRefused",
    "TransferCancelled",
    "TransferFailed",
    "TransferState",
    "Transport",
    "TransportClosed",
    "TransportError",
    "TransportUnavailable",
    "available_transports",
    "create_transport",
    "describe_transports",
    "register_transport",
    "transport_class",
    "transport_names",
]
