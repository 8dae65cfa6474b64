"""The victim of ``test_descriptor_flood.py`` (run as a script, never collected): a
default deployment in one process under ``ulimit -n 256`` — a bootstrap server, a
prefill and a decode agent (their tcp data servers and control sockets) — whose log goes
to stderr.

Protocol on stdin/stdout: after a byte-exact handoff it prints ``PORTS {json}`` (the
bootstrap, the decode's data server, the prefill's and decode's control sockets) and
waits; the test floods them and writes ``FLOODED``; the victim prints ``STATS {json}``
(its CPU seconds while flooded, descriptors in use, and each listener's counters) and
waits; the test closes its connections and writes ``RELEASED``; the victim restarts its
prefill (new registration, new control and data connections: every listener must
accept again), runs a second handoff and prints ``EXACT`` if both are byte-exact."""

from __future__ import annotations

import json
import logging
import resource
import sys
import time

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.descriptors import in_use
from kvhandoff.lab.testing.hostile import data_port, exact
from kvhandoff.lab.testing.rig import Rig

NOFILE = 256


def _counters(srv: BootstrapServer, rig: Rig) -> dict[str, int]:
    server = rig.decode.transport._server  # type: ignore[attr-defined]
    doors = srv.doors
    out = {"bootstrap_accept_failures": doors.accept_failures if doors else -1,
           "bootstrap_cap": doors.cap if doors else -1,
           "data_accept_failures": server.accept_failures,
           "data_cap": server.max_connections, "fds": in_use()}
    for name, agent in (("prefill", rig.prefill), ("decode", rig.decode)):
        door = agent._control._door  # type: ignore[union-attr]
        out |= {f"{name}_control_accept_failures": door.accept_failures,
                f"{name}_control_drained": door.drained,
                f"{name}_control_cap": door.cap}
    return out


def main() -> int:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    with BootstrapServer() as srv:
        rig = Rig(srv.url, "flood")
        try:
            first, second = rig.plan(1), rig.plan(2, block=2)
            rig.handoff(first)
            ports = {"bootstrap": srv.port, "data": data_port(rig.decode)[1],
                     "prefill_control": int(rig.prefill.endpoint.rsplit(":", 1)[1]),
                     "decode_control": int(rig.decode.endpoint.rsplit(":", 1)[1])}
            print("PORTS", json.dumps(ports), flush=True)
            cpu0 = time.process_time()
            sys.stdin.readline()  # FLOODED
            stats = {"cpu_s": time.process_time() - cpu0, **_counters(srv, rig)}
            print("STATS", json.dumps(stats), flush=True)
            sys.stdin.readline()  # RELEASED
            rig.restart_prefill()
            rig.handoff(second)
            problems = exact(rig, [first, second])
            print("EXACT" if not problems else f"PROBLEMS {problems}", flush=True)
        finally:
            rig.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
