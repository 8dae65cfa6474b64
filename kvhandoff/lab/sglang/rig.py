"""SGLang deployments on this host, for the tests, the demo and the benchmark alike.

:func:`deployment` starts what a user runs for one model and one transfer backend: a
prefill and a decode server (started together, so their boots overlap) and
``sglang-router`` in front; both record what they register, and prefill what it sends,
in a ledger (:mod:`.ledger`).
:func:`reference` starts the colocated server the tokens are compared with (without
waiting for it, so that its boot overlaps the deployment's).
:meth:`Deployment.send` sends one request through the router and returns decode's
answer with the ledger entry prefill wrote for it.

    with reference("llama", log_dir=d) as ref, deployment("llama", "mooncake_tcp",
                                                         log_dir=d) as pd:
        want = stream(ref.ready().url, ids, max_new_tokens=8).output_ids
        got, entry = pd.send(ids, max_new_tokens=8)
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvhandoff.lab.servers import ProgressFn, ServerProcess, free_ports
from kvhandoff.lab.sglang import ledger
from kvhandoff.lab.sglang.client import Answer, stream
from kvhandoff.lab.sglang.env import sglang_python
from kvhandoff.lab.sglang.front import Router
from kvhandoff.lab.sglang.models import ensure
from kvhandoff.lab.sglang.serve import START_TIMEOUT_S, Role, SglangServer

__all__ = ["BACKENDS", "LEDGER_TIMEOUT_S", "Deployment", "Extras", "Pair", "Reference",
           "all_running",
           "deployment", "deployments", "make_deployment", "make_pair", "reference",
           "stop_all"]

BACKENDS: tuple[str, ...] = ("mooncake_tcp", "kvhandoff")
"""The transfer backends the lab runs SGLang deployments over (tests, demo, bench)."""

LEDGER_TIMEOUT_S = 60.0
"""How long :meth:`Deployment.send` waits for prefill's ledger entry after decode has
answered (prefill notes the transfer when its poll sees Success; decode may finish
first)."""


def stop_all(servers: Sequence[ServerProcess]) -> None:
    """Stop servers concurrently (each stop waits for its process group to be gone)."""
    threads = [threading.Thread(target=s.stop, name=f"stop {s.name}") for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@contextlib.contextmanager
def all_running(servers: Sequence[ServerProcess], timeout: float,
                progress: ProgressFn | None = None) -> Iterator[None]:
    """Start every server at once (their boots overlap), wait until each is ready (at most
    ``timeout`` s from its start; a failure raises
    :class:`~kvhandoff.lab.servers.ServerError` with its log's tail), and stop them all
    on exit."""
    try:
        for srv in servers:
            srv.start()
        for srv in servers:
            srv.wait_ready(timeout, progress=progress)
        yield
    finally:
        stop_all(servers)


@dataclass(frozen=True, slots=True)
class Pair:
    """A prefill and a decode server of ``model`` over ``backend`` (not started), and the
    ledger file both record their registrations (and prefill its transfers) in."""

    model: str
    backend: str
    prefill: SglangServer
    decode: SglangServer
    ledger_path: Path

    def registrations(self) -> list[ledger.Registration]:
        """What each side's transfer manager registered, in the order they came up."""
        return ledger.registrations(self.ledger_path)


@dataclass(frozen=True, slots=True)
class Deployment(Pair):
    """A running PD deployment: a prefill and a decode server and the router in front."""

    router: Router

    @property
    def servers(self) -> tuple[SglangServer, SglangServer, Router]:
        """Everything the deployment runs, in start order."""
        return (self.prefill, self.decode, self.router)

    @property
    def url(self) -> str:
        """Where clients send requests: the router."""
        return self.router.url

    def send(self, input_ids: Sequence[int], *, max_new_tokens: int
             ) -> tuple[Answer, ledger.Transfer]:
        """Stream one request through the router, then wait (at most
        :data:`LEDGER_TIMEOUT_S`) for prefill's ledger entry of it. Requests must be sent
        one at a time: the entry is the one that appears during this call."""
        before = set(ledger.transfers(self.ledger_path))
        answer = stream(self.url, input_ids, max_new_tokens=max_new_tokens)
        deadline = time.monotonic() + LEDGER_TIMEOUT_S
        while True:
            new = {room: e for room, e in ledger.transfers(self.ledger_path).items()
                   if room not in before}
            if len(new) == 1:
                return answer, next(iter(new.values()))
            if len(new) > 1 or time.monotonic() >= deadline:
                raise RuntimeError(
                    f"{self.prefill.name}: expected one new transfer ledger entry for a "
                    f"{len(input_ids)}-token request, found {len(new)} after "
                    f"{LEDGER_TIMEOUT_S:.0f} s ({self.ledger_path})")
            time.sleep(0.05)


@dataclass(frozen=True, slots=True)
class Extras:
    """What a test adds to a pair's servers: environment per role (e.g. a lab-only
    transport on prefill, checksums on decode) and more shims (:mod:`.shims`) on both."""

    prefill_env: Mapping[str, str] = field(default_factory=dict)
    decode_env: Mapping[str, str] = field(default_factory=dict)
    shims: tuple[str, ...] = ()


def make_pair(model: str, backend: str, *, log_dir: str | os.PathLike[str],
              python: str | os.PathLike[str] | None = None,
              ports: Sequence[int] | None = None, extras: Extras = Extras()) -> Pair:
    """Build (do not start) a prefill and a decode server, with a fresh ledger in
    ``log_dir``. ``ports``: prefill's HTTP and bootstrap ports and decode's (default:
    free ones)."""
    py = python or sglang_python()
    path = ensure(model, py)
    logs = Path(log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    book = logs / f"{model}-{backend}-ledger.jsonl"
    book.unlink(missing_ok=True)
    pport, bport, dport = ports or free_ports(3)
    shims, env = ("transfer_ledger", "census", *extras.shims), {ledger.ENV: str(book)}
    p = SglangServer(model, path, Role.PREFILL, port=pport, bootstrap_port=bport,
                     backend=backend, python=py, shims=shims, env={**env, **extras.prefill_env},
                     log_path=logs / f"{model}-{backend}-prefill.log")
    d = SglangServer(model, path, Role.DECODE, port=dport, backend=backend, python=py,
                     shims=shims, env={**env, **extras.decode_env},
                     log_path=logs / f"{model}-{backend}-decode.log")
    return Pair(model, backend, p, d, book)


def make_deployment(model: str, backend: str, *, log_dir: str | os.PathLike[str],
                    timeout: float = START_TIMEOUT_S,
                    python: str | os.PathLike[str] | None = None,
                    extras: Extras = Extras()) -> Deployment:
    """Build (do not start) a prefill and a decode server of ``model`` over ``backend``
    and a router in front of them (:data:`Deployment.servers`, to start together)."""
    *ports, rport, mport = free_ports(5)  # distinct: taken together
    pair = make_pair(model, backend, log_dir=log_dir, python=python, ports=ports,
                     extras=extras)
    router = Router([pair.prefill], [pair.decode], port=rport, metrics_port=mport,
                    python=python,
                    startup_timeout=timeout,
                    log_path=Path(log_dir) / f"{model}-{backend}-router.log")
    return Deployment(model, backend, pair.prefill, pair.decode, pair.ledger_path, router)


@contextlib.contextmanager
def deployment(model: str, backend: str, *, log_dir: str | os.PathLike[str],
               timeout: float = START_TIMEOUT_S, progress: ProgressFn | None = None,
               python: str | os.PathLike[str] | None = None,
               extras: Extras = Extras()) -> Iterator[Deployment]:
    """Start a prefill and a decode server of ``model`` over ``backend`` and a router in
    front (all at once: the router waits for its workers itself), wait until all are
    ready (:func:`all_running`), yield the :class:`Deployment`, stop everything on exit."""
    with deployments(model, (backend,), log_dir=log_dir, timeout=timeout, progress=progress,
                     python=python, extras=extras) as both:
        yield both[backend]


@contextlib.contextmanager
def deployments(model: str, backends: Sequence[str], *, log_dir: str | os.PathLike[str],
                timeout: float = START_TIMEOUT_S, progress: ProgressFn | None = None,
                python: str | os.PathLike[str] | None = None,
                extras: Extras = Extras()) -> Iterator[dict[str, Deployment]]:
    """One :func:`deployment` of ``model`` per backend, all started at once (their boots
    overlap), by backend."""
    made = {b: make_deployment(model, b, log_dir=log_dir, timeout=timeout, python=python,
                               extras=extras)
            for b in dict.fromkeys(backends)}
    with all_running([s for d in made.values() for s in d.servers], timeout, progress):
        yield made


class Reference:
    """The colocated server of ``model`` (prefill and decode in one), the run a
    deployment's tokens must equal. It starts at construction and :meth:`ready` waits for
    it, so its boot can overlap a deployment's; :meth:`stop` ends it."""

    def __init__(self, model: str, *, log_dir: str | os.PathLike[str],
                 timeout: float = START_TIMEOUT_S, progress: ProgressFn | None = None,
                 python: str | os.PathLike[str] | None = None) -> None:
        py = python or sglang_python()
        (port,) = free_ports(1)
        self.timeout = timeout
        self.progress = progress
        self.server = SglangServer(model, ensure(model, py), Role.COLOCATED, port=port,
                                   python=py,
                                   log_path=Path(log_dir) / f"{model}-colocated.log")
        self.server.start()

    def ready(self) -> SglangServer:
        """The server, once it answers ``/health`` (raises
        :class:`~kvhandoff.lab.servers.ServerError` if it does not within the timeout)."""
        if self.server.startup_s is None:
            self.server.wait_ready(self.timeout, progress=self.progress)
        return self.server

    def stop(self) -> None:
        self.server.stop()


@contextlib.contextmanager
def reference(model: str, *, log_dir: str | os.PathLike[str],
              timeout: float = START_TIMEOUT_S, progress: ProgressFn | None = None,
              python: str | os.PathLike[str] | None = None) -> Iterator[Reference]:
    """Start a :class:`Reference` (not waiting for it), yield it, stop it on exit."""
    ref = Reference(model, log_dir=log_dir, timeout=timeout, progress=progress, python=python)
    try:
        yield ref
    finally:
        ref.stop()
