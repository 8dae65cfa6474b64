"""The data-plane handshake's pure core (:mod:`kvhandoff.transport.framing.handshake`):
two honest sides agree; a wrong key, a replayed or reflected frame, a stale endpoint,
truncated and oversized frames are each refused with a reason. No sockets."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvhandoff.transport.framing.handshake as ha
from kvhandoff.secret import PURPOSE_BOOTSTRAP, PURPOSE_CONTROL, PURPOSE_DATA, Secret
from kvhandoff.transport.framing.handshake import (
    CLIENT_FRAME,
    SERVER_FRAME,
    ClientHandshake,
    HandshakeFailed,
    Refusal,
    ServerHandshake,
    derive_key,
    new_endpoint_id,
    refusal,
)

TOKEN = b"0123456789abcdef0123456789abcdef"
EID = "a1b2c3d4e5f60718"


def _run(server_key: bytes, client_key: bytes, *, eid: str = EID,
         client_eid: str | None = None) -> None:
    """One whole handshake; raises HandshakeFailed where a side refuses."""
    server = ServerHandshake.new(server_key, eid)
    client = ClientHandshake.new(client_key, client_eid or eid, peer="server")
    challenge = server.challenge()
    verdict = server.verdict(client.answer(challenge))
    client.check_verdict(challenge, verdict)


def test_honest_sides_agree_and_frames_have_fixed_sizes() -> None:
    key = derive_key(TOKEN, None)
    server = ServerHandshake.new(key, EID)
    client = ClientHandshake.new(key, EID, peer="server")
    challenge = server.challenge()
    answer = client.answer(challenge)
    verdict = server.verdict(answer)
    client.check_verdict(challenge, verdict)
    assert (len(challenge), len(answer), len(verdict)) == (SERVER_FRAME, CLIENT_FRAME,
                                                           SERVER_FRAME)
    assert TOKEN not in challenge + answer + verdict  # the token never travels


def test_a_client_with_the_wrong_key_is_refused() -> None:
    with pytest.raises(HandshakeFailed, match="client's proof is wrong"):
        _run(derive_key(TOKEN, None), derive_key(b"another token", None))


def test_an_impostor_server_fails_the_clients_check() -> None:
    """The impostor answers the challenge protocol correctly but lacks the key."""
    impostor = ServerHandshake.new(b"impostor's guess", EID)
    client = ClientHandshake.new(derive_key(TOKEN, None), EID, peer="tcp at x:1")
    challenge = impostor.challenge()
    answer = client.answer(challenge)
    with pytest.raises(HandshakeFailed, match="client's proof is wrong"):
        impostor.verdict(answer)  # it cannot check the client either
    # it sends a well-formed VERDICT anyway, for the client's nonce under its own key:
    # the client refuses to go on
    own = ClientHandshake(b"impostor's guess", EID, client.nonce, "self").answer(challenge)
    fake = impostor.verdict(own)
    with pytest.raises(HandshakeFailed, match="did not prove"):
        client.check_verdict(challenge, fake)


def test_the_deployment_secret_keys_the_token() -> None:
    a = Secret.from_bytes(b"a" * 32).key(PURPOSE_DATA)
    b = Secret.from_bytes(b"b" * 32).key(PURPOSE_DATA)
    assert derive_key(TOKEN, None) == TOKEN
    assert derive_key(TOKEN, a) not in (TOKEN, derive_key(TOKEN, b))
    _run(derive_key(TOKEN, a), derive_key(TOKEN, a))
    with pytest.raises(HandshakeFailed):  # a sniffed token, without the secret
        _run(derive_key(TOKEN, a), derive_key(TOKEN, None))
    with pytest.raises(HandshakeFailed):  # another deployment
        _run(derive_key(TOKEN, a), derive_key(TOKEN, b))
    with pytest.raises(ValueError):
        derive_key(b"", a)


def test_the_data_purpose_is_its_own() -> None:
    s = Secret.from_bytes(b"s" * 32)
    assert len({s.key(PURPOSE_DATA), s.key(PURPOSE_BOOTSTRAP), s.key(PURPOSE_CONTROL)}) == 3


def test_a_replayed_answer_fails_on_a_new_connection() -> None:
    key = derive_key(TOKEN, None)
    first = ServerHandshake.new(key, EID)
    recorded = ClientHandshake.new(key, EID, peer="s").answer(first.challenge())
    first.verdict(recorded)  # valid where it was made
    second = ServerHandshake.new(key, EID)
    assert second.nonce != first.nonce
    with pytest.raises(HandshakeFailed, match="proof is wrong"):
        second.verdict(recorded)


def test_a_replayed_verdict_fails_for_a_new_client_nonce() -> None:
    key = derive_key(TOKEN, None)
    server = ServerHandshake.new(key, EID, nonce=b"n" * 32)  # an impostor replays the
    challenge = server.challenge()  # same challenge and the verdict it once recorded
    recorded = server.verdict(ClientHandshake.new(key, EID, peer="s").answer(challenge))
    client = ClientHandshake.new(key, EID, peer="s")
    client.answer(challenge)
    with pytest.raises(HandshakeFailed, match="did not prove"):
        client.check_verdict(challenge, recorded)


def test_reflection_is_refused() -> None:
    """A client that echoes the server's nonce, or sends the server's own frames back."""
    key = derive_key(TOKEN, None)
    server = ServerHandshake.new(key, EID)
    echo = ClientHandshake(key, EID, server.nonce, "s").answer(server.challenge())
    with pytest.raises(HandshakeFailed, match="echoed"):
        server.verdict(echo)
    with pytest.raises(HandshakeFailed, match="B, want"):
        server.verdict(server.challenge())  # a server frame is not an ANSWER


def test_a_stale_endpoint_is_named() -> None:
    with pytest.raises(HandshakeFailed, match="stale"):
        _run(derive_key(TOKEN, None), derive_key(TOKEN, None), client_eid="ff" * 8)


@pytest.mark.parametrize("cut", [0, 1, 7, CLIENT_FRAME - 1])
def test_truncated_answers_are_refused(cut: int) -> None:
    key = derive_key(TOKEN, None)
    server = ServerHandshake.new(key, EID)
    answer = ClientHandshake.new(key, EID, peer="s").answer(server.challenge())
    with pytest.raises(HandshakeFailed, match=f"{cut} B, want {CLIENT_FRAME} B"):
        server.verdict(answer[:cut])


@pytest.mark.parametrize("cut", [0, 4, SERVER_FRAME - 1])
def test_truncated_server_frames_are_refused(cut: int) -> None:
    key = derive_key(TOKEN, None)
    server = ServerHandshake.new(key, EID)
    client = ClientHandshake.new(key, EID, peer="s")
    challenge = server.challenge()
    with pytest.raises(HandshakeFailed, match="B, want"):
        client.answer(challenge[:cut])
    verdict = server.verdict(client.answer(challenge))
    with pytest.raises(HandshakeFailed, match="B, want"):
        client.check_verdict(challenge, verdict[:cut])


def test_oversized_frames_are_refused() -> None:
    key = derive_key(TOKEN, None)
    server = ServerHandshake.new(key, EID)
    client = ClientHandshake.new(key, EID, peer="s")
    answer = client.answer(server.challenge())
    with pytest.raises(HandshakeFailed, match=f"{CLIENT_FRAME + 1} B"):
        server.verdict(answer + b"\0")
    with pytest.raises(HandshakeFailed, match=f"{SERVER_FRAME + 1} B"):
        client.answer(server.challenge() + b"\0")


def test_bad_magic_version_and_kind_are_refused() -> None:
    key = derive_key(TOKEN, None)
    server = ServerHandshake.new(key, EID)
    answer = ClientHandshake.new(key, EID, peer="s").answer(server.challenge())
    with pytest.raises(HandshakeFailed, match="magic"):
        server.verdict(b"KVHT" + answer[4:])  # a data frame where the ANSWER belongs
    with pytest.raises(HandshakeFailed, match="v9"):
        server.verdict(answer[:4] + b"\x09" + answer[5:])
    with pytest.raises(HandshakeFailed, match="kind 1"):
        server.verdict(answer[:5] + b"\x01" + answer[6:])


@pytest.mark.parametrize(("reason", "words"), [(Refusal.BUSY, "cap"),
                                               (Refusal.BAD_PROOF, "refused our proof")])
def test_a_refusal_tells_the_client_why(reason: Refusal, words: str) -> None:
    frame = refusal(reason, EID)
    assert len(frame) == SERVER_FRAME
    client = ClientHandshake.new(TOKEN, EID, peer="tcp at x:1")
    with pytest.raises(HandshakeFailed, match=words):
        client.answer(frame)  # in place of the challenge (over a cap)
    challenge = ServerHandshake.new(TOKEN, EID).challenge()
    client.answer(challenge)
    with pytest.raises(HandshakeFailed, match=words):
        client.check_verdict(challenge, frame)  # in place of the verdict (a wrong key)


def test_endpoint_ids() -> None:
    assert len(bytes.fromhex(new_endpoint_id())) == ha.ENDPOINT_ID_BYTES
    assert new_endpoint_id() != new_endpoint_id()
    with pytest.raises(HandshakeFailed, match="hex"):
        ServerHandshake.new(TOKEN, "not hex")


def test_the_core_does_no_io() -> None:
    """Bytes in, bytes out: the module imports nothing that touches sockets, threads,
    files or clocks."""
    tree = ast.parse(Path(ha.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= {"__future__", "enum", "hashlib", "hmac", "secrets", "struct",
                     "dataclasses"}, names
