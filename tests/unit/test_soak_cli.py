"""``kvhandoff soak``'s flags (nothing is run)."""

from __future__ import annotations

import argparse

import pytest

from kvhandoff.lab.cli import main
from kvhandoff.lab.soak.cli import add_arguments, transports


def test_soak_is_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["soak", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--minutes" in out and "--netcut" in out and "--seed" in out


def test_flags_and_transports() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--minutes", "60", "--transports", "tcp,shm", "--netcut", "off"])
    assert (args.minutes, args.seconds, args.netcut, args.json) == (60.0, None, "off",
                                                                     "soak.json")
    assert transports("tcp, shm") == ("tcp", "shm")
    assert {"tcp", "shm"} <= set(transports("auto")) and "memory" not in transports("auto")
    with pytest.raises(SystemExit, match="not usable here: nope"):
        transports("tcp,nope")
