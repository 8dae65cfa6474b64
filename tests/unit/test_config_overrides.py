"""Session timeouts: their defaults, and who wins — code/CLI flag > ``KVHANDOFF_*`` > default.

The environment path is checked on real agents built without a config (what the demo's
workers and the engine's links do); the CLI path through ``kvhandoff demo``'s parser up to
the :class:`~kvhandoff.lab.demo_worker.WorkerSpec` each worker process is started with.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvhandoff.lab import cli, demo
from kvhandoff.lab.demo_worker import WorkerSpec, decode_main, session_config
from kvhandoff.lab.servers import dead_url
from kvhandoff.lab.testing.handoff import DECODE, PREFILL, Arena, Topology, layout_of
from kvhandoff.session import Agent, BootstrapFailed, Receiver, SessionConfig, Status
from kvhandoff.session.config import (
    TIMEOUT_FIELDS,
    add_timeout_arguments,
    env_name,
    env_of,
    timeout_overrides,
)

DEFAULTS = {"bootstrap_timeout": 30.0, "indices_timeout": 300.0, "lease": 30.0,
            "waiting_timeout": 300.0, "transfer_timeout": 60.0, "release_timeout": 30.0,
            "heartbeat_interval": 1.0, "heartbeat_timeout": 5.0}
TOPO = Topology(shape="qwen3_next", num_pages=32)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``KVHANDOFF_<FIELD>`` from the caller's shell; and whatever a test (or
    :func:`session_config`) writes there is undone afterwards."""
    for f in dataclasses.fields(SessionConfig):
        monkeypatch.setenv(env_name(f.name), "")  # recorded, so restored on teardown
        monkeypatch.delenv(env_name(f.name))


# -- (i) defaults -----------------------------------------------------------------------------
def test_defaults_are_the_documented_ones() -> None:
    cfg = SessionConfig()
    assert {f: getattr(cfg, f) for f in TIMEOUT_FIELDS} == DEFAULTS
    assert SessionConfig.from_env({}) == cfg == SessionConfig.from_env()  # env is clean here
    from kvhandoff.session import config as module

    documented = dict(re.findall(r"``(\w+)`` \[(\d+)\]", module.__doc__ or ""))
    assert {k: float(v) for k, v in documented.items()} == DEFAULTS


def test_help_names_every_flag_env_and_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name, default in DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        assert f"{flag} S" in text and f"env {env_name(name)}; default {default:g})" in text


# -- (ii) the environment reaches an agent built without a config ------------------------------
def test_env_timeout_reaches_a_decode_agent_without_config(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVHANDOFF_BOOTSTRAP_TIMEOUT", "1")
    monkeypatch.setenv("KVHANDOFF_HEARTBEAT_TIMEOUT", "2.5")
    dst = layout_of(TOPO, DECODE, 0, 0, Arena((0, 1, 0, 0, 0)))
    with Agent.decode(dst) as d:
        assert d.config.bootstrap_timeout == 1.0 and d.config.heartbeat_timeout == 2.5
        assert d.config.transfer_timeout == DEFAULTS["transfer_timeout"]
        t0 = time.monotonic()
        r = Receiver(d, dead_url(), 1)
        assert r.wait(10) is Status.FAILED  # the default (30 s) would not fail in 10
        took = time.monotonic() - t0
        assert isinstance(r.error, BootstrapFailed)
        assert "bootstrap_timeout (1 s)" in str(r.error)
        assert took < 5, f"failed after {took:.1f} s, not ~1 s"
        assert r.released and d.live_requests == 0


def test_env_reaches_a_prefill_agent_without_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad value in the environment stops prefill before it binds or registers anything:
    so the agent did read it."""
    monkeypatch.setenv("KVHANDOFF_INDICES_TIMEOUT", "-3")
    src = layout_of(TOPO, PREFILL, 0, 0, Arena((0, 0, 0, 0, 0)))
    with pytest.raises(ValueError, match=r"indices_timeout must be a positive.*"
                                         r"KVHANDOFF_INDICES_TIMEOUT='-3'"):
        Agent.prefill(src, bootstrap_url=dead_url())


# -- (iii) code and flags beat the environment -------------------------------------------------
def test_keyword_and_explicit_config_beat_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVHANDOFF_BOOTSTRAP_TIMEOUT", "1")
    monkeypatch.setenv("KVHANDOFF_TRANSFER_TIMEOUT", "9")
    cfg = SessionConfig.from_env(bootstrap_timeout=2.0)
    assert cfg.bootstrap_timeout == 2.0 and cfg.transfer_timeout == 9.0
    # keywords may also repair what the environment alone would make invalid
    monkeypatch.setenv("KVHANDOFF_HEARTBEAT_INTERVAL", "10")
    with pytest.raises(ValueError, match="KVHANDOFF_HEARTBEAT_INTERVAL='10'"):
        SessionConfig.from_env()
    assert SessionConfig.from_env(heartbeat_timeout=20.0).heartbeat_interval == 10.0
    monkeypatch.delenv("KVHANDOFF_HEARTBEAT_INTERVAL")
    dst = layout_of(TOPO, DECODE, 0, 0, Arena((0, 1, 0, 0, 0)))
    with Agent.decode(dst, config=SessionConfig(bootstrap_timeout=4.0)) as d:
        assert d.config.bootstrap_timeout == 4.0  # an explicit config ignores the env
        assert d.config.transfer_timeout == DEFAULTS["transfer_timeout"]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add_timeout_arguments(parser)
    return parser.parse_args(argv)


def test_flags_parse_into_overrides_only_when_given() -> None:
    assert timeout_overrides(_parse([])) == {}
    args = _parse(["--bootstrap-timeout", "7", "--heartbeat-interval", "0.5",
                   "--transfer-timeout=1e2"])
    assert timeout_overrides(args) == {"bootstrap_timeout": 7.0, "heartbeat_interval": 0.5,
                                       "transfer_timeout": 100.0}
    argv = [a for f in TIMEOUT_FIELDS for a in ("--" + f.replace("_", "-"), "11")]
    assert timeout_overrides(_parse(argv)) == dict.fromkeys(TIMEOUT_FIELDS, 11.0)


@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan", "inf", ""])
def test_non_positive_flag_is_refused_naming_it(value: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", f"--waiting-timeout={value}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --waiting-timeout: must be a positive number of seconds" in err
    assert repr(value) in err


# -- (iv) a malformed environment ----------------------------------------------------------------
@pytest.mark.parametrize(("var", "value", "why"), [
    ("KVHANDOFF_TRANSFER_TIMEOUT", "soon", "could not convert"),
    ("KVHANDOFF_BOOTSTRAP_TIMEOUT", "0", "bootstrap_timeout must be a positive"),
    ("KVHANDOFF_WORKERS", "2.5", "invalid literal for int"),
    ("KVHANDOFF_CHECKSUM", "maybe", "expected a boolean"),
])
def test_malformed_env_names_the_variable(monkeypatch: pytest.MonkeyPatch, var: str,
                                          value: str, why: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=re.escape(f"{var}={value!r}")) as e:
        SessionConfig.from_env()
    assert why in str(e.value)
    dst = layout_of(TOPO, DECODE, 0, 0, Arena((0, 1, 0, 0, 0)))
    with pytest.raises(ValueError, match=re.escape(var)):
        Agent.decode(dst)  # no config: the agent reads the same environment


# -- (v) the demo's flags reach both workers -----------------------------------------------------
def _capture_specs(monkeypatch: pytest.MonkeyPatch) -> list[WorkerSpec]:
    """Make ``demo.run`` start no process: record each worker's spec, then stop."""
    specs: list[WorkerSpec] = []

    @contextmanager
    def fake(target: Callable[..., None], spec: WorkerSpec) -> Iterator[tuple[Any, Any]]:
        specs.append(spec)
        if target is decode_main:
            raise demo.DemoError("stopped by the test")
        yield None, None

    monkeypatch.setattr(demo, "_worker", fake)
    return specs


def test_demo_flags_reach_both_workers_config(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVHANDOFF_BOOTSTRAP_TIMEOUT", "3")  # the flag wins
    monkeypatch.setenv("KVHANDOFF_INDICES_TIMEOUT", "44")  # no flag: env applies
    specs = _capture_specs(monkeypatch)
    assert cli.main(["demo", "--bootstrap-timeout", "7", "--release-timeout", "2",
                     "--heartbeat-interval", "0.5", "--heartbeat-timeout", "4"]) == 2
    out, err = capsys.readouterr()
    assert "stopped by the test" in err
    assert "bootstrap_timeout 7 s, release_timeout 2 s" in out
    assert [s.tp for s in specs] == [2, 1]  # prefill, then decode
    want = {"bootstrap_timeout": 7.0, "release_timeout": 2.0, "heartbeat_interval": 0.5,
            "heartbeat_timeout": 4.0}
    for spec in specs:
        assert spec.session == want
        cfg = session_config(spec)  # what the worker process computes before its agents
        assert (cfg.bootstrap_timeout, cfg.indices_timeout, cfg.waiting_timeout,
                cfg.transfer_timeout, cfg.release_timeout, cfg.heartbeat_interval,
                cfg.heartbeat_timeout) == (7.0, 44.0, 300.0, 60.0, 2.0, 0.5, 4.0)
        # ...and the agents its links build without a config see the same
        assert os.environ["KVHANDOFF_BOOTSTRAP_TIMEOUT"] == "7.0"
        assert SessionConfig.from_env() == cfg


def test_demo_without_flags_leaves_env_and_defaults(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVHANDOFF_TRANSFER_TIMEOUT", "12")
    specs = _capture_specs(monkeypatch)
    assert cli.main(["demo"]) == 2
    capsys.readouterr()
    assert [s.session for s in specs] == [{}, {}]
    cfg = session_config(specs[1])
    assert cfg.transfer_timeout == 12.0 and cfg.bootstrap_timeout == DEFAULTS["bootstrap_timeout"]


def test_demo_refuses_a_bad_env_before_starting_workers(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVHANDOFF_HEARTBEAT_INTERVAL", "10")  # > the default timeout (5)
    specs = _capture_specs(monkeypatch)
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert "heartbeat_timeout (5.0) must be at least heartbeat_interval (10.0)" in err
    assert "KVHANDOFF_HEARTBEAT_INTERVAL='10'" in err and specs == []
    assert cli.main(["demo", "--heartbeat-timeout", "30"]) == 2  # the flag repairs it
    assert "stopped by the test" in capsys.readouterr().err and len(specs) == 2


def test_env_of_round_trips() -> None:
    over = {"bootstrap_timeout": 0.1, "workers": 3, "checksum": True, "instance": "pd-a"}
    env = env_of(over)
    assert env["KVHANDOFF_BOOTSTRAP_TIMEOUT"] == "0.1" and env["KVHANDOFF_CHECKSUM"] == "1"
    cfg = SessionConfig.from_env(env)
    assert {k: getattr(cfg, k) for k in over} == over
    with pytest.raises(ValueError, match="not a SessionConfig field"):
        env_of({"bootstrap_timeot": 1.0})
