"""A role is a type: a prefill rank is a ``PrefillAgent``, a decode rank a ``DecodeAgent``.

The type checker is the test of the first half: a snippet of right calls must check
clean under ``mypy --strict``, and every line of a snippet of role-wrong calls (a Sender
on a decode agent, a decode method on a prefill agent, an agent whose role is not known)
must be refused, each on its own line. The factories are the second half: ``Agent(...,
role=...)``, ``Agent.decode`` and ``as_prefill`` / ``as_decode`` hand back (or refuse) the
role's class at run time.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from mypy import api

from kvhandoff.lab.testing.handoff import DECODE, Arena, Topology, layout_of
from kvhandoff.session import Agent, DecodeAgent, PrefillAgent, Role, as_decode, as_prefill

ROOT = Path(__file__).resolve().parents[2]

SNIPPET = '''
from kvhandoff.integrations import (
    Agent, DecodeAgent, PrefillAgent, Receiver, Role, Sender, SessionConfig, open_rank)
from kvhandoff.layout import Layout


def right(p: PrefillAgent, d: DecodeAgent, lay: Layout, cfg: SessionConfig) -> None:
    Sender(p, 1)
    Receiver(d, "h:1", 1)
    d.handshake("h:1")
    p.write_failed
    Sender(Agent(lay, role="prefill", bootstrap_url="http://h:1"), 2)
    Receiver(Agent(lay, role=Role.DECODE), "h:1", 2)
    Sender(Agent.prefill(lay, bootstrap_url="http://h:1"), 3)
    Receiver(Agent.decode(lay), "h:1", 3)
    Sender(open_rank(lay, cfg, role=Role.PREFILL, bootstrap_url="http://h:1"), 4)
    Receiver(open_rank(lay, cfg, role="decode"), "h:1", 4)


def wrong(p: PrefillAgent, d: DecodeAgent, a: Agent, lay: Layout, cfg: SessionConfig,
          role: Role) -> None:
    Sender(d, 1)  # WRONG
    Receiver(p, "h:1", 1)  # WRONG
    p.handshake("h:1")  # WRONG
    d.defer_write  # WRONG
    a.groups  # WRONG
    Sender(a, 1)  # WRONG
    Receiver(Agent(lay, role="prefill", bootstrap_url="http://h:1"), "h:1", 2)  # WRONG
    Sender(Agent.decode(lay), 3)  # WRONG
    Sender(open_rank(lay, cfg, role=role), 4)  # WRONG
'''


def test_role_wrong_calls_are_type_errors_and_right_ones_are_not(tmp_path: Path) -> None:
    src = tmp_path / "roles_snippet.py"
    src.write_text(textwrap.dedent(SNIPPET))
    out, err, _ = api.run([str(src), "--config-file", str(ROOT / "pyproject.toml"),
                           "--cache-dir", str(ROOT / ".mypy_cache"), "--no-error-summary",
                           "--hide-error-context"])
    assert err == "", err
    lines = src.read_text().splitlines()
    flagged = {int(m.group(1)) for m in re.finditer(r"roles_snippet\.py:(\d+): error", out)}
    wrong = {i for i, line in enumerate(lines, 1) if line.endswith("# WRONG")}
    assert len(wrong) == 9
    assert flagged == wrong, out  # every wrong line refused, no right line refused


TOPO = Topology(shape="qwen3_next", num_pages=8)


def test_the_factories_return_the_roles_class() -> None:
    dst = layout_of(TOPO, DECODE, 0, 0, Arena((0, 1, 0, 0, 0)))
    with Agent(dst, role="decode") as d:
        assert type(d) is DecodeAgent and d.role is Role.DECODE
        assert as_decode(d) is d
        with pytest.raises(TypeError, match="a prefill agent is needed here, got <DecodeAgent"):
            as_prefill(d)
        assert d.stats["decode_peers"] == 0 and d.stats["prefill_peers"] == 0
    with Agent.decode(dst) as d2:
        assert type(d2) is DecodeAgent


def test_a_role_class_refuses_the_other_role_and_agent_needs_one() -> None:
    dst = layout_of(TOPO, DECODE, 0, 0, Arena((0, 1, 0, 0, 0)))
    with pytest.raises(ValueError, match="a PrefillAgent is a prefill agent, not a decode one"):
        PrefillAgent(dst, role="decode", bootstrap_url="http://127.0.0.1:1")
    with pytest.raises(TypeError, match="needs role="):
        Agent(dst)
    with pytest.raises(ValueError, match="a prefill agent needs bootstrap_url"):
        Agent(dst, role=Role.PREFILL)
