"""A prefill rank that crashed leaves its registration behind; its replacement takes the
slot over once the old endpoint does not answer. A live holder is never displaced."""

from __future__ import annotations

import pytest

from kvhandoff.bootstrap.client import InstanceInfo
from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.handoff import PREFILL, Arena, Topology, layout_of
from kvhandoff.lab.testing.rig import config
from kvhandoff.session import Agent, BootstrapFailed

TOPO = Topology(shape="qwen3_next", num_pages=16)


def _agent(url: str, instance: str) -> Agent:
    src = layout_of(TOPO, PREFILL, 0, 0, Arena((0, 0, 0, 0, 0)))
    return Agent.prefill(src, bootstrap_url=url, config=config(instance))


def test_a_dead_ranks_registration_is_replaced(bootstrap: BootstrapServer,
                                               instance: str) -> None:
    crashed = _agent(bootstrap.url, instance)
    old = crashed.endpoint
    crashed._record = None  # as if the process died: no deregistration
    crashed.close()
    with _agent(bootstrap.url, instance) as again:
        info = bootstrap.registry.lookup(instance)
        assert isinstance(info, InstanceInfo)
        assert [r.control_endpoint for r in info.ranks] == [again.endpoint] != [old]


def test_a_live_holder_keeps_its_slot(bootstrap: BootstrapServer, instance: str) -> None:
    with _agent(bootstrap.url, instance), pytest.raises(BootstrapFailed, match="live rank"):
        _agent(bootstrap.url, instance)
