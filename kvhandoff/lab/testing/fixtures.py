"""Pytest fixtures of the session-level tests (``tests/faults``, ``tests/security``): a
bootstrap server that must end empty, fresh instance names, the in-process rig
(:mod:`kvhandoff.lab.testing.rig`) and a check that no ``kvh-*`` thread outlives a test.
A ``conftest.py`` or a test module imports the ones it uses.

``bootstrap`` and ``rig`` are a default deployment: the user's default secret signs and
keys everything. ``open_bootstrap`` and ``open_rig`` are one run ``insecure``
(:data:`OPEN`), for the tests whose hostile peer must get as far as a handshake without
the secret (what a holder of the secret can do anyway)."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.rig import Rig, kvh_threads
from kvhandoff.lab.vllm.serve import vllm_python

_names = itertools.count()
OPEN: dict[str, Any] = {"insecure": True}
"""The session config of an open deployment (no secret: anyone who reaches it is in)."""


def _served(srv: BootstrapServer) -> Iterator[BootstrapServer]:
    with srv:
        yield srv
        assert srv.registry.health().ranks == 0, "a registration outlived its agent"


@pytest.fixture
def bootstrap() -> Iterator[BootstrapServer]:
    yield from _served(BootstrapServer())


@pytest.fixture
def open_bootstrap() -> Iterator[BootstrapServer]:
    yield from _served(BootstrapServer(insecure=True))


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


def _rigged(r: Rig) -> Iterator[Rig]:
    yield r
    r.close()
    assert r.prefill.live_requests == 0 and r.decode.live_requests == 0


@pytest.fixture
def rig(bootstrap: BootstrapServer, instance: str) -> Iterator[Rig]:
    yield from _rigged(Rig(bootstrap.url, instance))


@pytest.fixture
def open_rig(open_bootstrap: BootstrapServer, instance: str) -> Iterator[Rig]:
    yield from _rigged(Rig(open_bootstrap.url, instance, prefill_cfg=OPEN, decode_cfg=OPEN))


def vllm_or_skip() -> Path:
    """The python of ``.venv-vllm`` (for tests of real vLLM servers): skip the test when
    it is missing, saying how to make it; in CI (``CI`` set) fail instead."""
    py = vllm_python()
    if not py.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{py} is missing: `make test` builds it with `make vllm-venv`")
        pytest.skip(f"{py} is missing; run `make vllm-venv` (make test does)")
    return py
