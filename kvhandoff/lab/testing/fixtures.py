"""Pytest fixtures of the session-level tests (``tests/faults``, ``tests/security``): a
bootstrap server that must end empty, fresh instance names, the in-process rig
(:mod:`kvhandoff.lab.testing.rig`) and a check that no ``kvh-*`` thread outlives a test.
A ``conftest.py`` or a test module imports the ones it uses."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.rig import Rig, kvh_threads

_names = itertools.count()


@pytest.fixture
def bootstrap() -> Iterator[BootstrapServer]:
    with BootstrapServer() as srv:
        yield srv
        assert srv.registry.health().ranks == 0, "a registration outlived its agent"


@pytest.fixture
def instance(request: pytest.FixtureRequest) -> str:
    return f"{request.node.path.parent.name}-{next(_names)}"


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 5
    while kvh_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not kvh_threads(), f"threads left running: {kvh_threads()}"


@pytest.fixture
def rig(bootstrap: BootstrapServer, instance: str) -> Iterator[Rig]:
    r = Rig(bootstrap.url, instance)
    yield r
    r.close()
    assert r.prefill.live_requests == 0 and r.decode.live_requests == 0
