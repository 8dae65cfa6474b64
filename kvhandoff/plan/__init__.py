"""The sans-IO planner: ``Layout × Layout × indices → Plan``.

Pure numpy in, numpy out: no sockets, threads or clocks (a test pins this).
"""

from kvhandoff.plan.build import plan
from kvhandoff.plan.compat import check_compatible, pair_layouts
from kvhandoff.plan.execute import execute
from kvhandoff.plan.format import format_plan
from kvhandoff.plan.model import Plan, Segments, TensorPlan
from kvhandoff.plan.request import Indices, Request

__all__ = [
    "Indices",
    "Plan",
    "Request",
    "Segments",
    "TensorPlan",
    "check_compatible",
    "execute",
    "format_plan",
    "pair_layouts",
    "plan",
]
