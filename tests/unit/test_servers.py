"""The lab's server helpers that need no server: SIGTERM turned into an exception."""

from __future__ import annotations

import signal

import pytest

from kvhandoff.lab.servers import raising_on_sigterm


class Stopped(Exception):
    pass


def test_sigterm_raises_inside_and_the_old_handler_is_back_after() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped, match=f"signal {int(signal.SIGTERM)}"), \
            raising_on_sigterm(lambda signum: Stopped(f"signal {signum}")):
        assert signal.getsignal(signal.SIGTERM) is not before
        signal.raise_signal(signal.SIGTERM)  # the handler raises as this returns
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_exit_code_unwinds_as_system_exit() -> None:
    """The SGLang demo's use: the process ends 128 + SIGTERM, its servers stopped."""
    with pytest.raises(SystemExit) as e, \
            raising_on_sigterm(lambda signum: SystemExit(128 + signum)):
        signal.raise_signal(signal.SIGTERM)
    assert e.value.code == 128 + signal.SIGTERM
