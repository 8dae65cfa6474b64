"""The connector's stats and Prometheus metrics, in vLLM's own classes. Imports vLLM.

Workers hand vLLM the observations of :class:`~kvhandoff.integrations.vllm.worker.Stats`
each step (rows of each handoff's :class:`~kvhandoff.integrations.Figures`); vLLM merges
them across workers (:meth:`KvhandoffStats.aggregate`), logs a summary
(:meth:`KvhandoffStats.reduce`) and records them in its Prometheus registry
(:class:`KvhandoffPromMetrics`), so they appear on the server's own ``/metrics`` under the
same names, help and buckets as kvhandoff's own metrics (the kit's
:data:`~kvhandoff.integrations.HANDOFF_SERIES`), with vLLM's labels first:

=====================================  =========  =======================================
metric                                 kind       labels (beyond vLLM's)
=====================================  =========  =======================================
``kvhandoff_handoff_seconds``          histogram  ``role``
``kvhandoff_phase_seconds``            histogram  ``role``, ``phase``
``kvhandoff_handoff_bytes``            histogram  ``role``
``kvhandoff_component_bytes_total``    counter    ``role``, ``component``
``kvhandoff_requests_total``           counter    ``role``, ``status`` (success / failed)
``kvhandoff_failures_total``           counter    ``role``, ``reason`` (the error class:
                                                  a bounded set)
=====================================  =========  =======================================
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvhandoff.integrations import HANDOFF_SERIES, Series
from kvhandoff.integrations.vllm.worker import STAT_KEYS

_SERIES = {x.name.removeprefix("kvhandoff_"): x for x in HANDOFF_SERIES}


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
        self.metrics = {key: self._make(x, list(labelnames)) for key, x in _SERIES.items()}

    def _make(self, x: Series, names: list[str]) -> Any:
        labels = [*names, *x.labels]
        if x.buckets is None:
            return self._counter_cls(name=x.name, documentation=x.doc, labelnames=labels)
        return self._histogram_cls(name=x.name, documentation=x.doc, labelnames=labels,
                                   buckets=list(x.buckets))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        d, m = transfer_stats_data, self.metrics
        for role, s in d.get("handoff_seconds", ()):
            m["handoff_seconds"].labels(*base, role).observe(s)
        for role, phase, s in d.get("phase_seconds", ()):
            m["phase_seconds"].labels(*base, role, phase).observe(s)
        for role, n in d.get("bytes", ()):
            m["handoff_bytes"].labels(*base, role).observe(n)
        for role, component, n in d.get("group_bytes", ()):
            m["component_bytes"].labels(*base, role, component).inc(n)
        for role, outcome in d.get("outcomes", ()):
            ok = outcome == "success"
            m["requests"].labels(*base, role, "success" if ok else "failed").inc()
            if not ok:
                m["failures"].labels(*base, role, outcome).inc()
