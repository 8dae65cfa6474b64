"""Corruption in transit: checksums name the component; the aux row's guard and crc catch
a torn or foreign aux row even without checksums."""

from __future__ import annotations

import pytest

from kvhandoff.session import AuxMismatch, ChecksumMismatch, Status
from kvhandoff.session.bootstrap import BootstrapServer
from kvhandoff.testing.faulty import CorruptingTcp
from kvhandoff.testing.rig import Rig


@pytest.mark.parametrize("component", ["kv", "mamba"])
def test_checksum_names_the_corrupted_component(bootstrap: BootstrapServer, instance: str,
                                                component: str) -> None:
    t = CorruptingTcp(component=component)
    rig = Rig(bootstrap.url, instance, prefill_transport=t, decode_cfg={"checksum": True})
    try:
        rp = rig.plan(1)
        r = rig.receiver(rp)
        s, chunks, state = rig.sender(rp)
        rig.send_all(s, chunks, state)
        assert r.wait(10) is Status.FAILED
        assert t.corrupted >= 1
        assert isinstance(r.error, ChecksumMismatch)
        assert f"component {component!r}" in str(r.error)
        assert r.wait_released(5)
        assert s.wait(5) in (Status.SUCCESS, Status.FAILED)  # its writes completed either way
    finally:
        rig.close()


def test_checksums_pass_when_nothing_is_corrupted(bootstrap: BootstrapServer,
                                                  instance: str) -> None:
    rig = Rig(bootstrap.url, instance, decode_cfg={"checksum": True})
    try:
        rig.handoff(rig.plan(1))
    finally:
        rig.close()


def test_corrupted_aux_row_fails_without_checksums(bootstrap: BootstrapServer,
                                                   instance: str) -> None:
    t = CorruptingTcp(component="aux")
    rig = Rig(bootstrap.url, instance, prefill_transport=t)
    try:
        rp = rig.plan(1)
        r = rig.receiver(rp)
        s, chunks, state = rig.sender(rp)
        rig.send_all(s, chunks, state)
        assert r.wait(10) is Status.FAILED
        assert isinstance(r.error, AuxMismatch) and "aux row 1" in str(r.error)
    finally:
        rig.close()
