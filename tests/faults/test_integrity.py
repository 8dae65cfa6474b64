"""Corruption in transit: checksums name the component; the aux row's guard and crc catch
a torn or foreign aux row even without checksums."""

from __future__ import annotations

import re
import time

import pytest

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.faulty import CorruptingTcp
from kvhandoff.lab.testing.handoff import Topology
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.session import AuxMismatch, ChecksumMismatch, Status

# (shape, topology overrides, tokens): small pages for most shapes; a DeepSeek-V4 page
# holds whole C128 rows (128 tokens), and 300 tokens leave a pending C128 row to move
_TOPO: dict[str, tuple[dict[str, int], int]] = {
    "qwen3_next": ({}, 21),
    "gpt_oss": ({}, 21),
    "deepseek_v32": ({}, 21),
    "deepseek_v4": ({"prefill_page": 128, "decode_page": 128, "num_pages": 24}, 300),
}
# every state type a checksum covers, by the component that holds it
CASES = [
    ("qwen3_next", "kv"),  # full-attention KV
    ("qwen3_next", "mamba"),  # GDN conv + SSM slot
    ("gpt_oss", "swa"),  # sliding-window KV pages
    ("deepseek_v32", "kv"),  # MLA latent pages
    ("deepseek_v32", "nsa"),  # DSA indexer pages
    ("deepseek_v4", "kv"),  # compressed C4 / C128 KV + C4 indexer pages (MLA type)
    ("deepseek_v4", "swa"),  # SWA KV pages + page-scoped C4 compress rings
    ("deepseek_v4", "swa_ring"),  # the NextN draft layer's SWA ring rows
    ("deepseek_v4", "c128_state"),  # the pending C128 compression row
    ("deepseek_v4", "swa_valid_from"),  # the request row
]


@pytest.mark.parametrize(("shape", "component"), CASES, ids=[f"{s}-{c}" for s, c in CASES])
def test_checksum_names_the_corrupted_component(bootstrap: BootstrapServer, instance: str,
                                                shape: str, component: str) -> None:
    over, tokens = _TOPO[shape]
    topo = Topology(shape=shape, **over)
    t = CorruptingTcp(component=component)
    rig = Rig(bootstrap.url, instance, topo=topo, prefill_transport=t,
              decode_cfg={"checksum": True})
    try:
        assert component in {c.name for c in rig.src.components}
        rp = rig.plan(1, num_tokens=tokens, chunk_pages=1)
        r = rig.receiver(rp)
        s, chunks, state = rig.sender(rp)
        rig.send_all(s, chunks, state)
        assert r.wait(10) is Status.FAILED
        assert t.corrupted >= 1
        assert isinstance(r.error, ChecksumMismatch), r.error
        assert r.events["checksum_mismatch"] >= 1  # what the metrics count (per chunk)
        named = set(re.findall(r"component '(\w+)'", str(r.error)))
        assert named == {component}, r.error  # that component, and no other
        assert r.wait_released(5)
        assert s.wait(5) in (Status.SUCCESS, Status.FAILED)  # its writes completed either way
        assert s.wait_settled(5)
        deadline = time.monotonic() + 5
        while (rig.decode.live_requests or rig.prefill.live_requests) and \
                time.monotonic() < deadline:
            time.sleep(0.01)
        assert rig.decode.live_requests == 0 and rig.prefill.live_requests == 0
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
