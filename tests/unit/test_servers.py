"""The lab's server helpers that need no server: SIGTERM turned into an exception, and the
ports a server is given to bind later."""

from __future__ import annotations

import contextlib
import signal
import socket
from pathlib import Path

import pytest

from kvhandoff.lab.servers import free_ports, raising_on_sigterm


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


def test_ports_for_later_lie_where_no_bind_to_port_0_can_take_them() -> None:
    """A server that loads a model for a minute before it binds its port must still find it
    free: no bind to port 0 (any server's data port, libzmq, torch's store) may take it
    meanwhile. Ports come from below the kernel's ephemeral range, never twice."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    given = free_ports(8) + [p for _ in range(40) for p in free_ports(2)]
    assert len(set(given)) == len(given), "a port handed out twice"
    assert all(1024 <= p < ephemeral_low for p in given), given
    with contextlib.ExitStack() as stack:
        taken = set()
        for _ in range(200):
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            taken.add(s.getsockname()[1])
    assert not taken & set(given)
    for p in given[:8]:  # and they were free: a server can bind each
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
