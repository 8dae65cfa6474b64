"""Server subprocesses for tests, demos and benchmarks: start, wait, stop (stdlib only).

A :class:`ServerProcess` runs one command line (a vLLM or SGLang HTTP server, a router)
in its own session / process group, logging to a file, so that stopping it also stops
the workers it spawns (vLLM's EngineCore, SGLang's scheduler and detokenizer). Readiness
is a health URL answering 200 within a bounded deadline; a failure carries the log's
tail. The helpers beside it (free ports, JSON over HTTP) are what every caller needs.

    with ServerProcess("x", [...], url="http://127.0.0.1:8000", log_path=p) as srv:
        srv.start()
        srv.wait_ready(300)
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

__all__ = ["ProgressFn", "ServerError", "ServerProcess", "dead_url", "free_port", "free_ports",
           "get_text", "log_tail", "post_json", "print_progress", "raising_on_sigterm",
           "running"]

ProgressFn = Callable[[float, str], None]
"""Called while waiting for a server: seconds elapsed and the last line of its log."""


class ServerError(RuntimeError):
    """A server exited or did not become healthy in time; the message ends with the
    tail of its log."""


_PORT_RANGE = (10000, 21999)
"""Where :func:`free_ports` draws from: below the kernel's ephemeral ports (32768 and up
by default) and below SGLang's own picks for ports its children bind later (22000-29999)."""
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_given: set[int] = set()
_given_lock = threading.Lock()


def _drawable() -> list[int]:
    try:
        ephemeral_low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low, high = _PORT_RANGE
    return list(range(low, min(high, ephemeral_low - 1) + 1))


def _bindable(port: int) -> bool:
    with socket.socket() as s:  # no SO_REUSEADDR: a port in TIME_WAIT counts as taken
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_ports(n: int = 1) -> list[int]:
    """``n`` distinct TCP ports that are free now, for servers that bind them later.

    Drawn below the kernel's ephemeral range, where no bind to port 0 and no outgoing
    connection can take one meanwhile (a port the kernel had handed out could be: an
    SGLang server that loads its model for a minute before it binds lost its port that
    way under CI), and never the same port twice in one process while the range lasts."""
    with _given_lock:
        pool = [p for p in _drawable() if p not in _given]
        if len(pool) < 64 * n:
            _given.clear()
            pool = _drawable()
        out = [p for p in random.sample(pool, min(len(pool), 64 * n)) if _bindable(p)][:n]
        if len(out) < n:  # no room below the ephemeral ports here: let the kernel choose
            return _kernel_ports(n)
        _given.update(out)
        return out


def _kernel_ports(n: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def free_port() -> int:
    """One TCP port that is free now (see :func:`free_ports`)."""
    return free_ports(1)[0]


def dead_url() -> str:
    """An HTTP URL on this host where nothing listens (a port that was free just now):
    what a client sees when its server is down."""
    return f"http://127.0.0.1:{free_port()}"


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist yet)."""
    try:
        data = path.read_bytes()[-64 * 1024:]
    except FileNotFoundError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def _last_line(path: Path) -> str:
    tail = log_tail(path, 5).strip().splitlines()
    return tail[-1] if tail else ""


def post_json(url: str, payload: Mapping[str, Any], *, timeout: float = 120.0) -> Any:
    """POST ``payload`` as JSON and return the decoded JSON answer. An HTTP error raises
    ``urllib.error.HTTPError`` (its body is in the message)."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        body = e.read().decode("utf-8", "replace")
        raise urllib.error.HTTPError(e.url, e.code, f"{e.reason}: {body}", e.headers,
                                     None) from None


def get_text(url: str, *, timeout: float = 10.0) -> str:
    """GET ``url`` and return the body as text (e.g. ``/metrics``)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode("utf-8", "replace"))


def _die_with_parent() -> None:
    """In the child before exec (Linux): get SIGTERM when the thread that started it dies,
    so a test runner killed by a signal (no ``finally``) leaves no server behind."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """One server subprocess (``args``), healthy when ``health_url`` answers 200.

    ``name`` appears in errors ("vLLM server on port 8000", "SGLang prefill server...").
    With ``die_with_parent`` (the default) the server gets SIGTERM when the *thread*
    that called :meth:`start` exits, so call it from the main thread or a long-lived one.
    """

    def __init__(self, name: str, args: Sequence[str], *, url: str,
                 log_path: str | os.PathLike[str], health_path: str = "/health",
                 env: Mapping[str, str] | None = None, die_with_parent: bool = True) -> None:
        self.name = name
        self.args = list(args)
        self.url = url
        self.health_url = url + health_path
        self.log_path = Path(log_path)
        self.env = dict(os.environ if env is None else env)
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None
        self._t0 = 0.0

    def start(self) -> None:
        """Launch the process (its own session / process group), logging to ``log_path``.
        A server whose process has ended (stopped or killed) may be started again: the
        new process appends to the same log."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb" if self.proc is None else "ab") as log:
            log.write(("$ " + " ".join(self.args) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True,
                preexec_fn=_die_with_parent if self.die_with_parent else None,
            )
        self._t0 = time.monotonic()
        self.startup_s = None

    def healthy(self) -> bool:
        """Whether the health URL answers 200 now."""
        try:
            with urllib.request.urlopen(self.health_url, timeout=2.0) as resp:
                return int(resp.status) == 200
        except (OSError, ValueError):
            return False

    def _fail(self, why: str) -> ServerError:
        self.stop()
        return ServerError(f"{self.name} {why}; log {self.log_path}:\n{log_tail(self.log_path)}")

    def wait_ready(self, timeout: float = 600.0, *, progress: ProgressFn | None = None,
                   progress_every: float = 10.0) -> float:
        """Wait until the health URL answers 200 and return the seconds since
        :meth:`start`. Raises :class:`ServerError` (with the log tail) if the process
        exits first or ``timeout`` seconds pass; the process is then stopped."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} not started")
        deadline = self._t0 + timeout
        next_progress = time.monotonic() + progress_every
        while True:
            if self.proc.poll() is not None:
                raise self._fail(f"exited with {self.proc.returncode}")
            if self.healthy():
                self.startup_s = time.monotonic() - self._t0
                return self.startup_s
            now = time.monotonic()
            if now >= deadline:
                raise self._fail(f"not healthy after {timeout:.0f} s")
            if progress is not None and now >= next_progress:
                progress(now - self._t0, _last_line(self.log_path))
                next_progress = now + progress_every
            time.sleep(min(1.0, max(0.0, deadline - now)))

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the process group, wait up to ``timeout`` s, then SIGKILL it; return
        once the whole group is gone (bounded). Returns the exit code (None if never
        started). Safe to call twice."""
        return self._end(((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)))

    def kill(self) -> int | None:
        """SIGKILL the whole process group at once, as a crash or an OOM kill would (no
        clean-up of any kind), and return once it is gone (bounded)."""
        return self._end(((signal.SIGKILL, 10.0),))

    def _end(self, steps: Sequence[tuple[signal.Signals, float]]) -> int | None:
        proc = self.proc
        if proc is None:
            return None
        for sig, wait in steps:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)  # pid == pgid: start_new_session=True
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            break
        # The leader is gone; its workers may linger in the group. Wait (bounded) until
        # the group is empty, so the ports are free when this returns.
        deadline = time.monotonic() + 10.0
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
            while time.monotonic() < deadline:
                os.killpg(proc.pid, 0)
                time.sleep(0.1)
        return proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


S = TypeVar("S", bound=ServerProcess)


@contextlib.contextmanager
def running(srv: S, timeout: float, *, progress: ProgressFn | None = None) -> Iterator[S]:
    """Start ``srv``, wait until it is healthy (at most ``timeout`` s), yield it, and stop
    it on exit, whatever happens."""
    try:
        srv.start()
        srv.wait_ready(timeout, progress=progress)
        yield srv
    finally:
        srv.stop()


@contextlib.contextmanager
def raising_on_sigterm(error: Callable[[int], BaseException]) -> Iterator[None]:
    """While inside, SIGTERM raises ``error(signum)`` in the main thread, so a demo that
    is told to stop unwinds through every server's context manager (and stops them)
    instead of dying with its servers still running; the previous handler is back on
    exit. Main thread only (``signal.signal``)."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise error(signum)
    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def print_progress(name: str) -> ProgressFn:
    """A progress callback that prints ``[name] 42 s: <last log line>`` to stderr."""
    def show(elapsed: float, line: str) -> None:
        print(f"[{name}] {elapsed:4.0f} s: {line[-160:]}", file=sys.stderr, flush=True)
    return show
