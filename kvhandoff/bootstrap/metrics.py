"""Prometheus metrics of a bootstrap server, served on its own ``GET /metrics``.

Counters of the requests it answered, by route (the route's pattern, such as
``/v1/instances/{instance}``, never the instance a client named; ``other`` for a path no
route matched) and HTTP status; gauges of what the registry holds, read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvhandoff.bootstrap.client import Health

ROUTES = frozenset({"/v1/register", "/v1/instances", "/v1/instances/{instance}", "/health",
                    "/metrics"})


class _RegistryGauges(Collector):
    def __init__(self, health: Callable[[], Health]) -> None:
        self._health = health

    def collect(self) -> Iterator[GaugeMetricFamily]:
        h = self._health()
        yield GaugeMetricFamily("kvhandoff_bootstrap_instances",
                                "Instances with at least one registered rank", h.instances)
        yield GaugeMetricFamily("kvhandoff_bootstrap_ready_instances",
                                "Instances whose every rank registered", h.ready_instances)
        yield GaugeMetricFamily("kvhandoff_bootstrap_ranks", "Registered ranks", h.ranks)


class BootstrapMetrics:
    """The metrics of one bootstrap server (``health``: its registry's
    :meth:`~kvhandoff.bootstrap.server.Registry.health`)."""

    def __init__(self, health: Callable[[], Health]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvhandoff_bootstrap_requests", "Requests answered, by "
                                "route and HTTP status", ["route", "status"],
                                registry=self.registry)
        self.registry.register(_RegistryGauges(health))

    def answered(self, route: str | None, status: int) -> None:
        self.requests.labels(route if route in ROUTES else "other", str(status)).inc()
