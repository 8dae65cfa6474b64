"""Every wait is bounded: each timeout fails the request with a reason naming the timeout,
tells the peer, and the decode pages are released once the peer confirms."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.session import Receiver, RequestAborted, RequestTimeout, Sender, Status

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
    assert time.monotonic() - t0 > 0.9  # not before indices_timeout (wait(10) bounds it)
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


# Long enough that no timer (waiting, tombstone, release, heartbeat) can fire during the
# test however loaded the machine is: what it proves must come from the abort itself.
PATIENT = {"indices_timeout": 120.0, "waiting_timeout": 120.0, "transfer_timeout": 120.0,
           "release_timeout": 120.0, "heartbeat_interval": 0.5, "heartbeat_timeout": 120.0}


def _wait_until_not(r: Receiver, state: Status, timeout: float) -> Status:
    """Poll (bounded in time and count) until ``r`` has left ``state``."""
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / 0.01) + 1):
        if r.poll() is not state or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return r.poll()


def test_decode_without_a_sender_is_acked_at_once(bootstrap: BootstrapServer,
                                                  instance: str) -> None:
    """Prefill never created a Sender: the abort is acked (nothing was written) and a
    Sender created later for the same id fails at once."""
    rig = Rig(bootstrap.url, instance, prefill_cfg=PATIENT, decode_cfg=PATIENT)
    try:
        rp = rig.plan("never")
        r = rig.receiver(rp)
        assert _wait_until_not(r, Status.BOOTSTRAPPING, 60) is Status.WAITING_FOR_INPUT
        r.abort("engine cancelled it")
        assert r.wait(60) is Status.FAILED and isinstance(r.error, RequestAborted)
        # released by prefill's AbortAck, not by release_timeout (120 s, never reached)
        assert r.wait_released(60) and "confirmed" in r.release_reason, r.release_reason
        s = Sender(rig.prefill, "never")
        assert s.poll() is Status.FAILED and "engine cancelled it" in (s.reason or "")
        assert isinstance(s.error, RequestAborted)
    finally:
        rig.close()
    assert rig.prefill.live_requests == 0 and rig.decode.live_requests == 0
