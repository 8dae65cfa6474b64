"""The victim process of ``test_the_accept_loop_survives_running_out_of_descriptors``
(run as a script, never collected): a bootstrap server and a rig in this process, under
its own RLIMIT_NOFILE so the test process keeps its own.

Protocol on stdin/stdout: a byte-exact handoff; then every free descriptor is taken and
``HOGGED host port control_port`` (the decode's data port and control socket) is
printed; the test connects to both and writes ``CONNECTED``; once the decode's data
accept loop and its control socket reported the failure (or 20 s passed),
``SEEN {json}`` says what the control socket did meanwhile and the CPU seconds the
process spent, the descriptors are freed, a restarted prefill (new data and control
connections) runs a second handoff, and ``ACCEPT-SURVIVED`` is printed if it is
byte-exact."""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import threading
import time

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.hostile import data_port, exact
from kvhandoff.lab.testing.rig import Rig

NOFILE = 512


class _Seen(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "accept failed" in record.getMessage():
            self.event.set()


def _hog() -> list[int]:
    fds: list[int] = []
    try:
        while len(fds) < NOFILE:
            fds.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    return fds


def main() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(NOFILE, soft), hard))
    seen = _Seen()
    logging.getLogger("kvhandoff.transport").addHandler(seen)
    with BootstrapServer() as srv:
        rig = Rig(srv.url, "security-emfile")
        try:
            first = rig.plan(1)
            rig.handoff(first)
            host, port, _ = data_port(rig.decode)
            door = rig.decode._control._door  # type: ignore[union-attr]
            control = rig.decode.endpoint.rsplit(":", 1)[1]
            fds = _hog()
            print("HOGGED", host, port, control, flush=True)
            sys.stdin.readline()
            cpu0, wall0 = time.process_time(), time.monotonic()
            survived = seen.event.wait(20)
            deadline = time.monotonic() + 20
            while door.drained < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1)  # a second more at the limit: what a spin would burn
            print("SEEN", json.dumps({
                "control_accept_failures": door.accept_failures, "drained": door.drained,
                "cpu_s": time.process_time() - cpu0, "wall_s": time.monotonic() - wall0}),
                flush=True)
            for fd in fds:
                os.close(fd)
            if not survived:
                print("NO-ACCEPT-FAILURE-REPORTED", flush=True)
            rig.restart_prefill()
            second = rig.plan(2, block=2)
            rig.handoff(second)
            problems = exact(rig, [first, second])
            if problems:
                print("PROBLEMS", problems, flush=True)
                return 1
            if survived:
                print("ACCEPT-SURVIVED", flush=True)
        finally:
            rig.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
