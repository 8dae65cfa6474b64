"""The served transports' constructor options (``ServedTransport``): a bad value is
refused before anything is opened, with one message naming every bad option."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvhandoff.transport.cma.transport import CmaTransport
from kvhandoff.transport.framing.served import ServedTransport
from kvhandoff.transport.shm.transport import ShmTransport
from kvhandoff.transport.tcp.transport import TcpTransport

Make = Callable[..., ServedTransport]
OWN_COUNT: list[tuple[Make, str, str]] = [(TcpTransport, "tcp", "connections"),
                                          (ShmTransport, "shm", "copy_threads"),
                                          (CmaTransport, "cma", "copy_threads")]


@pytest.mark.parametrize(("cls", "name", "count"), OWN_COUNT, ids=[n for _, n, _ in OWN_COUNT])
def test_every_bad_option_is_named_at_once(cls: Make, name: str, count: str) -> None:
    with pytest.raises(ValueError) as e:
        cls(**{"io_timeout": 0.0, "max_connections_per_host": -1, count: 0})
    want, got = str(e.value).split("; got ")
    assert want == (f"{name} transport needs positive io_timeout, connect_timeout, {count}, "
                    f"max_connections_per_host")
    assert got == f"io_timeout=0.0, {count}=0, max_connections_per_host=-1"


@pytest.mark.parametrize(("cls", "name", "count"), OWN_COUNT, ids=[n for _, n, _ in OWN_COUNT])
def test_a_timeout_that_is_not_a_number_is_refused(cls: Make, name: str, count: str) -> None:
    with pytest.raises(ValueError, match=f"^{name} transport .*; got connect_timeout=nan$"):
        cls(connect_timeout=float("nan"))


def test_tcp_frames_must_fit_the_wire() -> None:
    with pytest.raises(ValueError, match=r"1 <= frame_bytes <= \d+; got frame_bytes=0"):
        TcpTransport(frame_bytes=0)
