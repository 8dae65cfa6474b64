"""Start and stop real SGLang HTTP servers on a CPU host, for tests, demos and benchmarks.

A :class:`SglangServer` is ``python -m sglang.launch_server`` from the SGLang venv
(:func:`~kvhandoff.lab.sglang.env.sglang_python`) in one of three roles: ``prefill`` and
``decode`` (PD disaggregation over a named transfer backend) or ``colocated`` (the
reference: prefill and decode in one server). Every server gets the CPU arguments
(:data:`CPU_ARGS`: CPU engine, torch_native attention, TP 1, a small pool, no tokenizer),
the lab environment (stand-ins, shims, an explicit plugin whitelist), its own process
group and a log file. :func:`serve` is the context manager
(:mod:`kvhandoff.lab.sglang.client` sends requests).

    with serve("llama", Role.COLOCATED, log_dir=tmp) as ref:
        out = generate(ref.url, [1, 5, 9], max_new_tokens=8)
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvhandoff.lab.servers import ProgressFn, ServerProcess, free_ports, running
from kvhandoff.lab.sglang.env import lab_env, sglang_python
from kvhandoff.lab.sglang.models import MODELS, ensure

__all__ = ["CPU_ARGS", "DECODE_ARGS", "PREFILL_ENV", "SERVER_ENV", "BootstrapAddr", "Role",
           "SglangServer", "serve"]

CPU_ARGS: tuple[str, ...] = (
    "--device", "cpu", "--tp-size", "1", "--dtype", "bfloat16",
    # the one sound attention backend on CPU (triton has no CPU driver; flex_attention
    # answers zeros), and the samplers / grammar that need no GPU kernels
    "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--grammar-backend", "none",
    "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
    # the tiny models have no tokenizer: requests carry input_ids, answers output_ids
    "--skip-tokenizer-init",
    # a small pool: the prompts are at most a few thousand tokens
    "--max-total-tokens", "8192", "--chunked-prefill-size", "1024",
    # prefill's and decode's first token must not differ by a batch of warmup noise
    "--skip-server-warmup",
)
"""Arguments every lab server gets (SGLang 0.5.23 on a CPU host)."""

DECODE_ARGS: tuple[str, ...] = (
    # the default retraction backup (host_pool) builds a pinned HiCache host pool,
    # which asserts CUDA
    "--disaggregation-decode-retraction-backup", "cpu_tensor",
)

SERVER_ENV: Mapping[str, str] = {
    # By default SGLang's /health runs a one-token generation whenever the server is
    # idle (a fake-bootstrap one in a PD role). The lab polls /health to see a server
    # come up: that would put a forward pass on every poll (on a loaded host, a slow
    # answer), and kill a prefill server of a model that cannot run a forward on CPU
    # (NemotronH, DeepSeek-V3.2). Off, /health is 200 once the server is up.
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0",
}
"""Environment every lab server gets."""

PREFILL_ENV: Mapping[str, str] = {
    # Early send of a cached prefix (a radix hit, or the earlier chunks of a chunked
    # prefill) records a torch.cuda.Event under the overlap scheduler
    # (prefill.py:1496): on CPU the scheduler dies with "Tried to instantiate dummy base
    # class Event". The optimisation is optional; the regular per-chunk sends carry the
    # same pages.
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
}
"""Environment every lab prefill server gets."""

START_TIMEOUT_S = 300.0
"""Seconds a server may take to answer /health (a loaded 2-core host boots one in ~30-90)."""


class Role(enum.Enum):
    """What a server does in a PD deployment."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


@dataclass(frozen=True, slots=True)
class BootstrapAddr:
    """Where a request's prefill server waits for decode: SGLang's bootstrap server
    (host, port) and the request's room."""

    host: str
    port: int
    room: int

    def fields(self) -> dict[str, Any]:
        """The ``/generate`` body fields that route a request through this room."""
        return {"bootstrap_host": self.host, "bootstrap_port": self.port,
                "bootstrap_room": self.room}


class SglangServer(ServerProcess):
    """One SGLang HTTP server; see :class:`~kvhandoff.lab.servers.ServerProcess` for
    start / wait_ready / stop. ``model`` names a tiny model (:data:`~.models.MODELS`),
    whose checkpoint is at ``model_path``. ``backend`` is the transfer backend of a
    prefill or decode server (ignored when colocated); a prefill server's bootstrap
    server listens on ``bootstrap_port``. ``shims`` add lab shims to the model's own,
    ``env`` variables to the lab environment."""

    def __init__(self, model: str, model_path: str | os.PathLike[str], role: Role, *,
                 port: int, log_path: str | os.PathLike[str], backend: str = "",
                 bootstrap_port: int | None = None, host: str = "127.0.0.1",
                 extra_args: Sequence[str] = (), shims: Sequence[str] = (),
                 env: Mapping[str, str] | None = None,
                 python: str | os.PathLike[str] | None = None) -> None:
        spec = MODELS[model]
        if role is not Role.COLOCATED and not backend:
            raise ValueError(f"a {role.value} server needs a transfer backend")
        if role is Role.PREFILL and bootstrap_port is None:
            raise ValueError("a prefill server needs a bootstrap port")
        self.model = model
        self.role = role
        self.backend = backend if role is not Role.COLOCATED else ""
        self.host = host
        self.port = port
        self.bootstrap_port = bootstrap_port
        args = [str(python or sglang_python()), "-m", "sglang.launch_server",
                "--model-path", str(model_path), "--host", host, "--port", str(port),
                *CPU_ARGS, *spec.server_args]
        if role is not Role.COLOCATED:
            args += ["--disaggregation-mode", role.value,
                     "--disaggregation-transfer-backend", self.backend]
        if role is Role.PREFILL:
            args += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        if role is Role.DECODE:
            args += list(DECODE_ARGS)
        args += list(extra_args)
        name = f"SGLang {role.value} server ({model}, {self.backend or 'no transfer'}) " \
               f"on port {port}"
        role_env = {**SERVER_ENV, **(PREFILL_ENV if role is Role.PREFILL else {})}
        super().__init__(name, args, url=f"http://{host}:{port}", log_path=log_path,
                         env=lab_env(shims=(*spec.shims, *shims), backend=self.backend,
                                     extra={**role_env, **(env or {})}))

    def bootstrap(self, room: int) -> BootstrapAddr:
        """The bootstrap address of a request in ``room`` on this prefill server."""
        if self.role is not Role.PREFILL or self.bootstrap_port is None:
            raise ValueError(f"{self.name} is not a prefill server")
        return BootstrapAddr(self.host, self.bootstrap_port, room)

    def __enter__(self) -> SglangServer:
        return self


@contextlib.contextmanager
def serve(model: str, role: Role, *, log_dir: str | os.PathLike[str], backend: str = "",
          timeout: float = START_TIMEOUT_S, progress: ProgressFn | None = None,
          **kwargs: Any) -> Iterator[SglangServer]:
    """Build ``model`` if needed, start a server in ``role`` on free ports (keyword
    arguments as :class:`SglangServer`), wait until ``/health`` answers (at most
    ``timeout`` s; a failure raises :class:`~kvhandoff.lab.servers.ServerError` with the
    log's tail), yield it, and stop its whole process group on exit."""
    python = kwargs.pop("python", None) or sglang_python()
    path = ensure(model, python)
    port, boot = free_ports(2)
    name = f"{model}-{role.value}{'-' + backend if backend else ''}"
    srv = SglangServer(model, path, role, port=port, backend=backend, python=python,
                       bootstrap_port=boot if role is Role.PREFILL else None,
                       log_path=Path(log_dir) / f"{name}.log", **kwargs)
    with running(srv, timeout, progress=progress):
        yield srv
