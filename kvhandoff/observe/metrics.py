"""Prometheus metrics of kvhandoff's agents, with bounded labels.

One :class:`HandoffMetrics` per process, on a ``prometheus_client`` registry of its own
(:attr:`HandoffMetrics.registry`), so a host process can serve it next to its own metrics
(vLLM, a router) or :func:`serve` it on an opt-in port (``KVHANDOFF_METRICS_PORT``).
Every agent reports each finished request into it (:meth:`AgentMetrics.finished`, from the
request's timeline, bytes, error class and notable events), and is :meth:`watched
<HandoffMetrics.watch>` so gauges of its peers are read when the registry is scraped.

Labels are bounded: ``role`` (prefill / decode), ``transport`` (a registry name),
``phase`` (a fixed list), ``status`` (success / failed) and ``reason`` (an error class
name, a closed set). Never a request id, nor a name a peer chooses.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvhandoff.observe import timeline as tl

_SECONDS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            2.5, 5.0, 10.0, 30.0)
_BYTES = tuple(float(4 ** k * 1024) for k in range(12))  # 1 KiB .. 4 GiB
_GBPS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)

EVENTS = {"rehandshake": "kvhandoff_rehandshakes",
          "checksum_mismatch": "kvhandoff_checksum_mismatches",
          "refused_write": "kvhandoff_refused_writes",
          "lease_expired": "kvhandoff_leases_expired"}
"""A request side's notable events → the counter each goes to."""


class Watched(Protocol):
    """What the peer gauges read from a live agent, at scrape time."""

    @property
    def role(self) -> object: ...

    @property
    def closed(self) -> bool: ...

    @property
    def stats(self) -> Mapping[str, int]: ...


class _PeerGauges(Collector):
    """Peers with a live handshake and peers under suspicion, summed over live agents."""

    def __init__(self) -> None:
        self.agents: weakref.WeakSet[Watched] = weakref.WeakSet()
        self._lock = threading.Lock()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            agents = [a for a in list(self.agents) if not a.closed]
        peers = GaugeMetricFamily("kvhandoff_peers", "Peers with a live handshake (prefill: "
                                  "decode ranks; decode: prefill ranks)", labels=["role"])
        suspects = GaugeMetricFamily("kvhandoff_suspect_peers", "Peers a write to was lost, "
                                     "being probed", labels=["role"])
        slots = GaugeMetricFamily("kvhandoff_staging_slots_in_use", "Slots of the agents' "
                                  "staging arenas leased to senders or quarantined",
                                  labels=["role"])
        totals: dict[str, list[int]] = {}
        for a in agents:
            st = a.stats
            t = totals.setdefault(str(getattr(a.role, "value", a.role)), [0, 0, 0])
            t[0] += int(st.get("decode_peers", 0)) + int(st.get("prefill_peers", 0))
            t[1] += int(st.get("suspect_peers", 0))
            t[2] += int(st.get("staging_slots", 0))
        for role, (n, sus, used) in sorted(totals.items()):
            peers.add_metric([role], n)
            suspects.add_metric([role], sus)
            slots.add_metric([role], used)
        yield peers
        yield suspects
        yield slots


class HandoffMetrics:
    """The metrics of every agent in this process (thread-safe, as prometheus_client's
    metrics are)."""

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
        self.events = {
            "rehandshake": Counter(EVENTS["rehandshake"], "Handshakes a request repeated "
                                   "because the peer had forgotten ours", base, registry=r),
            "checksum_mismatch": Counter(EVENTS["checksum_mismatch"], "Chunks whose bytes "
                                         "did not match the sender's checksums", base,
                                         registry=r),
            "refused_write": Counter(EVENTS["refused_write"], "Writes the receiver refused "
                                     "for landing outside its registered memory", base,
                                     registry=r),
            "lease_expired": Counter(EVENTS["lease_expired"], "Requests prefill finished "
                                     "and freed because no decode claimed them within the "
                                     "lease (also in kvhandoff_failures, reason "
                                     "LeaseExpired)", base, registry=r),
        }
        self.setup = Histogram("kvhandoff_peer_setup_seconds", "Decode reaching a prefill "
                               "group, once per group: the bootstrap lookup, then the "
                               "handshakes with its ranks", ["stage"], buckets=_SECONDS,
                               registry=r)
        self.live = Gauge("kvhandoff_live_requests", "Requests in flight", ["role"],
                          registry=r)
        self._peers = _PeerGauges()
        r.register(self._peers)

    def peer_setup(self, lookup_s: float, handshake_s: float) -> None:
        """A decode rank connected a prefill group: its lookup and handshake times."""
        self.setup.labels("lookup").observe(lookup_s)
        self.setup.labels("handshake").observe(handshake_s)

    def watch(self, agent: Watched) -> None:
        """Read ``agent``'s peer counts at every scrape while it lives (a weak reference)."""
        with self._peers._lock:
            self._peers.agents.add(agent)

    def finished(self, role: str, transport: str, timeline: tl.Timeline, *,
                 nbytes: int, reason: str | None,
                 events: Mapping[str, int] | None = None) -> None:
        """One request ended on this rank: ``reason`` None for success, else the error
        class name; ``events``: its notable events (:data:`EVENTS`)."""
        self.for_agent(role, transport).finished(timeline, nbytes=nbytes, reason=reason,
                                                 events=events)

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
        self._events = {k: c.labels(role, transport) for k, c in m.events.items()}
        self._end = tl.END[role]

    def finished(self, timeline: tl.Timeline, *, nbytes: int, reason: str | None,
                 events: Mapping[str, int] | None = None) -> None:
        for name, n in (events or {}).items():
            if n and name in self._events:
                self._events[name].inc(n)
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
