"""The foreground servers' shared way to stop: an event set by SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import threading


def stop_on_signals() -> asyncio.Event:
    """An event that SIGINT and SIGTERM set. Call inside the running loop; handlers are
    installed only on the main thread (elsewhere the caller sets the event itself)."""
    stop = asyncio.Event()
    if threading.current_thread() is threading.main_thread():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    return stop
