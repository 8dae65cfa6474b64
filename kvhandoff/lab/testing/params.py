"""Pytest parameters over transports. Test support.

:func:`transport_params` is how every test parametrised by transport name gets its
list: one param per name, and one that cannot run on this machine is *skipped with
the reason* its availability probe gives (what to install), never left out silently.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from kvhandoff.transport import available_transports


def transport_params(names: Iterable[str] | None = None) -> list[Any]:
    """One ``pytest.param`` per transport of ``names`` (default: every known one), with
    the name as its id; skipped, naming the reason, where that transport is not usable."""
    avail = available_transports()
    return [pytest.param(n, id=n, marks=[] if avail[n].ok else [
        pytest.mark.skip(reason=f"{n}: {avail[n].reason}")])
        for n in (avail if names is None else names)]
