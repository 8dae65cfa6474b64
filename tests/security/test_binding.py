"""A request's KV goes only to the decode it was routed to (issue #30 item 1, finding H2).

The attack: a second decode agent of the same layout sends indices for a request. Before,
the prefill handed the KV to whichever endpoint sent them first: sent after prefill had
the KV queued but before the real decode's indices, the rogue got SUCCESS and an exact
copy while the real decode timed out. Now the request has a key
(:mod:`kvhandoff.binding`) that its prefill and real decode hold, and the rogue, holding
no key, another key, or the real decode's proof copied off the wire, is refused before a
byte moves — in every order, in a deployment with or without the deployment secret
(which the rogue then holds too). The real decode succeeds byte-exact, the rogue's memory
is untouched, and the refusal is counted (stats and metric) and logged at a bounded rate.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvhandoff.binding import RequestKey
from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.fixtures import bootstrap, instance, no_leaked_threads
from kvhandoff.lab.testing.hostile import eventually, exact, memory_problems, prefill_desk
from kvhandoff.lab.testing.rig import DecodeSide, Rig
from kvhandoff.observe.report import process_metrics
from kvhandoff.protocol import RankId, RequestId
from kvhandoff.session import Receiver, Status

FIXTURES = (bootstrap, instance, no_leaked_threads)  # imported for pytest
ORDERS = ["rogue_first", "kv_queued", "rogue_second", "overlapping", "after_finished"]
ROGUES = ["no_key", "wrong_key", "copied_proof"]


class _Copied(RequestKey):
    """What a rogue that copied the real decode's proof off the wire sends: that proof."""

    __slots__ = ("proof",)

    def __init__(self, proof: bytes) -> None:
        super().__init__(b"\0" * 32)
        object.__setattr__(self, "proof", proof)

    def prove(self, request_id: RequestId, rank: RankId, control_endpoint: str,
              transport_endpoint: bytes) -> bytes:
        return self.proof  # type: ignore[no-any-return]


@pytest.fixture(params=["with_secret", "without_secret"])
def deployment(request: pytest.FixtureRequest, bootstrap: BootstrapServer, secure: Any,
               instance: str, secret_file: str) -> Iterator[tuple[Rig, dict[str, Any]]]:
    """The rig, its agents holding the deployment secret (and so does the rogue), or a
    deployment without one."""
    if request.param == "with_secret":
        cfg: dict[str, Any] = {"secret_file": secret_file}
        rig = Rig(secure.url, instance, prefill_cfg=cfg, decode_cfg=cfg)
    else:
        cfg = {}
        rig = Rig(bootstrap.url, instance)
    yield rig, cfg
    rig.close()
    assert rig.prefill.live_requests == 0 and rig.decode.live_requests == 0



def _refusals(reason: str) -> float:
    value = process_metrics().registry.get_sample_value("kvhandoff_refused_claims_total",
                                                        {"reason": reason})
    return value or 0.0


def _rogue_key(kind: str, rig: Rig, rid: RequestId, key: RequestKey) -> RequestKey | None:
    if kind == "no_key":
        return None
    if kind == "wrong_key":
        return RequestKey.new()
    d = rig.decode
    return _Copied(key.prove(rid, d.rank_id, d.endpoint, d.transport_endpoint))


def _both(rig: Rig, rp: Any, rogue: DecodeSide, key: RequestKey,
          bad_key: RequestKey | None) -> tuple[Receiver, Receiver]:
    """The real decode's and the rogue's Receivers, started at the same moment."""
    out: dict[str, Receiver] = {}
    go = threading.Barrier(2)

    def start(name: str, on: DecodeSide | None, k: RequestKey | None) -> None:
        go.wait(10)
        out[name] = rig.receiver(rp, on=on, key=k)

    threads = [threading.Thread(target=start, args=("good", None, key)),
               threading.Thread(target=start, args=("bad", rogue, bad_key))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out["good"], out["bad"]


@pytest.mark.parametrize("rogue_kind", ROGUES)
@pytest.mark.parametrize("order", ORDERS)
def test_a_rogue_decode_never_gets_the_kv_and_the_real_decode_succeeds(
        deployment: tuple[Rig, dict[str, Any]], order: str, rogue_kind: str) -> None:
    rig, cfg = deployment
    first, rp = rig.plan(1), rig.plan(2, block=1)
    rig.handoff(first, key=RequestKey.new())
    rogue = rig.add_decode(decode_cfg=cfg)
    assert rogue.agent.handshake(rig.url) is None  # its indices go out at once
    key = RequestKey.new()
    bad_key = _rogue_key(rogue_kind, rig, rp.rid, key)
    kind = "no_proof" if rogue_kind == "no_key" else "bad_proof"
    before = _refusals(kind)
    refused = lambda: rig.prefill.stats["refused_claims"] == 1  # noqa: E731
    if order == "after_finished":
        s, good = rig.handoff(rp, key=key)
        bad = rig.receiver(rp, on=rogue, key=bad_key)  # buffered for a Sender never to come
        assert bad.wait(10) is Status.FAILED and "waiting_timeout" in str(bad.reason)
    else:
        if order == "rogue_first":  # before the Sender exists
            bad = rig.receiver(rp, on=rogue, key=bad_key)
            assert eventually(lambda: rp.rid in prefill_desk(rig).backlog.inits)
        s, chunks, state = rig.sender(rp, key=key)
        if order == "kv_queued":  # the issue's: every chunk queued, then the rogue
            rig.send_all(s, chunks, state)
            bad = rig.receiver(rp, on=rogue, key=bad_key)
            assert eventually(refused)
            good = rig.receiver(rp, key=key)
        elif order == "rogue_second":  # after the real decode's indices were taken
            good = rig.receiver(rp, key=key)
            assert eventually(lambda: s.status is Status.WAITING_FOR_INPUT)
            bad = rig.receiver(rp, on=rogue, key=bad_key)
            assert eventually(refused)
        elif order == "overlapping":
            good, bad = _both(rig, rp, rogue, key, bad_key)
            assert eventually(lambda: refused() and s.status is Status.WAITING_FOR_INPUT)
        else:
            good = rig.receiver(rp, key=key)
        if order != "kv_queued":
            rig.send_all(s, chunks, state)
        assert good.wait(10) is Status.SUCCESS, good.reason
        assert s.wait(10) is Status.SUCCESS, s.reason
        assert bad.wait(10) is Status.FAILED
        assert "refused, nothing sent there" in str(bad.reason), bad.reason
        assert bad.wait_released(10)  # its AbortAck: nothing was ever in flight to it
        assert rig.prefill.stats["refused_claims"] == 1
        assert _refusals(kind) == before + 1
    assert s.status is Status.SUCCESS and good.status is Status.SUCCESS
    assert memory_problems(rig, rogue, [], failed=[rp]) == []  # not one byte
    assert exact(rig, [first, rp]) == []


def test_refusals_are_logged_at_a_bounded_rate(deployment: tuple[Rig, dict[str, Any]],
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Fifty rogue claims on one live request: each refused and counted, a line or none
    logged (the first in this process's ten seconds), the request unharmed."""
    rig, cfg = deployment
    rogues = [rig.add_decode(decode_cfg=cfg) for _ in range(5)]
    assert all(r.agent.handshake(rig.url) is None for r in rogues)
    rps = [rig.plan(10 + i, block=1 + i % 3) for i in range(10)]
    key = RequestKey.new()
    caplog.set_level(logging.WARNING, logger="kvhandoff.session.rank.agent")
    for i, rp in enumerate(rps):
        s, chunks, state = rig.sender(rp, key=key)
        bad = [rig.receiver(rp, on=r, key=RequestKey.new()) for r in rogues]
        good = rig.receiver(rp, key=key)
        assert eventually(lambda n=5 * (i + 1): rig.prefill.stats["refused_claims"] == n)
        rig.send_all(s, chunks, state)
        assert good.wait(10) is Status.SUCCESS and s.wait(10) is Status.SUCCESS
        assert all(b.wait(10) is Status.FAILED for b in bad)
    assert rig.prefill.stats["refused_claims"] == 50
    lines = [r for r in caplog.records if "refused, nothing sent there" in r.getMessage()]
    assert len(lines) <= 1, [r.getMessage() for r in lines]


def test_a_decode_without_the_requests_key_is_refused_saying_why(
        deployment: tuple[Rig, dict[str, Any]]) -> None:
    """A misconfigured engine (prefill gives the request a key, decode was not given it):
    the decode fails at once, told why, instead of waiting out a timeout."""
    rig, _ = deployment
    rp = rig.plan(1)
    s = rig.sender(rp, key=RequestKey.new())[0]
    r = rig.receiver(rp)
    assert r.wait(10) is Status.FAILED and "without proof" in str(r.reason), r.reason
    assert r.wait_released(10)
    s.abort("test over")
    assert s.wait_settled(10)
