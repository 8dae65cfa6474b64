"""Session errors: why a request failed, as one branch of kvhandoff's error tree.

    HandoffError                       (kvhandoff.errors)
    └── SessionError                   a request (or an agent) could not do its part
        ├── HandshakeError             a (decode rank, prefill rank) pair cannot work
        ├── BootstrapFailed            the prefill ranks could not be found in time
        ├── PeerLost                   a control peer went silent or its transport died
        ├── RequestTimeout             a request spent too long in one state
        ├── RequestAborted             the engine (or the peer's engine) aborted it
        ├── TransferFailed             a write failed, or the peer reported a failure
        │   ├── ChecksumMismatch       destination bytes differ from what was sent
        │   └── AuxMismatch            the aux row does not carry this request's guard
        ├── RequestRejected            the peer refused a request message (ErrorReply)
        └── AgentClosed                the agent shut down under the request

A request's failure is one of these; ``Sender.error`` / ``Receiver.error`` hold it and
``.reason`` is its message. Every message names the request, the peer rank or endpoint
and the values involved.
"""

from __future__ import annotations

from kvhandoff.errors import HandoffError


class SessionError(HandoffError):
    """Base class of every session failure."""


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


class PeerLost(SessionError):
    """A peer stopped answering (heartbeats) or its transport connection died."""


class RequestTimeout(SessionError):
    """A request stayed in one state longer than its configured timeout."""


class RequestAborted(SessionError):
    """The request was aborted by this side's engine or by the peer."""


class TransferFailed(SessionError):
    """Bytes did not arrive: a transport failure, or the peer reported one."""


class ChecksumMismatch(TransferFailed):
    """The digest of a component's destination bytes differs from the sender's."""


class AuxMismatch(TransferFailed):
    """The aux row holds another request's guard, or its integrity check failed."""


class RequestRejected(SessionError):
    """The peer answered a request message with an ErrorReply."""


class AgentClosed(SessionError):
    """The agent was closed while the request was live."""
