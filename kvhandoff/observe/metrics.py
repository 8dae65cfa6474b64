"""Prometheus metrics of kvhandoff's agents, with bounded labels.

One :class:`HandoffMetrics` per process, on a ``prometheus_client`` registry of its own
(:attr:`HandoffMetrics.registry`), so a host process can serve it next to its own metrics
(vLLM, a router) or :func:`serve` it on an opt-in port (``KVHANDOFF_METRICS_PORT``).
Every agent reports each finished request into it (:meth:`AgentMetrics.finished`, from the
request's timeline, bytes, error class and notable events), and is :meth:`watched
<HandoffMetrics.watch>` so gauges of its peers are read when the registry is scraped.

Labels are bounded: ``role`` (prefill / decode), ``transport`` (a registry name),
``phase`` (a fixed list), ``status`` (success / failed) and ``reason`` (an error class
name, or why indices were refused: closed sets). Never a request id, nor a name a peer
chooses.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvhandoff.observe import timeline as tl
from kvhandoff.observe.figures import Figures, measure

SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BYTES_BUCKETS = tuple(float(4 ** k * 1024) for k in range(12))  # 1 KiB .. 4 GiB
_GBPS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


@dataclass(frozen=True, slots=True)
class Series:
    """One handoff series: its name (the one prefix, ``kvhandoff_``), help text, labels
    beyond the host's own, and histogram buckets (None: a counter). Every registry that
    exports handoffs (kvhandoff's own, vLLM's) builds them from these, so a series has
    one name and one meaning wherever it is scraped."""

    name: str
    doc: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] | None = None


HANDOFF_SECONDS = Series("kvhandoff_handoff_seconds", "A successful handoff, opened to "
                         "settled (prefill) or landed (decode)", ("role",), SECONDS_BUCKETS)
PHASE_SECONDS = Series("kvhandoff_phase_seconds", "Each phase of a successful handoff "
                       "(prefill: wait_indices, prepare, transfer, move, settle; decode: "
                       "bootstrap, transfer)", ("role", "phase"), SECONDS_BUCKETS)
HANDOFF_BYTES = Series("kvhandoff_handoff_bytes", "Bytes a successful handoff moved",
                       ("role",), BYTES_BUCKETS)
COMPONENT_BYTES = Series("kvhandoff_component_bytes", "Bytes successful handoffs moved, "
                         "per component", ("role", "component"))
REQUESTS = Series("kvhandoff_requests", "Finished requests by final status",
                  ("role", "status"))
FAILURES = Series("kvhandoff_failures", "Failed requests (aborts included) by reason: "
                  "the error class", ("role", "reason"))
HANDOFF_SERIES = (HANDOFF_SECONDS, PHASE_SECONDS, HANDOFF_BYTES, COMPONENT_BYTES, REQUESTS,
                  FAILURES)
"""What every finished handoff is reported as (:func:`record`)."""


Child = Any
"""A labelled child of a histogram (``observe``) or a counter (``inc``): prometheus_client's
own, or a host's wrapper of them (vLLM's)."""


def record(f: Figures, child: Callable[[Series, tuple[str, ...]], Child]) -> None:
    """Report one handoff's figures into :data:`HANDOFF_SERIES`; ``child(series,
    labels)`` returns the series' child for those label values (in ``series.labels``
    order, after whatever labels the host adds)."""
    if not f.success:
        child(REQUESTS, (f.role, "failed")).inc()
        child(FAILURES, (f.role, f.outcome)).inc()
        return
    child(REQUESTS, (f.role, "success")).inc()
    if f.seconds is not None:
        child(HANDOFF_SECONDS, (f.role,)).observe(f.seconds)
    for phase, s in f.phases.items():
        child(PHASE_SECONDS, (f.role, phase)).observe(s)
    child(HANDOFF_BYTES, (f.role,)).observe(f.nbytes)
    for component, n in f.component_bytes.items():
        child(COMPONENT_BYTES, (f.role, component)).inc(n)


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
        self.series = {x.name: _metric(x, ["transport"], r) for x in HANDOFF_SERIES}
        self.speed = Histogram("kvhandoff_transfer_gbps", "Prefill's write speed per "
                               "handoff, GB/s (bytes / transfer phase)", ["transport"],
                               buckets=_GBPS, registry=r)
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
                               "handshakes with its ranks", ["stage"],
                               buckets=SECONDS_BUCKETS,
                               registry=r)
        self.live = Gauge("kvhandoff_live_requests", "Requests in flight", ["role"],
                          registry=r)
        self.refused_claims = Counter(
            "kvhandoff_refused_claims", "Indices a prefill rank refused because they did "
            "not prove the request was routed to their decode (kvhandoff.binding): "
            "no_proof or bad_proof; nothing was written for them", ["reason"], registry=r)
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
        self.for_agent(role, transport).record(
            measure(role, timeline, nbytes=nbytes, reason=reason, events=events))

    def for_agent(self, role: str, transport: str) -> AgentMetrics:
        """The series of one (role, transport), bound once (what an agent reports into:
        a success then costs a few observations, no label lookups)."""
        return AgentMetrics(self, role, transport)


def _metric(x: Series, host: list[str], r: CollectorRegistry) -> Histogram | Counter:
    """``x`` in registry ``r``, labelled by ``x.labels`` then the host's ``host``."""
    labels = [*x.labels, *host]
    if x.buckets is None:
        return Counter(x.name, x.doc, labels, registry=r)
    return Histogram(x.name, x.doc, labels, buckets=x.buckets, registry=r)


class AgentMetrics:
    """One (role, transport)'s children of :class:`HandoffMetrics`."""

    def __init__(self, m: HandoffMetrics, role: str, transport: str) -> None:
        self._m, self.role, self.transport = m, role, transport
        self._children: dict[tuple[str, tuple[str, ...]], Child] = {}
        self._speed = m.speed.labels(transport) if role == "prefill" else None
        self._events = {k: c.labels(role, transport) for k, c in m.events.items()}

    def _child(self, x: Series, values: tuple[str, ...]) -> Child:
        key = (x.name, values)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = self._m.series[x.name].labels(*values, self.transport)
        return got

    def record(self, f: Figures) -> None:
        """One request ended on this rank, as measured (:mod:`~kvhandoff.observe.figures`)."""
        for name, n in f.events.items():
            if n and name in self._events:
                self._events[name].inc(n)
        record(f, self._child)
        moved = f.transfer_seconds
        if self._speed is not None and f.success and moved and f.nbytes:
            self._speed.observe(f.nbytes / moved / 1e9)


def serve(metrics: HandoffMetrics, port: int, host: str = "127.0.0.1") -> int:
    """Serve ``metrics`` over HTTP on ``host:port`` (0: any free port) from a daemon
    thread; returns the bound port."""
    server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    return int(server.server_port)
