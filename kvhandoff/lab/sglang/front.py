"""The front of a PD deployment, as SGLang users run it: ``sglang-router`` in PD mode.

``python -m sglang_router.launch_router --pd-disaggregation --prefill URL BOOTSTRAP_PORT
--decode URL`` (sglang-router 0.3.2, the Rust router; what SGLang 0.5.23's own PD test
fixture launches) takes a client's ``/generate``, picks a bootstrap room, sends the
request to the prefill and the decode server at once with ``bootstrap_host/port/room``,
and answers with decode's result. It runs here unchanged (it needs no GPU and, with
``input_ids`` requests, no tokenizer), so the lab needs no proxy of its own.

The lab turns off the router's retries and circuit breaker: a failed transfer must reach
the client as a failure, not be retried on the same pair (which would also send the KV
twice). It also turns off the router's periodic health checks: on a loaded 2-core host a
busy server's ``/health`` can miss the router's timeout, and the router then refuses
every request ("No prefill workers available") although both servers are fine; the lab
watches its servers itself.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Sequence

from kvhandoff.lab.servers import ServerProcess
from kvhandoff.lab.sglang.env import lab_env, sglang_python
from kvhandoff.lab.sglang.serve import Role, SglangServer

__all__ = ["ROUTER_ARGS", "Router"]

ROUTER_ARGS: tuple[str, ...] = (
    "--policy", "round_robin", "--disable-retries", "--disable-circuit-breaker",
    "--worker-startup-check-interval", "1", "--disable-health-check",
    "--request-timeout-secs", "300",
    "--log-level", "warn",
)
"""Router options every lab front gets."""


class Router(ServerProcess):
    """``sglang_router.launch_router`` in PD mode in front of ``prefill`` and ``decode``
    servers; see :class:`~kvhandoff.lab.servers.ServerProcess`. It may start with them:
    it waits up to ``startup_timeout`` s for them to answer. Its Prometheus exporter
    listens on ``metrics_port`` (the router's default, 29000, is one per host: a second
    router beside it would die on start-up).

    Ready means ``/readiness`` reports every worker healthy: the router registers its
    workers in the background after it starts listening, and until then ``/health`` is
    already 200 but ``/generate`` answers 503 "No prefill workers available"."""

    def __init__(self, prefill: Sequence[SglangServer], decode: Sequence[SglangServer], *,
                 port: int, metrics_port: int, log_path: str | os.PathLike[str],
                 host: str = "127.0.0.1", startup_timeout: float = 300.0,
                 python: str | os.PathLike[str] | None = None) -> None:
        args = [str(python or sglang_python()), "-m", "sglang_router.launch_router",
                "--pd-disaggregation", "--host", host, "--port", str(port), *ROUTER_ARGS,
                "--prometheus-host", host, "--prometheus-port", str(metrics_port),
                "--worker-startup-timeout-secs", str(int(startup_timeout))]
        for p in prefill:
            if p.role is not Role.PREFILL:
                raise ValueError(f"{p.name} is not a prefill server")
            args += ["--prefill", p.url, str(p.bootstrap_port)]
        for d in decode:
            if d.role is not Role.DECODE:
                raise ValueError(f"{d.name} is not a decode server")
            args += ["--decode", d.url]
        self.workers = len(prefill) + len(decode)
        super().__init__(f"sglang-router (PD) on port {port}", args,
                         url=f"http://{host}:{port}", health_path="/readiness",
                         log_path=log_path, env=lab_env())

    def healthy(self) -> bool:
        """Whether ``/readiness`` answers 200 with every worker registered and healthy."""
        try:
            with urllib.request.urlopen(self.health_url, timeout=2.0) as resp:
                state = json.loads(resp.read())
        except (OSError, ValueError):
            return False
        return (isinstance(state, dict) and state.get("status") == "ready"
                and state.get("healthy_workers") == self.workers)

    def __enter__(self) -> Router:
        return self
