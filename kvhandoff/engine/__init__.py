"""The reference engine: a small serving engine that uses kvhandoff as a real one would.

Needs ``torch`` and ``transformers`` (not dependencies of the core library): import
``kvhandoff.engine`` only where they are installed.

* :mod:`~kvhandoff.engine.models` — tiny random-weight configs of real architectures.
* :mod:`~kvhandoff.engine.arch` / :mod:`~kvhandoff.engine.codecs` — HF cache ⇄ rows.
* :mod:`~kvhandoff.engine.pools`, :mod:`~kvhandoff.engine.tables`,
  :mod:`~kvhandoff.engine.alloc`, :mod:`~kvhandoff.engine.prefix_cache` — paged pools,
  page tables, free lists, the decode prefix cache.
* :mod:`~kvhandoff.engine.prefill` / :mod:`~kvhandoff.engine.decode` — the instances.
* :mod:`~kvhandoff.engine.transfer` — the one seam to the transport (in-process here).
* :mod:`~kvhandoff.engine.run` — :func:`run_disaggregated`, the end-to-end check.
"""

from kvhandoff.engine.models import ARCHITECTURES, CORE, load_model, sample_prompts
from kvhandoff.engine.run import (
    RequestResult,
    RunResult,
    colocated_greedy,
    run_disaggregated,
)
from kvhandoff.engine.transfer import (
    Chunk,
    DecodeTransfer,
    ItemList,
    LocalTransfer,
    PrefillTransfer,
    Transfer,
    TransferReport,
)

__all__ = [
    "ARCHITECTURES",
    "CORE",
    "Chunk",
    "DecodeTransfer",
    "ItemList",
    "LocalTransfer",
    "PrefillTransfer",
    "RequestResult",
    "RunResult",
    "Transfer",
    "TransferReport",
    "colocated_greedy",
    "load_model",
    "run_disaggregated",
    "sample_prompts",
]
