"""The reference engine: a small serving engine that uses kvhandoff as a real one would.

Needs ``torch`` and ``transformers`` (not dependencies of the core library): import
``kvhandoff.lab.engine`` only where they are installed (the ``engine`` extra installs
transformers; torch, a CPU build, is installed first, see DEVELOPERS.md). Without
transformers, importing it raises :class:`~kvhandoff.errors.MissingExtra` naming the extra.

* :mod:`~kvhandoff.lab.engine.models` — tiny random-weight configs of real architectures.
* :mod:`~kvhandoff.lab.engine.arch` / :mod:`~kvhandoff.lab.engine.codecs` — HF cache ⇄ rows.
* :mod:`~kvhandoff.lab.engine.pools`, :mod:`~kvhandoff.lab.engine.tables`,
  :mod:`~kvhandoff.lab.engine.alloc`, :mod:`~kvhandoff.lab.engine.prefix_cache` — paged pools,
  page tables, free lists, the decode prefix cache.
* :mod:`~kvhandoff.lab.engine.prefill` / :mod:`~kvhandoff.lab.engine.decode` — the instances.
* :mod:`~kvhandoff.lab.engine.transfer` — the one seam to the transport (in-process here).
* :mod:`~kvhandoff.lab.engine.run` — :func:`run_disaggregated`, the end-to-end check.
"""

from kvhandoff.errors import MissingExtra

try:
    import transformers  # noqa: F401  # the one optional dependency the engine checks first
except ImportError as e:
    raise MissingExtra("transformers", extra="engine",
                       needed_by="the reference engine (kvhandoff.lab.engine)") from e

from kvhandoff.lab.engine.models import ARCHITECTURES, CORE, load_model, sample_prompts
from kvhandoff.lab.engine.run import (
    RequestResult,
    RunResult,
    colocated_greedy,
    run_disaggregated,
)
from kvhandoff.lab.engine.transfer import (
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
