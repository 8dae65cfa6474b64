"""kvhandoff: hand a request's KV cache and all hybrid-model state from prefill to decode.

The public surface is listed in ``__all__`` (a test pins it).
"""

from kvhandoff.errors import (
    HandoffError,
    IndexLengthMismatch,
    LayoutError,
    LayoutMismatch,
    OutOfBounds,
    PlanError,
    TrimWarning,
)
from kvhandoff.layout import (
    NO_LAYER,
    Component,
    Layout,
    MemoryKind,
    Region,
    RowKind,
    ShardSpec,
    TensorSpec,
)
from kvhandoff.plan import Indices, Plan, Segments, check_compatible, plan
from kvhandoff.state_types import POLICIES, IndexKind, LengthPolicy, StateType

__version__ = "0.1.0"

__all__ = [
    "NO_LAYER",
    "POLICIES",
    "Component",
    "HandoffError",
    "IndexKind",
    "IndexLengthMismatch",
    "Indices",
    "Layout",
    "LayoutError",
    "LayoutMismatch",
    "LengthPolicy",
    "MemoryKind",
    "OutOfBounds",
    "Plan",
    "PlanError",
    "Region",
    "RowKind",
    "Segments",
    "ShardSpec",
    "StateType",
    "TensorSpec",
    "TrimWarning",
    "__version__",
    "check_compatible",
    "plan",
]
