"""A request's key and the proof its decode sends (kvhandoff.binding): pure, no network."""

from __future__ import annotations

import pytest

from kvhandoff.binding import KEY_BYTES, PROOF_BYTES, RequestKey
from kvhandoff.protocol import RankId
from kvhandoff.secret import Secret

RANK = RankId(instance="decode", dp_rank=0, tp_rank=1, tp_size=2, pp_rank=0, pp_size=1)
CTL, DATA = "tcp://10.0.0.2:7000", b'{"host": "10.0.0.2", "port": 9000}'


def test_a_proof_verifies_for_exactly_what_it_names() -> None:
    key = RequestKey.new()
    proof = key.prove("req-1", RANK, CTL, DATA)
    assert len(proof) == PROOF_BYTES
    assert key.refusal(proof, "req-1", RANK, CTL, DATA) is None
    changed = [("req-2", RANK, CTL, DATA), (1, RANK, CTL, DATA),
               ("req-1", RankId(instance="decode", tp_rank=0, tp_size=2), CTL, DATA),
               ("req-1", RankId(instance="rogue", tp_rank=1, tp_size=2), CTL, DATA),
               ("req-1", RANK, "tcp://10.0.0.9:7000", DATA),
               ("req-1", RANK, CTL, b'{"host": "10.0.0.9", "port": 9000}')]
    for args in changed:
        why = key.refusal(proof, *args)
        assert why is not None and "does not match" in why and str(args[2]) in why
    assert RequestKey.new().refusal(proof, "req-1", RANK, CTL, DATA) is not None
    why = key.refusal(None, "req-1", RANK, CTL, DATA)
    assert why is not None and "without proof" in why and "req-1" in why


def test_an_integer_id_and_its_string_are_different_requests() -> None:
    key = RequestKey.new()
    assert key.prove(7, RANK, CTL, DATA) != key.prove("7", RANK, CTL, DATA)


def test_a_key_travels_as_hex_and_never_shows() -> None:
    key = RequestKey.new()
    assert len(key.material) == KEY_BYTES
    assert RequestKey.from_hex(key.hex()) == key
    assert key.hex() not in repr(key) and key.material.hex() not in str(key)
    for bad, why in ((None, "hex string"), ("zz", "hex digits"), ("ab" * 8 + "a", "hex"),
                     ("ab" * 15, "16 bytes")):
        with pytest.raises(ValueError, match=why):
            RequestKey.from_hex(bad)
    with pytest.raises(ValueError, match="16 bytes"):
        RequestKey(b"short")


def test_derived_keys_agree_where_the_secret_is_shared_and_nowhere_else() -> None:
    """SGLang's rooms: both sides derive the same key from the id they share and the
    deployment secret; a holder of another secret, or of the id alone, cannot."""
    secret = Secret.from_bytes(b"s" * 32)
    room = 0x1234_5678_9ABC_DEF0
    mine, theirs = RequestKey.for_room(room, secret), RequestKey.for_room(room, secret)
    assert mine == theirs
    assert RequestKey.for_room(room + 1, secret) != mine
    assert RequestKey.for_room(room, Secret.from_bytes(b"t" * 32)) != mine
    assert RequestKey.derive(b"r" * 16, room) != mine
    assert RequestKey.derive(b"r" * 16, room) == RequestKey.derive(b"r" * 16, room)
    with pytest.raises(ValueError, match="16 bytes"):
        RequestKey.derive(b"short", room)


def test_the_reference_engine_keys_requests_as_its_router_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both halves of a link derive the same key per request id from the router secret
    they share (or the deployment secret); an insecure deployment without a router
    secret leaves requests unbound."""
    from kvhandoff.lab.engine.session_link import request_keys
    from kvhandoff.secret import deployment_secret

    routed = request_keys(b"r" * 32)
    assert routed(3) == request_keys(b"r" * 32)(3) != routed(4)
    assert routed(3) != request_keys(b"q" * 32)(3)
    monkeypatch.setenv("KVHANDOFF_INSECURE", "0")
    monkeypatch.delenv("KVHANDOFF_SECRET_FILE", raising=False)
    secret = deployment_secret()
    assert secret is not None
    assert request_keys(None)(3) == RequestKey.for_room(3, secret)
    monkeypatch.setenv("KVHANDOFF_INSECURE", "1")
    assert request_keys(None)(3) is None
