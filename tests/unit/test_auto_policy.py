"""What ``auto`` picks for a peer, from where it is and what both sides offer (pure)."""

from __future__ import annotations

import pytest

from kvhandoff.transport.auto.policy import Offer, choose, summary, wanted
from kvhandoff.transport.host import HostIdentity

HERE = HostIdentity("boot-a", "net:[1]")
OTHER_NS = HostIdentity("boot-a", "net:[2]")
OTHER_HOST = HostIdentity("boot-b", "net:[1]")
ALL = frozenset({"cma", "nixl", "mooncake", "tcp"})


def offer(host: HostIdentity, names: set[str] | frozenset[str], rdma: bool = False) -> Offer:
    return Offer(host, rdma, frozenset(names))


@pytest.mark.parametrize(("peer", "mine", "theirs", "rdma", "want"), [
    (HERE, ALL, ALL, False, ("cma", "nixl", "tcp")),
    (HERE, ALL, {"nixl", "tcp"}, False, ("nixl", "tcp")),  # the peer cannot attach
    (HERE, {"cma", "tcp"}, {"tcp"}, False, ("tcp",)),
    (OTHER_NS, ALL, ALL, False, ("tcp",)),  # same machine, another namespace: a host
    (OTHER_HOST, ALL, ALL, False, ("tcp",)),
    (OTHER_HOST, ALL, ALL, True, ("nixl", "mooncake", "tcp")),
    (OTHER_HOST, ALL, {"mooncake", "tcp"}, True, ("mooncake", "tcp")),
    (OTHER_HOST, {"cma"}, {"cma"}, False, ()),  # nothing that reaches it
])
def test_choice(peer: HostIdentity, mine: frozenset[str], theirs: set[str], rdma: bool,
                want: tuple[str, ...]) -> None:
    c = choose(offer(HERE, mine, rdma), offer(peer, theirs, rdma))
    assert c.names == want


def test_rdma_counts_only_when_both_sides_have_it() -> None:
    c = choose(offer(HERE, ALL, True), offer(OTHER_HOST, ALL, False))
    assert c.names == ("tcp",) and "RDMA" not in c.where


def test_reasons_say_where_and_why() -> None:
    assert choose(offer(HERE, ALL), offer(HERE, ALL)).reason() == (
        "cma for a peer on this host: one copy, by cross-memory attach (process_vm_readv), "
        "from the sender's memory straight into the receiver's")
    away = choose(offer(HERE, ALL), offer(OTHER_NS, ALL))
    assert "another network namespace" in away.reason() and away.first == "tcp"
    assert "another machine" in choose(offer(HERE, ALL), offer(OTHER_HOST, ALL)).where


def test_an_unknown_namespace_is_never_the_same_host() -> None:
    blind = HostIdentity("boot-a", "")
    assert not blind.same_as(blind)
    assert choose(offer(blind, ALL), offer(blind, ALL)).first == "tcp"


@pytest.mark.parametrize(("usable", "rdma", "want"), [
    (ALL, False, ("cma", "tcp")),
    (ALL, True, ("cma", "nixl", "tcp")),
    (frozenset({"nixl", "tcp"}), False, ("nixl", "tcp")),  # no cross-memory attach here
    (frozenset({"mooncake", "tcp"}), True, ("mooncake", "tcp")),
    (frozenset({"tcp"}), True, ("tcp",)),
])
def test_what_a_side_offers(usable: frozenset[str], rdma: bool, want: tuple[str, ...]) -> None:
    assert wanted(usable, rdma) == want


def test_summary_names_both_cases() -> None:
    line = summary(("cma", "tcp"), rdma=False)
    assert line.startswith("auto picks cma for a peer on this host")
    assert "tcp for one on another host or network namespace" in line
    assert "no RDMA NIC here" in line
    assert summary(("tcp",), rdma=False).startswith("auto picks tcp for a peer on this host")
