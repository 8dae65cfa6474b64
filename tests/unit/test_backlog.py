"""The prefill rank's backlog (indices before their Sender, tombstones, early aborts) and
its request claims: pure tables, driven here with no agent, no lock and no clock."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvhandoff.binding import RequestKey
from kvhandoff.protocol import IndexListMsg, RankId, TransferInit
from kvhandoff.session.errors import PeerLost, RequestAborted
from kvhandoff.session.rank import backlog as backlog_mod
from kvhandoff.session.rank import claims as claims_mod
from kvhandoff.session.rank.backlog import (
    MAX_ID_BYTES,
    MAX_REASON,
    PrefillBacklog,
    id_problem,
    init_bytes,
)
from kvhandoff.session.rank.claims import Buffering, Claims, Refused

RANK = RankId(instance="d", dp_rank=0, tp_rank=1, tp_size=2, pp_rank=0, pp_size=1)


def init(rid: int | str, nbytes: int = 8, proof: bytes | None = None) -> TransferInit:
    return TransferInit(request_id=rid, rank=RANK,
                        indices={"kv": IndexListMsg(items=bytes(nbytes)), "aux": None},
                        proof=proof)


def table(*, hold: float = 10.0, max_requests: int = 4) -> PrefillBacklog:
    return PrefillBacklog(hold=hold, max_requests=max_requests, who="prefill p0")


def test_buffered_indices_are_taken_once_with_their_endpoint() -> None:
    b = table()
    assert b.buffer("tcp://d:1", init(1, 96), now=0.0) is None
    assert b.sent(1, "tcp://d:1") and not b.sent(1, "tcp://d:2") and not b.sent(2, "tcp://d:1")
    assert b.init_bytes == 96 == init_bytes(init(1, 96))
    assert b.endpoints() == {"tcp://d:1"}
    got, tomb = b.take(1)
    assert [(e.endpoint, e.msg.request_id, e.at) for e in got] == [("tcp://d:1", 1, 0.0)]
    assert tomb is None and b.init_bytes == 0 and b.endpoints() == set()
    assert b.take(1) == ([], None)


def test_buffering_is_capped_in_requests_and_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    b = table(max_requests=2)
    assert b.buffer("a", init(1), 0.0) is None and b.buffer("a", init(2), 0.0) is None
    assert "max_pending_inits" in str(b.buffer("a", init(3), 0.0))
    assert b.buffer("b", init(2), 0.0) is None  # another rank of a request already held
    monkeypatch.setattr(backlog_mod, "MAX_INIT_BYTES", 64)
    refused = b.buffer("c", init(1, 64), 0.0)
    assert refused is not None and "prefill p0" in refused and "MAX_INIT_BYTES" in refused
    assert 3 not in b.inits and len(b.inits[1]) == 1


def test_indices_and_tombstones_expire_after_hold() -> None:
    b = table(hold=5.0)
    b.buffer("a", init(1), now=0.0)
    b.tombstone(2, "failed", now=0.0)
    b.early_abort(3, "aborted", now=1.0)
    b.expire(now=5.5)
    assert 1 not in b.inits and b.init_bytes == 0 and 2 not in b.tombstones
    assert b.tomb(3) is not None  # expires at 6.0
    b.expire(now=6.5)
    assert b.tomb(3) is None


def test_tombstones_say_why_and_keep_bounded_reasons() -> None:
    b = table()
    b.tombstone(1, "x" * (MAX_REASON + 10), 0.0, frozenset({"tcp://d:1"}))
    b.tombstone(2, "unreachable", 0.0, lost=True)
    t1, t2 = b.tomb(1), b.tomb(2)
    assert t1 is not None and len(t1.reason) == MAX_REASON and t1.unsafe == {"tcp://d:1"}
    assert isinstance(t1.error(), RequestAborted)
    assert t2 is not None and isinstance(t2.error(), PeerLost)


def test_early_aborts_cannot_evict_real_tombstones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backlog_mod, "MAX_TOMBSTONES", 3)
    monkeypatch.setattr(backlog_mod, "MAX_EARLY_ABORTS", 2)
    b = table()
    b.tombstone(500, "real", 0.0)
    for rid in range(10):
        b.early_abort(rid, "sweep", 0.0)
    assert list(b.early) == [8, 9] and list(b.tombstones) == [500]
    for rid in range(600, 603):
        b.tombstone(rid, "later", 0.0)
    assert list(b.tombstones) == [600, 601, 602]  # oldest forgotten first
    b.tombstone(9, "failed here", 0.0)  # a real tombstone replaces an early abort
    assert 9 not in b.early and b.tomb(9) is not None and b.tomb(9).reason == "failed here"


def test_a_new_sender_takes_its_tombstone_from_either_table() -> None:
    b = table()
    b.early_abort(1, "aborted by decode", 0.0)
    b.tombstone(2, "failed", 0.0)
    assert b.take(1)[1] is not None and b.take(2)[1] is not None
    assert b.tomb(1) is None and b.tomb(2) is None


def test_long_request_ids_are_refused() -> None:
    assert id_problem(7) is None and id_problem("r" * MAX_ID_BYTES) is None
    assert "at most" in str(id_problem("r" * (MAX_ID_BYTES + 1)))
    assert id_problem("é" * (MAX_ID_BYTES // 2)) is None  # 2 bytes each: exactly the cap
    assert id_problem("é" * (MAX_ID_BYTES // 2 + 1)) is not None


def test_claims_name_a_live_senders_peers_until_dropped() -> None:
    c = Claims()
    slot = claims_mod.slot_of(RANK)
    assert slot == (1, 0) and not c.is_peer(1, "a")
    assert c.take(1, slot, "a") is None and c.take(2, (0, 0), "b") is None
    assert c.take(1, slot, "a") is None  # the same endpoint again: still its claim
    assert c.take(1, slot, "evil") == "a"  # a second endpoint: named, not recorded
    assert c.is_peer(1, "a") and not c.is_peer(1, "evil")
    assert not c.is_peer(1, "b") and not c.is_peer(1, None)
    c.keep_only({2})
    assert not c.is_peer(1, "a") and c.is_peer(2, "b")
    c.drop(2)
    assert not c.is_peer(2, "b")


def test_a_second_endpoint_for_one_rank_is_named() -> None:
    why = claims_mod.two_endpoints(7, RANK, "tcp://d:1", "tcp://evil:2")
    assert "7" in why and "tp 1 pp 0" in why
    assert "two endpoints (tcp://d:1, then tcp://evil:2)" in why


def test_indices_before_the_sender_wait_side_by_side_and_claim_nothing() -> None:
    """Finding H2, rogue first: whoever sends indices before the Sender exists decides
    nothing; every claimant's set waits (once per endpoint) for the Sender to judge."""
    b = table()
    assert claims_mod.buffer(b, init(1), "rogue", b"t-rogue", 0.0) == (Buffering.BUFFERED, None)
    assert claims_mod.buffer(b, init(1), "real", b"t-real", 1.0) == (Buffering.BUFFERED, None)
    assert claims_mod.buffer(b, init(1), "rogue", b"t-rogue", 2.0) == (Buffering.REPEAT, None)
    assert [(x.endpoint, x.transport) for x in b.inits[1]] == [
        ("rogue", b"t-rogue"), ("real", b"t-real")]
    assert b.tomb(1) is None
    b.tombstone(2, "failed here", 0.0)
    assert claims_mod.buffer(b, init(2), "real", b"t", 0.0) == (Buffering.FAILED, b.tomb(2))


def test_claimants_of_one_request_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backlog_mod, "MAX_CLAIMANTS", 2)
    b = table()
    claims_mod.buffer(b, init(1), "a", b"", 0.0)
    claims_mod.buffer(b, init(1), "b", b"", 0.0)
    got, why = claims_mod.buffer(b, init(1), "c", b"", 0.0)
    assert got is Buffering.REFUSED and "MAX_CLAIMANTS" in str(why)
    assert len(b.inits[1]) == 2 and not b.sent(1, "c")


def test_refused_indices_are_not_buffered() -> None:
    b = table(max_requests=1)
    claims_mod.buffer(b, init(1), "a", b"", 0.0)
    got, why = claims_mod.buffer(b, init(2), "a", b"", 0.0)
    assert got is Buffering.REFUSED and "max_pending_inits" in str(why) and 2 not in b.inits


def test_a_key_takes_only_indices_that_prove_their_endpoints() -> None:
    key = RequestKey.new()
    good = key.prove(1, RANK, "tcp://d:1", b"t1")
    assert claims_mod.refusal(None, init(1), "anyone", b"") is None  # no key: no proof asked
    assert claims_mod.refusal(key, init(1, proof=good), "tcp://d:1", b"t1") is None
    kind, why = claims_mod.refusal(key, init(1), "tcp://d:1", b"t1") or (None, "")
    assert kind is Refused.NO_PROOF and "without proof" in why and "tcp://d:1" in why
    for args in (("tcp://evil:2", b"t1"), ("tcp://d:1", b"t-evil")):  # another endpoint
        kind, why = claims_mod.refusal(key, init(1, proof=good), *args) or (None, "")
        assert kind is Refused.BAD_PROOF and "does not match" in why
    other = RequestKey.new().prove(1, RANK, "tcp://d:1", b"t1")
    assert claims_mod.refusal(key, init(1, proof=other), "tcp://d:1", b"t1") is not None
    # another id
    assert claims_mod.refusal(key, init(2, proof=good), "tcp://d:1", b"t1") is not None


def test_only_a_claimant_aborts_and_only_its_own_indices() -> None:
    c, b = Claims(), table()
    claims_mod.buffer(b, init(1), "rogue", b"", 0.0)
    claims_mod.buffer(b, init(1), "real", b"", 0.0)
    assert claims_mod.abort_from(c, b, 1, "stranger", "no", 0.0, has_sender=False) == (None, False)
    assert claims_mod.abort_from(c, b, 9, "real", "no", 0.0, has_sender=False) == (None, False)
    assert b.tomb(9) is None  # an id nobody sent indices for leaves no tombstone
    tomb, ours = claims_mod.abort_from(c, b, 1, "rogue", "aborted by rogue", 0.0, has_sender=False)
    assert tomb is None and ours and b.tomb(1) is None  # the rogue's indices go; not the request
    assert [x.endpoint for x in b.inits[1]] == ["real"]
    tomb, ours = claims_mod.abort_from(c, b, 1, "real", "aborted by decode", 0.0, has_sender=False)
    assert tomb is None and ours and 1 not in b.inits and 1 in b.early  # the last one
    tomb, ours = claims_mod.abort_from(c, b, 1, "real", "again", 0.0, has_sender=False)
    assert tomb is not None and tomb.reason == "aborted by decode" and not ours
    c.take(2, claims_mod.slot_of(RANK), "real")
    assert claims_mod.abort_from(c, b, 2, "real", "x", 0.0, has_sender=True) == (None, True)
    assert claims_mod.abort_from(c, b, 2, "rogue", "x", 0.0, has_sender=True) == (None, False)


@pytest.mark.parametrize("mod", [backlog_mod, claims_mod])
def test_the_tables_are_pure(mod: object) -> None:
    """No lock, clock, logger or socket: the desk holds the lock and passes ``now``."""
    tree = ast.parse(Path(str(getattr(mod, "__file__", ""))).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not names & {"threading", "time", "logging", "socket", "zmq"}, names
    assert not [n for n in names if n.startswith(("kvhandoff.transport", "kvhandoff.observe"))]
