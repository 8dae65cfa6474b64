"""kvhandoff's one error tree: every error class is defined here, once.

Every message names what is wrong (component, tensor, layer, rank, values) so a
user can act on it without reading our source.

    HandoffError
    ├── MissingExtra              an optional dependency is not installed (names the extra)
    ├── LayoutError               a Layout (or a piece of one) is inconsistent in itself
    ├── LayoutMismatch            two Layouts cannot exchange state (handshake-time)
    ├── PlanError                 a request cannot be planned
    │   ├── IndexLengthMismatch   index lists of an ``exact`` component differ in length
    │   └── OutOfBounds           a planned byte would fall outside a registered tensor
    ├── LocalProtocolError        this side tried something the protocol forbids (our bug)
    ├── TransportError            anything a transport raises or fails a handle with
    │   ├── TransportUnavailable  the engine is not installed / not usable here
    │   ├── TransportClosed       the transport (or peer) was closed by its owner
    │   ├── ConnectError          a peer endpoint could not be reached or handshaken
    │   ├── ProtocolError  *      a peer sent bytes we cannot accept (its fault)
    │   ├── PeerLost  *           the peer vanished (EOF, reset, silence) mid-operation
    │   └── TransferFailed  *     bytes did not arrive (a write failed, or the peer said so)
    │       ├── TransferCancelled     the handle was released while pending
    │       ├── RemoteRefused         the receiver rejected the write; nothing was written
    │       │   └── RemoteOutOfBounds a destination byte lies outside its registered memory
    │       ├── ChecksumMismatch      destination bytes differ from what was sent
    │       └── AuxMismatch           the aux row does not carry this request's guard
    └── SessionError              a request (or an agent) could not do its part
        ├── ProtocolError, PeerLost, TransferFailed  *  (the same classes as above)
        ├── HandshakeError        a (decode rank, prefill rank) pair cannot work
        ├── BootstrapFailed       the prefill ranks could not be found in time
        ├── RequestTimeout        a request spent too long in one state
        │   └── LeaseExpired      prefill freed a finished request no decode claimed
        ├── RequestAborted        the engine (or the peer's engine) aborted it
        ├── RequestRejected       the peer refused a request message (ErrorReply)
        └── AgentClosed           the agent shut down under the request

``*``: one concept, one class, reported by both layers — a transport fails a handle
with it and a session request fails with it — so each derives from both
:class:`TransportError` and :class:`SessionError`. ``ProtocolError`` (a malformed
control message or transport frame) is also a ``ValueError``.

The classes are re-exported where they used to live (:mod:`kvhandoff.transport.errors`,
:mod:`kvhandoff.session.errors`, :mod:`kvhandoff.protocol`): the same objects, so an
``except`` written against either path catches both layers' errors.
"""

from __future__ import annotations


class HandoffError(Exception):
    """Base class of every error kvhandoff raises on purpose."""


class MissingExtra(HandoffError, ImportError):
    """A part of kvhandoff needs a package that only one of its extras installs (the
    core library depends on none of them: numpy, msgspec, pyzmq, prometheus_client)."""

    def __init__(self, package: str, *, extra: str, needed_by: str) -> None:
        self.package, self.extra = package, extra
        super().__init__(f"{needed_by} needs {package}, which kvhandoff installs only with "
                         f"its {extra!r} extra: pip install 'kvhandoff[{extra}]'",
                         name=package)


# --- layouts and planning ---------------------------------------------------------------


class LayoutError(HandoffError, ValueError):
    """A layout record was built with inconsistent numbers."""


class LayoutMismatch(HandoffError):
    """A prefill layout and a decode layout cannot be paired.

    ``problems`` lists every incompatibility found, one sentence each.
    """

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        head = self.problems[0] if len(self.problems) == 1 else f"{len(self.problems)} problems"
        body = "" if len(self.problems) == 1 else "\n  - " + "\n  - ".join(self.problems)
        super().__init__(f"incompatible layouts: {head}{body}")


class PlanError(HandoffError, ValueError):
    """A request's index lists cannot be turned into a plan."""


class IndexLengthMismatch(PlanError):
    """Index lists of a component whose policy is ``exact`` differ in length."""


class OutOfBounds(PlanError):
    """A planned byte would lie outside a registered tensor."""


class TrimWarning(UserWarning):
    """Index lists of a ``trim`` component differed; the common prefix was kept."""


class LocalProtocolError(HandoffError, RuntimeError):
    """This side tried something the protocol forbids (an illegal state transition, an
    unencodable or oversized message). A bug in the caller, not the peer."""


# --- the two layers' bases --------------------------------------------------------------


class TransportError(HandoffError):
    """Base class of every transport failure."""


class SessionError(HandoffError):
    """Base class of every session failure: why a request (or an agent) failed."""


# --- shared by both layers --------------------------------------------------------------


class ProtocolError(TransportError, SessionError, ValueError):
    """The peer sent something we cannot accept: a malformed, unknown or oversized
    control message or transport frame, or a field out of range. The remote side is at
    fault; a control channel answers it with an ``ErrorReply``."""


class PeerLost(TransportError, SessionError):
    """The peer disappeared: connection reset, EOF, no progress within the transport's
    timeout, or silence past the session's heartbeat timeout."""


class TransferFailed(TransportError, SessionError):
    """Bytes did not arrive: one transfer did not complete (some destination bytes may
    have been written unless the subclass says otherwise), or the peer reported a
    failure."""


# --- transport only ---------------------------------------------------------------------


class TransportUnavailable(TransportError):
    """The transport cannot be used in this environment (missing package, no device...)."""


class TransportClosed(TransportError):
    """An operation was attempted on a transport or peer that its owner already closed."""


class ConnectError(TransportError):
    """A peer endpoint could not be reached, or its handshake failed."""


class TransferCancelled(TransferFailed):
    """The handle was released before the transfer completed."""


class RemoteRefused(TransferFailed):
    """The receiver validated the write and refused it before writing anything."""


class RemoteOutOfBounds(RemoteRefused):
    """A destination byte lies outside every region the receiver registered."""


# --- session only -----------------------------------------------------------------------


class ChecksumMismatch(TransferFailed):
    """The digest of a component's destination bytes differs from the sender's."""


class AuxMismatch(TransferFailed):
    """The aux row holds another request's guard, or its integrity check failed."""


class HandshakeError(SessionError):
    """The pair cannot work; ``problems`` lists every reason, one actionable line each."""

    def __init__(self, problems: list[str] | tuple[str, ...] | str, *, peer: str = "") -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.peer = peer
        where = f" with {peer}" if peer else ""
        head = self.problems[0] if len(self.problems) == 1 else f"{len(self.problems)} problems"
        body = "" if len(self.problems) == 1 else "\n  - " + "\n  - ".join(self.problems)
        super().__init__(f"handshake{where} rejected: {head}{body}")


class BootstrapFailed(SessionError):
    """The bootstrap server could not be reached, or the prefill ranks never registered."""


class RequestTimeout(SessionError):
    """A request stayed in one state longer than its configured timeout."""


class LeaseExpired(RequestTimeout):
    """Prefill had finished a request, and no decode claimed it (sent its indices)
    within the lease: prefill freed its memory (``SessionConfig.lease``)."""


class RequestAborted(SessionError):
    """The request was aborted by this side's engine or by the peer."""


class RequestRejected(SessionError):
    """The peer answered a request message with an ErrorReply."""


class AgentClosed(SessionError):
    """The agent was closed while the request was live."""
