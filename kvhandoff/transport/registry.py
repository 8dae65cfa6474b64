"""Transports by name: which exist, which can run here and why not, and a factory.

Engine modules are imported lazily (only when asked about), so ``import kvhandoff``
never loads an engine wheel. A module that fails to import is reported unavailable
with the import error as the reason; it never breaks the other transports.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from typing import Any

from kvhandoff.transport.base import Availability, Transport
from kvhandoff.transport.errors import TransportUnavailable

_lock = threading.Lock()
_TARGETS: dict[str, str] = {
    "memory": "kvhandoff.transport.memory:MemoryTransport",
    "tcp": "kvhandoff.transport.tcp.transport:TcpTransport",
    "shm": "kvhandoff.transport.shm.transport:ShmTransport",
    "cma": "kvhandoff.transport.cma.transport:CmaTransport",
    "auto": "kvhandoff.transport.auto.transport:AutoTransport",
    "mooncake": "kvhandoff.transport.engines.mooncake:MooncakeTransport",
    "nixl": "kvhandoff.transport.engines.nixl:NixlTransport",
}

DEFAULT = "auto"
"""The transport used when none is named: per peer, the fastest both sides can use."""


def register_transport(name: str, target: str) -> None:
    """Add (or replace) a transport: ``target`` is ``"package.module:ClassName"``."""
    if ":" not in target:
        raise ValueError(f"transport target must be 'module:Class', got {target!r}")
    with _lock:
        _TARGETS[name] = target


def transport_names() -> list[str]:
    with _lock:
        return list(_TARGETS)


def transport_class(name: str) -> type[Transport]:
    """The class registered as ``name``; raises TransportUnavailable if it cannot load."""
    with _lock:
        target = _TARGETS.get(name)
    if target is None:
        raise TransportUnavailable(f"unknown transport {name!r}; known: {transport_names()}")
    mod_name, _, cls_name = target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
        cls = getattr(mod, cls_name)
    except (ImportError, AttributeError) as e:
        raise TransportUnavailable(f"transport {name!r} cannot be loaded ({target}): {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TransportUnavailable(f"transport {name!r}: {target} is not a Transport subclass")
    return cls


def available_transports() -> dict[str, Availability]:
    """Every known transport → ``(ok, reason)``. Never raises."""
    out: dict[str, Availability] = {}
    for name in transport_names():
        try:
            out[name] = transport_class(name).usable()
        except TransportUnavailable as e:
            out[name] = Availability(False, str(e))
        except Exception as e:  # a broken engine module must not hide the others
            out[name] = Availability(False, f"{type(e).__name__}: {e}")
    return out


DATA_SECRET = "data_secret"
"""The option that keys a transport's data-plane handshake with the deployment secret
(``Secret.key(PURPOSE_DATA)``): taken by the transports whose data plane kvhandoff
authenticates itself (tcp, shm); see :func:`create_transport`."""


def create_transport(name: str = DEFAULT, *, data_secret: bytes | None = None,
                     **options: Any) -> Transport:
    """Instantiate transport ``name`` with keyword options; raises TransportUnavailable
    (with the reason) if it cannot run here.

    ``data_secret``: the deployment secret's data-plane key, passed on to a transport
    that takes a ``data_secret`` option (its handshake is then keyed with it, so an
    endpoint token alone proves nothing); the others (memory, in-process; the engines,
    whose data planes are their own) do not use it."""
    cls = transport_class(name)
    ok, reason = cls.usable()
    if not ok:
        raise TransportUnavailable(f"transport {name!r} is not usable here: {reason}")
    if data_secret is not None and DATA_SECRET in inspect.signature(cls).parameters:
        options[DATA_SECRET] = data_secret
    return cls(**options)


CUDA_TESTED: dict[str, str] = {
    "tcp": "host staging tested on an H100", "shm": "host staging tested on an H100",
    "cma": "host staging, as tcp; not yet run on a GPU",
    "auto": "host staging through cma or tcp; not yet run on a GPU",
    "nixl": "host staging tested on an H100; gpu_direct: GPU to GPU across processes "
            "tested there, host to GPU makes no progress",
    "mooncake": "untested"}
"""Transports that can move a GPU KV cache, and what has run on a GPU (``make gpu-check``;
``kvhandoff transports`` shows it). By default a GPU cache goes through a host mirror
(the vLLM connector's :class:`~kvhandoff.integrations.vllm.host_staging.HostStaging`);
nixl and mooncake can also register device memory themselves (their ``cuda=True``
option, the connector's ``gpu_direct``)."""

CUDA_STAGED_ONLY = frozenset({"tcp", "shm", "cma", "auto"})
"""Transports that move host memory only: a GPU KV cache reaches them through the host
mirror alone."""


def describe_transports() -> list[str]:
    """One line per known transport, for ``kvhandoff transports``: its name, whether it
    can run here, and why: the engine version when it can, what is missing and how to
    install it when it cannot. Capabilities follow in brackets. Never raises."""
    lines = []
    for name, (ok, reason) in available_transports().items():
        notes = ["default"] if name == DEFAULT else []
        if ok:
            try:
                caps = transport_class(name).capabilities
            except TransportUnavailable:
                caps = None
            if caps is not None:
                notes.append("cross-host" if caps.cross_host else
                             "same host" if caps.cross_process else "in-process")
                if caps.needs_allocate:
                    notes.append("destinations from allocate()")
        if name in CUDA_TESTED:
            notes.append(f"CUDA: {CUDA_TESTED[name]}")
        tail = f"  [{', '.join(notes)}]" if notes else ""
        lines.append(f"{name:<9} {'usable' if ok else 'NOT usable':<10}  {reason}{tail}")
    return lines
