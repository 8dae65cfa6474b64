"""Run a command while CPU hogs keep every core busy: how ``make test-stress`` proves the
fault and end-to-end suites hold on a loaded machine (a user's CI, a shared node).

    python -m kvhandoff.lab.testing.hogs [--hogs N] [--runs K] -- COMMAND...

``N`` busy processes (default twice the cores, at the command's own priority) run for
exactly as long as the command; the command runs ``K`` times in a row (default 1) and
the first failure stops it. The hogs are killed on the way out, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Sequence


def _spin() -> None:
    x = 0
    while True:  # killed by the parent
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def run(command: Sequence[str], hogs: int, runs: int) -> int:
    """``command`` ``runs`` times with ``hogs`` busy processes; the first non-zero exit
    status, else 0."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spin, daemon=True, name=f"kvh-hog-{i}") for i in range(hogs)]
    for p in procs:
        p.start()
    try:
        for k in range(1, runs + 1):
            t0 = time.monotonic()
            print(f"[stress] run {k}/{runs} with {hogs} CPU hogs on {os.cpu_count()} cores: "
                  f"{' '.join(command)}", flush=True)
            rc = subprocess.call(list(command))
            print(f"[stress] run {k}/{runs}: exit {rc} after {time.monotonic() - t0:.0f} s",
                  flush=True)
            if rc:
                return rc
        return 0
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join(10)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvhandoff.lab.testing.hogs",
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--hogs", type=int, default=2 * (os.cpu_count() or 1))
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.hogs < 0 or args.runs < 1:
        ap.error("give a command after --, --hogs >= 0 and --runs >= 1")
    return run(command, args.hogs, args.runs)


if __name__ == "__main__":
    sys.exit(main())
