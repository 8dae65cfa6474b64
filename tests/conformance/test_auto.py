"""``auto`` beyond the shared suite: it connects through cma on one host, falls back when
the kernel refuses cma (a receiver of another user), treats a peer elsewhere as
another host, refuses endpoints whose offers it cannot authenticate, passes options only
to the transports that take them, and says what it picks once."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os

import numpy as np
import pytest
from kvh_conformance import Pair, deliver, make, serve_as_nobody

from kvhandoff.lab.testing.transport import PlanBuilder, bump, noise
from kvhandoff.transport import ConnectError, TransferState, available_transports
from kvhandoff.transport.auto import transport as auto
from kvhandoff.transport.auto.transport import AutoPeer, AutoTransport

CMA = available_transports()["cma"]
TIMEOUT = 30.0


@pytest.mark.skipif(not CMA.ok, reason=f"cma: {CMA.reason}")
def test_one_host_goes_through_cma() -> None:
    with make("auto") as sender, make("auto") as receiver:
        pair = Pair(sender, receiver)
        peer = deliver(pair, "mixed")
        assert isinstance(peer, AutoPeer) and peer.via == "cma"
        pair.close()


@pytest.mark.skipif(os.geteuid() != 0 or not CMA.ok,
                    reason="needs root, to run a receiver as another user, and cma")
def test_a_refused_cma_falls_back_to_tcp(caplog: pytest.LogCaptureFixture) -> None:
    """The receiver runs as ``nobody``: the kernel will not let it read this (root)
    process, so cma fails at connect; auto says so once and connects over tcp."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    nbytes = 8 << 20
    proc = ctx.Process(target=serve_as_nobody, args=(child, "auto", nbytes, 3), daemon=True)
    proc.start()
    child.close()
    try:
        assert conn.poll(60), "the receiver did not start"
        endpoint, base = conn.recv()
        with make("auto") as sender, caplog.at_level(logging.WARNING, "kvhandoff.transport"):
            def src(n: int) -> np.ndarray:
                a = np.empty(n, np.uint8)
                sender.register(a)
                return a

            mirror = noise(np.random.default_rng(3), nbytes)
            b = PlanBuilder(np.random.default_rng(4), src, bump(base, mirror))
            p = b.plan("pages_4k")
            want = b.expected(p)
            peer = sender.connect(endpoint)
            assert isinstance(peer, AutoPeer) and peer.via == "tcp"
            h = sender.submit(peer, p)
            assert sender.wait(h, TIMEOUT) is TransferState.DONE, h.error
            conn.send("bytes")
            assert conn.poll(60)
            got = np.frombuffer(conn.recv_bytes(), np.uint8)
            (ptr, _), = b.dsts
            assert np.array_equal(got[ptr - base:ptr - base + len(want[0])], want[0])
            peer.close()
        assert any("cma failed" in r.getMessage() and "EPERM" in r.getMessage()
                   for r in caplog.records), caplog.records
    finally:
        proc.kill()
        proc.join(10)
        conn.close()


def test_a_peer_on_another_host_gets_tcp() -> None:
    with make("auto") as sender, make("auto") as receiver:
        receiver.allocate(4096)
        ep = json.loads(receiver.endpoint())
        ep["host"] = ["another-boot", ep["host"][1]]
        peer = sender.connect(json.dumps(ep).encode())
        assert isinstance(peer, AutoPeer) and peer.via == "tcp"
        peer.close()


def test_offers_it_cannot_authenticate_are_refused() -> None:
    """Every offered endpoint's token replaced: no transport reaches the peer, and the
    error names each attempt."""
    with make("auto") as sender, make("auto") as receiver:
        ep = json.loads(receiver.endpoint())
        for n, sub in ep["offers"].items():
            inner = json.loads(auto.base64.b64decode(sub))
            inner["token"] = "0" * len(inner["token"])
            ep["offers"][n] = auto.base64.b64encode(json.dumps(inner).encode()).decode()
        with pytest.raises(ConnectError) as e:
            sender.connect(json.dumps(ep).encode())
        for n in ep["offers"]:
            assert f"{n}: " in str(e.value)


def test_malformed_endpoints_are_refused() -> None:
    with make("auto") as sender:
        for bad in (b"nope", b'{"kind": "tcp", "v": 2}',
                    b'{"kind": "auto", "v": 1, "host": [], "rdma": false, "offers": {"tcp": "!"}}'):
            with pytest.raises(ConnectError):
                sender.connect(bad)


def test_options_go_only_where_they_are_taken() -> None:
    with AutoTransport(offers=("tcp",), host="127.0.0.1", io_timeout=2.0) as t:
        assert t.offered == ("tcp",)
    with pytest.raises(ValueError, match="no_such_option"):
        AutoTransport(no_such_option=1)
    with pytest.raises(ValueError, match="cannot offer"):
        AutoTransport(offers=("shm",))


def test_restricted_offers_are_what_it_uses() -> None:
    with AutoTransport(offers=("tcp",)) as sender, make("auto") as receiver:
        pair = Pair(sender, receiver)
        peer = deliver(pair, "pages_4k")
        assert isinstance(peer, AutoPeer) and peer.via == "tcp"
        pair.close()


def test_what_it_picks_is_said_once(monkeypatch: pytest.MonkeyPatch,
                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(auto, "_said", set())
    with caplog.at_level(logging.INFO, "kvhandoff.transport"), make("auto") as a, \
            make("auto") as b:
        pair = Pair(a, b)
        for _ in range(3):
            deliver(pair, "tiny_handoff")
        pair.close()
    lines = [r.getMessage() for r in caplog.records]
    start = [ln for ln in lines if ln.startswith("transport auto picks")]
    using = [ln for ln in lines if ln.startswith("transport auto: using")]
    assert len(start) == 1 and "for a peer on this host" in start[0], lines
    assert len(using) == 1, lines  # three connects, one choice: said once
