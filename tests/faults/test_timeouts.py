"""Every wait is bounded: each timeout fails the request with a reason naming the timeout,
tells the peer, and the decode pages are released once the peer confirms."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvhandoff.session import RequestAborted, RequestTimeout, Sender, Status
from kvhandoff.session.bootstrap import BootstrapServer
from kvhandoff.testing.rig import Rig

SHORT = {"indices_timeout": 1.0, "waiting_timeout": 1.0, "transfer_timeout": 1.0}


@pytest.fixture
def rig(bootstrap: BootstrapServer, instance: str) -> Iterator[Rig]:
    r = Rig(bootstrap.url, instance, prefill_cfg=SHORT, decode_cfg=SHORT)
    yield r
    r.close()
    assert r.prefill.live_requests == 0 and r.decode.live_requests == 0


def test_prefill_gives_up_waiting_for_indices(rig: Rig) -> None:
    s = Sender(rig.prefill, "lonely")
    s.init(3, 1)
    t0 = time.monotonic()
    assert s.wait(10) is Status.FAILED
    assert isinstance(s.error, RequestTimeout)
    assert "indices_timeout" in str(s.error) and "got 0 of ?" in str(s.error)
    assert 0.9 < time.monotonic() - t0 < 4
    assert s.wait_settled(1)


def test_decode_gives_up_waiting_for_the_first_chunk(rig: Rig) -> None:
    rp = rig.plan("slow-prefill")
    r = rig.receiver(rp)
    s, _, _ = rig.sender(rp)  # never sends a chunk
    assert r.wait(10) is Status.FAILED
    assert isinstance(r.error, RequestTimeout) and "waiting_timeout" in str(r.error)
    assert s.wait(5) is Status.FAILED
    assert isinstance(s.error, RequestAborted) and "waiting_timeout" in str(s.error)
    assert r.wait_released(5) and "confirmed" in r.release_reason


def test_decode_gives_up_when_transfer_stalls(rig: Rig) -> None:
    rp = rig.plan("stalled", chunk_pages=1)
    r = rig.receiver(rp)
    s, chunks, _ = rig.sender(rp)
    s.send(chunks[0])  # and never the rest
    assert r.wait(10) is Status.FAILED
    assert isinstance(r.error, RequestTimeout) and "transfer_timeout" in str(r.error)
    assert s.wait(5) is Status.FAILED
    assert r.wait_released(5)


def test_decode_without_a_sender_is_acked_at_once(rig: Rig) -> None:
    """Prefill never created a Sender: the abort is acked (nothing was written) and a
    Sender created later for the same id fails at once."""
    rp = rig.plan("never")
    r = rig.receiver(rp)
    assert r.wait(1) is Status.WAITING_FOR_INPUT
    r.abort("engine cancelled it")
    assert r.wait_released(5) and "confirmed" in r.release_reason
    s = Sender(rig.prefill, "never")
    assert s.poll() is Status.FAILED and "engine cancelled it" in (s.reason or "")
