"""Which transport ``auto`` uses for a peer, and why. Pure: records in, a choice out.

Each side offers the transports it can run (:func:`offers`); the sender picks, per peer,
the first of its preference that both offer, from where the peer is:

* **same host and network namespace** (the endpoint's boot id and namespace match):
  ``cma`` — one copy, by cross-memory attach, straight from the sender's memory into
  the receiver's; else ``nixl`` (UCX picks its own cross-memory-attach path on one
  host); else ``tcp``.
* **another host** (or namespace), both sides with RDMA NICs: ``nixl`` (one-sided RDMA
  through UCX), else ``mooncake`` (its RDMA transport); without RDMA on both, ``tcp``:
  over plain TCP it runs at the socket's speed, ahead of NIXL over UCX's tcp and of
  Mooncake's TCP transport (``reference/baselines.md``: about 1.1× and 1.3× them on
  large transfers here, and 10–20× Mooncake's rate on small pages).

A candidate whose connect fails (the kernel refusing cross-memory attach to another
user, say) gives way to the next one; the failure is logged once.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.transport.host import HostIdentity

SAME_HOST = ("cma", "nixl", "tcp")
ACROSS_RDMA = ("nixl", "mooncake", "tcp")
ACROSS = ("tcp",)

WHY: dict[str, str] = {
    "cma": "one copy, by cross-memory attach (process_vm_readv), from the sender's memory "
           "straight into the receiver's",
    "nixl": "NIXL/UCX: one-sided RDMA across hosts, its own single-copy path on one host",
    "mooncake": "Mooncake's RDMA transport",
    "tcp": "plain sockets: as fast as the wire without RDMA, and works everywhere",
}
"""Why each transport, when it is picked (for logs and ``kvhandoff transports``)."""


@dataclass(frozen=True, slots=True)
class Offer:
    """What one side can use: its host identity, whether it has RDMA NICs, and the
    transports it offers (in no particular order)."""

    host: HostIdentity
    rdma: bool
    names: frozenset[str]


@dataclass(frozen=True, slots=True)
class Choice:
    """The transports to try for one peer, best first, and the sentence saying why."""

    names: tuple[str, ...]
    where: str

    @property
    def first(self) -> str:
        return self.names[0]

    def reason(self, name: str | None = None) -> str:
        n = name or self.first
        return f"{n} for {self.where}: {WHY.get(n, n)}"


def preference(same_host: bool, rdma: bool) -> tuple[str, ...]:
    """The order of preference for a peer on this host (or not), with RDMA on both sides
    (or not)."""
    if same_host:
        return SAME_HOST
    return ACROSS_RDMA if rdma else ACROSS


def choose(mine: Offer, theirs: Offer) -> Choice:
    """What to try for the peer that offers ``theirs``: the transports both offer, in
    this module's order for where the peer is. Empty when they share none."""
    same = mine.host.same_as(theirs.host)
    rdma = mine.rdma and theirs.rdma
    order = preference(same, rdma)
    names = tuple(n for n in order if n in mine.names and n in theirs.names)
    where = ("a peer on this host" if same else
             f"a peer on {mine.host.differs(theirs.host)}" + (" with RDMA" if rdma else ""))
    return Choice(names, where)


def wanted(usable: frozenset[str], rdma: bool) -> tuple[str, ...]:
    """The transports this side offers, from those usable here: everything a peer on this
    host or another could get by :func:`choose`, where it can run (tcp always)."""
    keep = [n for n in SAME_HOST if n in usable and n != "tcp"][:1]  # the best one only
    if rdma:
        keep += [n for n in ACROSS_RDMA if n in usable and n not in keep and n != "tcp"][:1]
    return (*keep, "tcp")


def summary(offered: tuple[str, ...], rdma: bool) -> str:
    """One line: what ``auto`` picks for a peer on this host and for one elsewhere, and
    why (assuming the peer offers the same)."""
    here = next(n for n in SAME_HOST if n in offered or n == "tcp")
    away = next(n for n in preference(False, rdma) if n in offered or n == "tcp")
    return (f"auto picks {here} for a peer on this host ({WHY[here]}); {away} for one on "
            f"another host or network namespace ({WHY[away]}"
            + ("" if rdma else "; no RDMA NIC here") + ")")
