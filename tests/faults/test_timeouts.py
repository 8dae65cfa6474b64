"""Every wait is bounded: each timeout fails the request with a reason naming the timeout,
tells the peer, and the decode pages are released once the peer confirms."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.observe import report
from kvhandoff.session import Receiver, RequestAborted, RequestTimeout, Sender, Status
from kvhandoff.session.errors import LeaseExpired

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


def test_a_request_no_decode_claims_is_freed_on_the_lease(
        bootstrap: BootstrapServer, instance: str, caplog: pytest.LogCaptureFixture) -> None:
    """Prefill computed a request and handed over its last chunk, and the client hung up
    before the decode hop: no decode ever sends indices. The Sender fails with
    LeaseExpired and settles (its memory is the engine's to free) on the lease, not on
    indices_timeout (120 s, never reached), is counted and logged once; a decode that
    comes after all is told at once instead of waiting out its own timeout."""
    metrics = report.process_metrics().registry
    labels = {"role": "prefill", "transport": "tcp"}

    def counted() -> tuple[float, float]:
        return (metrics.get_sample_value("kvhandoff_leases_expired_total", labels) or 0.0,
                metrics.get_sample_value("kvhandoff_failures_total",
                                         {**labels, "reason": "LeaseExpired"}) or 0.0)

    before = counted()
    rig = Rig(bootstrap.url, instance, prefill_cfg={**PATIENT, "lease": 0.5},
              decode_cfg=PATIENT)
    try:
        rp = rig.plan("orphan")
        s, chunks, state = rig.sender(rp)
        with caplog.at_level(logging.WARNING, logger="kvhandoff.session.request.sender"):
            rig.send_all(s, chunks, state)
            assert s.wait(60) is Status.FAILED and s.wait_settled(60)
        assert isinstance(s.error, LeaseExpired), s.error
        assert "no decode claimed it within the 0.5 s lease (got 0 of ?" in str(s.error)
        late = rig.receiver(rp)
        assert late.wait(60) is Status.FAILED and "lease" in (late.reason or ""), late.reason
        assert late.wait_released(60)
    finally:
        rig.close()
    assert counted() == (before[0] + 1, before[1] + 1)
    said = [r for r in caplog.records if "lease" in r.getMessage()]
    assert len(said) == 1 and "'orphan'" in said[0].getMessage()
