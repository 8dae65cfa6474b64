"""A rate limit for warnings that hostile or broken peers can trigger at will.

One :class:`Throttle` per kind of event: the first occurrence is logged at once, later
ones at most once per ``interval`` seconds, each saying how many were suppressed since
the last line. Thread-safe; the clock is ``time.monotonic`` unless one is passed in.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class Throttle:
    """Logs through ``logger`` at ``level``, at most once per ``interval`` seconds."""

    def __init__(self, logger: logging.Logger, *, interval: float = 10.0,
                 level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self._level, self._interval, self._clock = logger, level, interval, clock
        self._lock = threading.Lock()
        self._next = float("-inf")
        self._suppressed = 0

    def __call__(self, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless one was logged less than ``interval`` ago; returns
        whether it was logged."""
        now = self._clock()
        with self._lock:
            if now < self._next:
                self._suppressed += 1
                return False
            self._next = now + self._interval
            suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            msg += f" ({suppressed} more like this suppressed)"
        self._log.log(self._level, msg, *args)
        return True
