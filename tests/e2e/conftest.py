"""Collection for the end-to-end suite: SGLang's PD rows run every model over kvhandoff
and one over SGLang's own backend (:func:`kvhandoff.lab.testing.sglang.backends_for`)."""

from __future__ import annotations

import pytest

from kvhandoff.lab.testing.sglang import deselect_uncovered


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, dropped = deselect_uncovered(items)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
