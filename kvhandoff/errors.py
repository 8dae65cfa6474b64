"""kvhandoff's one error tree.

Every message names what is wrong (component, tensor, layer, rank, values) so a
user can act on it without reading our source.

    HandoffError
    ├── LayoutError          a Layout (or a piece of one) is inconsistent in itself
    ├── LayoutMismatch       two Layouts cannot exchange state (handshake-time)
    └── PlanError            a request cannot be planned
        ├── IndexLengthMismatch   index lists of an ``exact`` component differ in length
        └── OutOfBounds           a planned byte would fall outside a registered tensor
"""

from __future__ import annotations


class HandoffError(Exception):
    """Base class of every error kvhandoff raises on purpose."""


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
