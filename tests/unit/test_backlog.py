"""The prefill rank's backlog (indices before their Sender, tombstones, early aborts) and
its request claims: pure tables, driven here with no agent, no lock and no clock."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
from kvhandoff.session.rank.claims import Claims, abort_from, admit, slot_of, two_endpoints

RANK = RankId(instance="d", dp_rank=0, tp_rank=1, tp_size=2, pp_rank=0, pp_size=1)


def init(rid: int | str, nbytes: int = 8) -> TransferInit:
    return TransferInit(request_id=rid, rank=RANK,
                        indices={"kv": IndexListMsg(items=bytes(nbytes)), "aux": None})


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


def test_claims_name_a_requests_peers_until_dropped() -> None:
    c = Claims()
    slot = slot_of(RANK)
    assert slot == (1, 0) and c.first(1, slot) is None and not c.is_peer(1, "a")
    c.claim(1, slot, "a")
    c.claim(2, (0, 0), "b")
    assert c.first(1, slot) == "a" and c.is_peer(1, "a")
    assert not c.is_peer(1, "b") and not c.is_peer(1, None)
    c.keep_only({2}, {})
    assert c.first(1, slot) is None and c.is_peer(2, "b")
    c.drop(2)
    assert not c.is_peer(2, "b")


def test_a_second_endpoint_for_one_rank_is_named() -> None:
    why = two_endpoints(7, RANK, "tcp://d:1", "tcp://evil:2")
    assert "7" in why and "tp 1 pp 0" in why
    assert "two endpoints (tcp://d:1, then tcp://evil:2)" in why


def test_indices_before_the_sender_are_buffered_and_claimed_once() -> None:
    c, b = Claims(), table()
    got = admit(c, b, init(1), "a", 0.0, has_sender=False)
    assert got.tomb is None and got.twice is None and got.refused is None and not got.repeat
    assert b.sent(1, "a") and c.first(1, slot_of(RANK)) == "a"
    again = admit(c, b, init(1), "a", 1.0, has_sender=False)
    assert again.repeat and len(b.inits[1]) == 1  # the first set stands
    live = admit(c, b, init(2), "a", 0.0, has_sender=True)  # a Sender takes it: no buffer
    assert live.refused is None and 2 not in b.inits and c.is_peer(2, "a")


def test_a_second_endpoint_fails_the_request_and_drops_what_waits() -> None:
    c, b = Claims(), table()
    admit(c, b, init(1), "a", 0.0, has_sender=False)
    got = admit(c, b, init(1), "evil", 0.0, has_sender=False)
    assert got.first == "a" and got.twice is not None and "two endpoints" in got.twice
    assert 1 not in b.inits and not c.is_peer(1, "a")
    tomb = b.tomb(1)
    assert tomb is not None and tomb.reason == got.twice  # its Sender fails on arrival
    later = admit(c, b, init(1), "a", 0.0, has_sender=False)
    assert later.tomb is tomb and later.twice is None and 1 not in b.inits


def test_with_a_live_sender_a_second_endpoint_leaves_the_tables_to_it() -> None:
    c, b = Claims(), table()
    admit(c, b, init(1), "a", 0.0, has_sender=True)
    got = admit(c, b, init(1), "evil", 0.0, has_sender=True)
    assert got.first == "a" and got.twice is not None and b.tomb(1) is None


def test_refused_indices_make_no_claim() -> None:
    c, b = Claims(), table(max_requests=1)
    admit(c, b, init(1), "a", 0.0, has_sender=False)
    got = admit(c, b, init(2), "a", 0.0, has_sender=False)
    assert got.refused is not None and not c.is_peer(2, "a")


def test_only_a_requests_peer_aborts_what_waits_for_its_sender() -> None:
    c, b = Claims(), table()
    admit(c, b, init(1), "a", 0.0, has_sender=False)
    assert abort_from(c, b, 1, "stranger", "no", 0.0, has_sender=False) == (None, False)
    assert b.tomb(1) is None and 1 in b.inits
    assert abort_from(c, b, 9, "a", "no", 0.0, has_sender=False) == (None, False)
    assert b.tomb(9) is None  # an id nobody sent indices for leaves no tombstone
    tomb, ours = abort_from(c, b, 1, "a", "aborted by decode", 0.0, has_sender=False)
    assert tomb is None and ours and 1 not in b.inits and 1 in b.early
    tomb, ours = abort_from(c, b, 1, "a", "again", 0.0, has_sender=False)
    assert tomb is not None and tomb.reason == "aborted by decode" and not ours


@pytest.mark.parametrize("mod", [backlog_mod, claims_mod])
def test_the_tables_are_pure(mod: object) -> None:
    """No lock, clock, logger or socket: the desk holds the lock and passes ``now``."""
    tree = ast.parse(Path(str(getattr(mod, "__file__", ""))).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not names & {"threading", "time", "logging", "socket", "zmq"}, names
    assert not [n for n in names if n.startswith(("kvhandoff.transport", "kvhandoff.observe"))]
