"""The GIL inside an engine: how long kvhandoff's threads wait for it.

An engine's step loop is Python that rarely blocks while the engine has work: a loaded
vLLM engine core runs one step after another for the requests it serves (polling the
connector between them), and SGLang's scheduler loop polls its queues between batches. A
thread of kvhandoff that wakes there (the data server
taking a write, the sender reading the acknowledgement, the control socket) must then
wait for the loop to hand over the GIL, which CPython asks it to do only every
``sys.getswitchinterval()`` — 5 ms by default, ten times what moving a 512-token
request's state between two processes costs. A handoff makes several such hops (frame in,
copy, reply out, reply in), so its time was set by the interval, not the bytes.

:func:`quicken` lowers the interval to ``switch_interval_us`` (SessionConfig, 100 µs by
default) when the process's is longer. It costs nothing while kvhandoff's threads are
blocked (a switch is asked for only by a thread that wants the GIL); while they run, the
engine's thread yields more often, for as long as they need it.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["quicken"]

log = logging.getLogger(__name__)


def quicken(switch_interval_us: float) -> float:
    """Lower the interpreter's GIL switch interval to ``switch_interval_us`` microseconds
    when it is longer (0: leave it); returns the interval in force, in seconds."""
    now = sys.getswitchinterval()
    want = switch_interval_us / 1e6
    if want > 0 and want < now:
        sys.setswitchinterval(want)
        log.info("kvhandoff: GIL switch interval %g us (was %g us): the engine's loop hands "
                 "kvhandoff's I/O threads the GIL sooner (KVHANDOFF_SWITCH_INTERVAL_US=0 "
                 "keeps it)", want * 1e6, now * 1e6)
        return want
    return now
