"""One way to open a rank: where the engine's memory is registered, and the agent over a
transport keyed by the deployment secret.

An engine's KV cache reaches a transport in one of three ways (:class:`How`):

* **in place**: the transport registers the engine's tensors as they are (host memory
  over any transport; GPU memory over nixl and mooncake, which register it themselves);
* **mirror**: a host mirror of the tensors is registered and a request's blocks are
  copied through it (GPU memory over tcp or shm; forced by an engine's own option);
* **relocate**: the engine moves its buffers into memory the transport allocated, once,
  before registering them.

A decode rank on a transport that writes only into memory from its own ``allocate`` (shm)
cannot be in place: its memory comes from the transport (a mirror or a relocation), so
that transport is made *before* the layout (:func:`open_transport`, keyed like every
rank's). :func:`placement` is the decision, pure; each engine carries out its mirror or
relocation with its own tensors, and :func:`open_rank` opens the agent.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import overload

from kvhandoff.errors import LayoutError
from kvhandoff.integrations.gil import quicken
from kvhandoff.layout import Layout
from kvhandoff.session.config import SessionConfig
from kvhandoff.session.rank.agent import (
    Agent,
    DecodeAgent,
    DecodeRole,
    PrefillAgent,
    PrefillRole,
    Role,
)
from kvhandoff.session.rank.io import open_transport
from kvhandoff.transport.base import Transport
from kvhandoff.transport.registry import CUDA_STAGED_ONLY, CUDA_TESTED, transport_class

__all__ = ["How", "Placement", "open_rank", "open_transport", "placement"]


class How(enum.StrEnum):
    IN_PLACE = "in_place"
    MIRROR = "mirror"
    RELOCATE = "relocate"


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Where one rank's engine memory is registered.

    ``own_memory``: the memory registered must come from the transport's ``allocate``
    (make it with :func:`open_transport` first, allocate, then hand it to
    :func:`open_rank`); ``device``: the transport registers GPU memory itself (its
    ``cuda`` option, which :meth:`transport_options` adds)."""

    how: How
    own_memory: bool = False
    device: bool = False

    def transport_options(self) -> dict[str, object]:
        return {"cuda": True} if self.device else {}


def placement(transport: str, *, producer: bool, cuda: bool = False, mirror: bool = False,
              relocate: bool = False, force_mirror: bool = False,
              gpu_direct: bool = False, engine: str = "the engine") -> Placement:
    """Decide where a rank's memory is registered. ``producer``: a prefill rank;
    ``cuda``: the engine's cache is in GPU memory; ``mirror`` / ``relocate``: what the
    engine can do (keep a host mirror; move its buffers); ``force_mirror``: the engine's
    own option to mirror anyway; ``gpu_direct``: let nixl or mooncake register GPU memory.

    Raises :class:`~kvhandoff.errors.LayoutError` naming the transport and what the
    engine would need, when no way fits."""
    if cuda and transport not in CUDA_TESTED:
        raise LayoutError(f"{engine}'s KV cache is in GPU memory, which transport "
                          f"{transport!r} cannot move; use one of {sorted(CUDA_TESTED)}")
    if gpu_direct and transport in CUDA_STAGED_ONLY:
        if cuda and not mirror:
            raise LayoutError(f"{engine}'s KV cache is in GPU memory and transport "
                              f"{transport!r} moves host memory only ({engine} keeps no host "
                              f"mirror); use nixl or mooncake, which register GPU memory")
        raise LayoutError(f"gpu_direct: transport {transport!r} moves host memory only; "
                          f"nixl and mooncake can register GPU memory")
    own = not producer and transport_class(transport).capabilities.needs_allocate
    wants_mirror = force_mirror or (cuda and not gpu_direct)
    if own and relocate and not wants_mirror:
        return Placement(how=How.RELOCATE, own_memory=True)
    if own or wants_mirror:
        if not mirror:
            why = (f"transport {transport!r} writes only into memory from its "
                   f"allocate()" if own else "its GPU memory needs a host mirror over "
                   f"transport {transport!r}")
            raise LayoutError(f"{engine} cannot register its KV cache: {why}, and "
                              f"{engine} can neither mirror nor move its buffers; use tcp, "
                              f"mooncake or nixl")
        return Placement(how=How.MIRROR, own_memory=own)
    return Placement(how=How.IN_PLACE, device=cuda)


@overload
def open_rank(layout: Layout, config: SessionConfig, *, role: PrefillRole,
              bootstrap_url: str | None = None, transport: Transport | None = None,
              dp_rank: int = 0, dp_size: int = 1, name: str = "") -> PrefillAgent: ...


@overload
def open_rank(layout: Layout, config: SessionConfig, *, role: DecodeRole,
              bootstrap_url: str | None = None, transport: Transport | None = None,
              dp_rank: int = 0, dp_size: int = 1, name: str = "") -> DecodeAgent: ...


@overload
def open_rank(layout: Layout, config: SessionConfig, *, role: Role | str,
              bootstrap_url: str | None = None, transport: Transport | None = None,
              dp_rank: int = 0, dp_size: int = 1, name: str = "") -> Agent: ...


def open_rank(layout: Layout, config: SessionConfig, *, role: Role | str,
              bootstrap_url: str | None = None, transport: Transport | None = None,
              dp_rank: int = 0, dp_size: int = 1, name: str = "") -> Agent:
    """The rank's agent, of the role's class (:class:`PrefillAgent` or
    :class:`DecodeAgent`; typed so when ``role`` is a literal, else narrow it with
    :func:`as_prefill` / :func:`as_decode`): ``layout`` registered with ``transport`` (one made by
    :func:`open_transport`, when the memory came from it) or, by default, with a new
    transport keyed by ``config``'s deployment secret. The agent owns the transport
    either way (closing the agent closes it). A prefill rank registers with the bootstrap
    server at ``bootstrap_url``. The process's GIL switch interval is lowered to
    ``config.switch_interval_us`` (:mod:`kvhandoff.integrations.gil`)."""
    quicken(config.switch_interval_us)
    return Agent(layout, role=role, config=config, transport=transport, own_transport=True,
                 bootstrap_url=bootstrap_url, dp_rank=dp_rank, dp_size=dp_size, name=name)
