"""The connector's stats and Prometheus metrics, in vLLM's own classes. Imports vLLM.

Workers hand vLLM the observations of :class:`~kvhandoff.integrations.vllm.worker.Stats`
each step; vLLM merges them across workers (:meth:`KvhandoffStats.aggregate`), logs a
summary (:meth:`KvhandoffStats.reduce`) and records them in its Prometheus registry
(:class:`KvhandoffPromMetrics`), so they appear on the server's own ``/metrics``:

=======================================  =========  ====================================
metric                                   kind       labels (beyond vLLM's)
=======================================  =========  ====================================
``kvhandoff:handoff_seconds``            histogram  ``role``
``kvhandoff:phase_seconds``              histogram  ``role``, ``phase``
``kvhandoff:handoff_bytes``              histogram  ``role``
``kvhandoff:bytes_total``                counter    ``role``, ``group``
``kvhandoff:handoffs_total``             counter    ``role``, ``outcome`` (``success`` or
                                                    the error class: a bounded set)
=======================================  =========  ====================================
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvhandoff.integrations.vllm.worker import STAT_KEYS

_SECONDS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            10.0, 30.0, 60.0]
_BYTES = [float(2 ** i) for i in range(10, 36, 2)]


@dataclass
class KvhandoffStats(KVConnectorStats):  # type: ignore[misc]
    def __post_init__(self) -> None:
        for k in STAT_KEYS:
            self.data.setdefault(k, [])

    def reset(self) -> None:
        self.data: dict[str, list[Any]] = {k: [] for k in STAT_KEYS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in STAT_KEYS:
            self.data[k].extend(other.data.get(k, ()))
        return self

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in STAT_KEYS)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for role, seconds in _by_role(self.data["handoff_seconds"]).items():
            out[f"{role} handoffs"] = len(seconds)
            out[f"{role} median ms"] = round(1e3 * statistics.median(seconds), 3)
        for role, what in self.data["outcomes"]:
            if what != "success":
                key = f"{role} failed ({what})"
                out[key] = int(out.get(key, 0)) + 1
        mb = sum(n for _, n in self.data["bytes"]) / 1e6
        if mb:
            out["MB moved"] = round(mb, 3)
        return out


def _by_role(rows: list[list[Any]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for role, v in rows:
        out.setdefault(role, []).append(float(v))
    return out


class KvhandoffPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        h, c = self._histogram_cls, self._counter_cls
        names = list(labelnames)
        self.handoff = h(name="kvhandoff:handoff_seconds", buckets=_SECONDS,
                         documentation="Seconds per kvhandoff handoff, start to finish",
                         labelnames=[*names, "role"])
        self.phase = h(name="kvhandoff:phase_seconds", buckets=_SECONDS,
                       documentation="Seconds per handoff phase (prefill: wait_indices, "
                                     "prepare, transfer, settle; decode: bootstrap, "
                                     "transfer)",
                       labelnames=[*names, "role", "phase"])
        self.size = h(name="kvhandoff:handoff_bytes", buckets=_BYTES,
                      documentation="Bytes per successful handoff",
                      labelnames=[*names, "role"])
        self.bytes = c(name="kvhandoff:bytes", documentation="Bytes handed off, per KV-cache "
                       "group", labelnames=[*names, "role", "group"])
        self.outcomes = c(name="kvhandoff:handoffs", documentation="Finished handoffs by "
                          "outcome: success or the error class",
                          labelnames=[*names, "role", "outcome"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        d = transfer_stats_data
        for role, s in d.get("handoff_seconds", ()):
            self.handoff.labels(*base, role).observe(s)
        for role, phase, s in d.get("phase_seconds", ()):
            self.phase.labels(*base, role, phase).observe(s)
        for role, n in d.get("bytes", ()):
            self.size.labels(*base, role).observe(n)
        for role, group, n in d.get("group_bytes", ()):
            self.bytes.labels(*base, role, group).inc(n)
        for role, outcome in d.get("outcomes", ()):
            self.outcomes.labels(*base, role, outcome).inc()
