"""The victim process of ``test_the_accept_loop_survives_running_out_of_descriptors``
(run as a script, never collected): a bootstrap server and a rig in this process, under
its own RLIMIT_NOFILE so the test process keeps its own.

Protocol on stdin/stdout: a byte-exact handoff; then every free descriptor is taken and
``HOGGED host port`` (the decode's data port) is printed; the test connects and writes
``CONNECTED``; once the decode's accept loop reported the failure (or 20 s passed) the
descriptors are freed, a restarted prefill (new data connections) runs a second handoff,
and ``ACCEPT-SURVIVED`` is printed if it is byte-exact."""

from __future__ import annotations

import logging
import os
import resource
import sys
import threading

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
            fds = _hog()
            print("HOGGED", host, port, flush=True)
            sys.stdin.readline()
            survived = seen.event.wait(20)
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
