"""Prometheus metrics of kvhandoff's agents, with bounded labels.

One :class:`HandoffMetrics` per process, on a ``prometheus_client`` registry of its own
(:attr:`HandoffMetrics.registry`), so a host process can serve it next to its own metrics
(vLLM, a router) or :func:`serve` it on an opt-in port (``--metrics-port``,
``KVHANDOFF_METRICS_PORT``). Every agent of the process reports into it through
:meth:`HandoffMetrics.finished` (one call per finished request, from its timeline) and the
``inc_*`` counters.

Labels are bounded: ``role`` (prefill / decode), ``transport`` (a registry name),
``phase`` (a fixed list), ``status`` (success / failed), ``reason`` (an error class name,
a closed set) and ``peer`` (a peer's instance name, at most :data:`MAX_PEERS` distinct per
process, later ones counted as ``"other"``: a peer chooses its name, so it must not
choose how many series we keep). Never a request id.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvhandoff.observe import timeline as tl

MAX_PEERS = 64
OTHER = "other"

_SECONDS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            2.5, 5.0, 10.0, 30.0)
_BYTES = tuple(float(4 ** k * 1024) for k in range(12))  # 1 KiB .. 4 GiB
_GBPS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


class HandoffMetrics:
    """The metrics of every agent in this process (thread-safe: prometheus_client's
    metrics are, and the peer-label cap takes a lock)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        base = ["role", "transport"]
        self.handoff = Histogram("kvhandoff_handoff_seconds", "A successful handoff, "
                                 "opened to settled (prefill) or landed (decode)", base,
                                 buckets=_SECONDS, registry=r)
        self.phase = Histogram("kvhandoff_phase_seconds", "Each phase of a successful "
                               "handoff (prefill: wait_indices, prepare, transfer, settle; "
                               "decode: bootstrap, transfer)", [*base, "phase"],
                               buckets=_SECONDS, registry=r)
        self.size = Histogram("kvhandoff_handoff_bytes", "Bytes a successful handoff moved",
                              base, buckets=_BYTES, registry=r)
        self.speed = Histogram("kvhandoff_transfer_gbps", "Prefill's write speed per "
                               "handoff, GB/s (bytes / transfer phase)", ["transport"],
                               buckets=_GBPS, registry=r)
        self.requests = Counter("kvhandoff_requests", "Finished requests by final status",
                                [*base, "status"], registry=r)
        self.failures = Counter("kvhandoff_failures", "Failed requests (aborts included) "
                                "by reason: the error class", [*base, "reason"], registry=r)
        self.rehandshakes = Counter("kvhandoff_rehandshakes", "Handshakes repeated with a "
                                    "known peer (it restarted or changed)",
                                    ["role", "peer"], registry=r)
        self.checksum_mismatches = Counter("kvhandoff_checksum_mismatches", "Chunks whose "
                                           "bytes did not match the sender's checksums",
                                           ["peer"], registry=r)
        self.refused_writes = Counter("kvhandoff_refused_writes", "Writes refused for "
                                      "landing outside registered memory", ["transport"],
                                      registry=r)
        self.live = Gauge("kvhandoff_live_requests", "Requests in flight", ["role"],
                          registry=r)
        self.peers = Gauge("kvhandoff_peers", "Peers with a live handshake", ["role"],
                           registry=r)
        self._peer_names: set[str] = set()
        self._lock = threading.Lock()

    def peer(self, name: str) -> str:
        """``name`` as a label value: itself for the first :data:`MAX_PEERS` distinct
        names, :data:`OTHER` after."""
        with self._lock:
            if name in self._peer_names:
                return name
            if len(self._peer_names) < MAX_PEERS:
                self._peer_names.add(name)
                return name
        return OTHER

    def finished(self, role: str, transport: str, timeline: tl.Timeline, *,
                 nbytes: int, reason: str | None) -> None:
        """One request ended on this rank: ``reason`` None for success, else the error
        class name."""
        self.for_agent(role, transport).finished(timeline, nbytes=nbytes, reason=reason)

    def for_agent(self, role: str, transport: str) -> AgentMetrics:
        """The series of one (role, transport), bound once (what an agent reports into:
        a success then costs a few observations, no label lookups)."""
        return AgentMetrics(self, role, transport)


class AgentMetrics:
    """One (role, transport)'s children of :class:`HandoffMetrics`."""

    def __init__(self, m: HandoffMetrics, role: str, transport: str) -> None:
        self._m, self.role, self.transport = m, role, transport
        self._success = m.requests.labels(role, transport, "success")
        self._failed = m.requests.labels(role, transport, "failed")
        self._handoff = m.handoff.labels(role, transport)
        self._phase = {p: m.phase.labels(role, transport, p) for p, _, _ in tl.PHASES[role]}
        self._size = m.size.labels(role, transport)
        self._speed = m.speed.labels(transport) if role == "prefill" else None
        self._end = tl.END[role]

    def finished(self, timeline: tl.Timeline, *, nbytes: int, reason: str | None) -> None:
        if reason is not None:
            self._failed.inc()
            self._m.failures.labels(self.role, self.transport, reason).inc()
            return
        self._success.inc()
        total = timeline.span(tl.OPENED, self._end)
        if total is not None:
            self._handoff.observe(total)
        phases = tl.phase_seconds(self.role, timeline)
        for phase, s in phases.items():
            self._phase[phase].observe(s)
        self._size.observe(nbytes)
        moved = phases.get("transfer")
        if self._speed is not None and moved and nbytes:
            self._speed.observe(nbytes / moved / 1e9)


def serve(metrics: HandoffMetrics, port: int, host: str = "127.0.0.1") -> int:
    """Serve ``metrics`` over HTTP on ``host:port`` (0: any free port) from a daemon
    thread; returns the bound port."""
    server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    return int(server.server_port)
