"""The GIL switch interval an engine rank runs with (kvhandoff.integrations.gil)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest

from kvhandoff.integrations.gil import quicken
from kvhandoff.integrations.rank import open_rank
from kvhandoff.lab.testing.handoff import DECODE, Arena, Topology, layout_of
from kvhandoff.lab.testing.transport import BusyLoop
from kvhandoff.session import Role
from kvhandoff.session.config import SessionConfig


@pytest.fixture(autouse=True)
def _interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # CPython's default, whatever ran before
    yield
    sys.setswitchinterval(before)


def test_a_longer_interval_is_lowered_and_a_shorter_one_kept() -> None:
    assert quicken(100) == pytest.approx(1e-4)
    assert sys.getswitchinterval() == pytest.approx(1e-4)
    assert quicken(500) == pytest.approx(1e-4)  # already shorter: kept
    assert sys.getswitchinterval() == pytest.approx(1e-4)


def test_zero_leaves_the_interpreter_alone() -> None:
    assert quicken(0) == pytest.approx(0.005)
    assert sys.getswitchinterval() == pytest.approx(0.005)


@pytest.mark.parametrize(("us", "want"), [(100, 1e-4), (0, 0.005)])
def test_an_engine_rank_opens_with_the_configured_interval(us: float, want: float) -> None:
    """open_rank, the one way the engine adapters (vLLM, SGLang, the lab's engine) open a
    rank, sets it: their I/O threads run inside the engine's busy loop."""
    dst = layout_of(Topology(shape="qwen3_next", num_pages=8), DECODE, 0, 0,
                    Arena((0, 1, 0, 0, 0)))
    cfg = SessionConfig(transport="tcp", insecure=True, switch_interval_us=us)
    with open_rank(dst, cfg, role=Role.DECODE):
        assert sys.getswitchinterval() == pytest.approx(want)


def test_the_config_reads_it_from_the_environment_and_refuses_nonsense() -> None:
    assert SessionConfig().switch_interval_us == 100
    assert SessionConfig.from_env({"KVHANDOFF_SWITCH_INTERVAL_US": "20"}).switch_interval_us == 20
    assert SessionConfig.from_env({"KVHANDOFF_SWITCH_INTERVAL_US": "0"}).switch_interval_us == 0
    with pytest.raises(ValueError, match=r"switch_interval_us .*got -1.*KVHANDOFF_SWITCH_INTER"):
        SessionConfig.from_env({"KVHANDOFF_SWITCH_INTERVAL_US": "-1"})
    with pytest.raises(ValueError, match="switch_interval_us"):
        SessionConfig(switch_interval_us=float("nan"))


def test_the_busy_loop_turns_and_gives_the_interval_back() -> None:
    """The benchmark's engine stand-in: it runs, sets the interval while it does, and
    puts the one before back when it stops."""
    loop = BusyLoop()
    loop.spin(2e-4)
    assert sys.getswitchinterval() == pytest.approx(2e-4)
    turns = loop.turns
    for _ in range(10_000):  # bounded; each sleep hands the loop the GIL
        if loop.turns > turns:
            break
        time.sleep(0.001)
    loop.stop()
    assert loop.turns > turns
    assert sys.getswitchinterval() == pytest.approx(0.005)
