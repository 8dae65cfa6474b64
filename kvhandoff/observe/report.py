"""Where an agent reports each finished request: the process's metrics, and a trace file.

One :class:`HandoffMetrics` per process (:func:`process_metrics`), served over HTTP at most
once (the first agent configured with a ``metrics_port`` starts it); every agent gets a
:class:`Reporter` that feeds it and, when configured, a trace file.
"""

from __future__ import annotations

import logging
import threading

from kvhandoff.observe.figures import Finished, figures
from kvhandoff.observe.metrics import AgentMetrics, HandoffMetrics, serve
from kvhandoff.observe.trace import TraceWriter

log = logging.getLogger("kvhandoff.observe")

_lock = threading.Lock()
_metrics: HandoffMetrics | None = None
_served: int | None = None  # the port this process serves its metrics on
_served_host = "127.0.0.1"


def process_metrics() -> HandoffMetrics:
    """This process's metrics (created on first use): merge ``.registry`` into a host's."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = HandoffMetrics()
        return _metrics


def serve_process_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Serve :func:`process_metrics` on ``port`` (0: any free one), once per process;
    returns the port served on (a later call's port is ignored, and logged)."""
    global _served, _served_host
    metrics = process_metrics()
    with _lock:
        if _served is None:
            _served, _served_host = serve(metrics, port, host), host
            log.info("kvhandoff metrics on http://%s:%d/metrics", host, _served)
        elif port not in (0, _served):
            log.warning("kvhandoff metrics already served on port %d, not %d", _served, port)
        return _served


def metrics_url(dial_host: str | None = None) -> str | None:
    """Where this process serves its metrics (``http://host:port/metrics``), or None;
    ``dial_host``: the address others reach this host by, when it listens on a wildcard."""
    with _lock:
        if _served is None:
            return None
        host = _served_host
        if host in ("0.0.0.0", "", "*"):
            host = dial_host or "127.0.0.1"
        return f"http://{host}:{_served}/metrics"


class Reporter:
    """One agent's reporting: ``role``, ``transport`` and ``rank`` label what it reports."""

    def __init__(self, *, role: str, transport: str, rank: str,
                 metrics: HandoffMetrics | None, trace: TraceWriter | None) -> None:
        self.role, self.transport, self.rank = role, transport, rank
        self.trace = trace
        self.metrics: AgentMetrics | None = (
            metrics.for_agent(role, transport) if metrics is not None else None)

    def finished(self, side: Finished) -> None:
        """Report one finished request: its figures, measured once, go to the metrics and
        the trace."""
        f = figures(self.role, side)
        reason = side.failure
        if self.metrics is not None:
            self.metrics.record(f)
        if self.trace is not None:
            try:
                self.trace.write(role=self.role, request=side.request_id, rank=self.rank,
                                 transport=self.transport, timeline=side.timeline,
                                 outcome="success" if reason is None else "failed",
                                 reason=reason, peers=side.peers,
                                 nbytes={"total": side.nbytes, **side.component_bytes})
            except OSError as e:  # a full disk must not fail a handoff
                log.warning("kvhandoff trace %s: %s", self.trace.path, e)
