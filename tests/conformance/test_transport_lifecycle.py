"""Lifecycles: registration edge cases, handles, close, leaks, idle CPU, the registry."""

from __future__ import annotations

import resource
import time

import numpy as np
import pytest
from kvh_conformance import Pair, fd_count, make, settle, thread_count

from kvhandoff.lab.testing.transport import noise, page_plan
from kvhandoff.layout import Region, TensorSpec
from kvhandoff.transport import (
    Handle,
    TransferCancelled,
    TransferState,
    TransportClosed,
    TransportError,
    available_transports,
    create_transport,
)

TIMEOUT = 30.0


def test_registry_reports_every_transport() -> None:
    report = available_transports()
    assert {"memory", "tcp", "shm", "cma", "auto", "mooncake", "nixl"} <= set(report)
    assert report["memory"].ok and report["tcp"].ok and report["auto"].ok
    for ok, reason in report.values():
        assert isinstance(ok, bool) and reason
    with pytest.raises(TransportError, match="unknown transport"):
        create_transport("no-such-transport")


def test_transport_report_names_every_transport_and_why(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """What ``kvhandoff transports`` prints: a line per transport, saying whether it
    can run here and why; one that cannot load says what failed."""
    from kvhandoff.transport import describe_transports, registry

    lines = describe_transports()
    assert [ln.split()[0] for ln in lines] == list(available_transports())
    assert any(ln.startswith("tcp") and "usable" in ln for ln in lines)
    auto_line, = (ln for ln in lines if ln.startswith("auto"))  # the default says its pick
    assert "default" in auto_line and "auto picks" in auto_line
    assert "for a peer on this host" in auto_line and "another host" in auto_line
    monkeypatch.setitem(registry._TARGETS, "nope", "kvhandoff.transport.no_such_module:Nope")
    broken = [ln for ln in describe_transports() if ln.startswith("nope")]
    assert len(broken) == 1 and "NOT usable" in broken[0] and "no_such_module" in broken[0]


def test_public_surface_is_pinned() -> None:
    import kvhandoff.transport as t

    assert sorted(t.__all__) == [
        "Availability", "Capabilities", "ConnectError", "Handle", "Peer", "PeerLost",
        "ProtocolError", "RemoteOutOfBounds", "RemoteRefused", "TransferCancelled",
        "TransferFailed", "TransferState", "Transport", "TransportClosed", "TransportError",
        "TransportUnavailable", "available_transports", "create_transport",
        "describe_transports", "register_transport", "transport_class", "transport_names",
    ]
    assert all(hasattr(t, n) for n in t.__all__)


def test_zero_length_registrations_are_accepted(pair: Pair) -> None:
    empty = np.zeros(0, np.uint8)
    some = np.zeros(64, np.uint8)
    for t in (pair.sender, pair.receiver):
        assert t.register(empty) == []
        assert t.register(Region(ptr=int(some.ctypes.data), nbytes=0)) == []
        assert t.register(TensorSpec(name="x", layer_id=0, ptr=int(some.ctypes.data), nbytes=0,
                                     item_bytes=0)) == []
        assert t.register([]) == []
    b = pair.builder(1)
    p = b.plan("zero_units")
    want = b.expected(p)
    h = pair.sender.submit(pair.connect(), p)
    assert pair.sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
    for (_, d), exp in zip(b.dsts, want, strict=True):
        assert np.array_equal(d, exp)


def test_empty_plan_is_done_at_once(pair: Pair) -> None:
    from kvhandoff.plan.model import Plan

    h = pair.sender.submit(pair.connect(), Plan(entries=()))
    assert pair.sender.poll(h) is TransferState.DONE
    h.release()
    h.release()


def test_handle_release_is_idempotent_and_cancels_pending() -> None:
    released: list[Handle] = []
    h = Handle(nbytes=10, peer="p", on_release=released.append)
    assert h.wait(0.01) is TransferState.PENDING
    with pytest.raises(TimeoutError):
        h.result(0.01)
    h.release()
    h.release()
    assert released == [h]
    assert h.state is TransferState.FAILED and isinstance(h.error, TransferCancelled)
    assert not h.set_done()  # final states never change
    with pytest.raises(TransferCancelled):
        h.result(0)


def test_closed_transport_and_peer_refuse_work(name: str) -> None:
    t = make(name)
    r = make(name)
    buf = r.allocate(4096)
    src = np.zeros(4096, np.uint8)
    t.register(src)
    peer = t.connect(r.endpoint())
    peer.close()
    peer.close()
    p = page_plan(src, buf, 0)
    with pytest.raises(TransportClosed):
        t.submit(peer, p)
    t.close()
    t.close()
    with pytest.raises(TransportClosed):
        t.connect(r.endpoint())
    with pytest.raises(TransportClosed):
        t.register(src)
    r.close()


def test_repeated_connect_close_leaks_nothing(name: str) -> None:
    """Threads and file descriptors return to their baseline after 4 rounds of
    transport + peer + transfer + close."""

    def rounds(n: int) -> None:
        for i in range(n):
            with make(name) as s, make(name) as r:
                pr = Pair(s, r)
                b = pr.builder(i)
                p = b.plan("pages_4k")
                h = s.submit(pr.connect(), p)
                assert s.wait(h, TIMEOUT) is TransferState.DONE, h.error
                h.release()
                pr.close()

    rounds(1)  # warm up lazily created, process-wide state (engine singletons, imports)
    threads0, fds0 = settle(thread_count, 0, 0.5), settle(fd_count, 0, 0.5)
    rounds(4)
    assert settle(thread_count, threads0) <= threads0
    assert settle(fd_count, fds0) <= fds0


def test_idle_transport_uses_no_cpu(pair: Pair) -> None:
    """Connected, with transfers done, a transport must not spin (no busy polling)."""
    b = pair.builder(2)
    p = b.plan("pages_4k")
    h = pair.sender.submit(pair.connect(), p)
    assert pair.sender.wait(h, TIMEOUT) is TransferState.DONE
    time.sleep(0.1)
    u0 = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    busy = (u1.ru_utime - u0.ru_utime) + (u1.ru_stime - u0.ru_stime)
    assert busy < 0.1, f"{busy:.2f} CPU-seconds used in 1 s of idling"


def test_allocate_returns_registered_zeroed_memory(name: str) -> None:
    with make(name) as t:
        a = t.allocate(1 << 16)
        assert a.dtype == np.uint8 and len(a) == 1 << 16 and not a.any()
        a[:] = noise(np.random.default_rng(0), len(a))  # writable
