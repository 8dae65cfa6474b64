"""Fixtures shared by the transport conformance suite.

Every test that takes ``name`` runs once per transport that ``available_transports()``
reports usable here; unusable ones show up as skips with their reason.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kvh_conformance import Pair, make, params


@pytest.fixture(params=params())
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pair(name: str) -> Iterator[Pair]:
    with make(name) as sender, make(name) as receiver:
        p = Pair(sender, receiver)
        yield p
        p.close()
