"""The control-message MAC (kvhandoff.session.control.auth), driven with no sockets: bytes
and a clock in, accept or refuse out."""

from __future__ import annotations

import pytest

from kvhandoff.secret import PURPOSE_BOOTSTRAP, PURPOSE_CONTROL, Secret
from kvhandoff.session.control.auth import (
    HEADER_BYTES,
    MAGIC,
    Signer,
    Stream,
    Unauthenticated,
    Verifier,
    is_signed,
)

KEY = Secret.from_bytes(b"k" * 32).key(PURPOSE_CONTROL)
A, B, C = "tcp://10.0.0.1:7000", "tcp://10.0.0.2:7000", "tcp://10.0.0.3:7000"
T0 = 1_764_000_000.0
MSG = b"\x82\xa4type\xa5Abort"  # any bytes: the MAC does not parse the message


def _pair(now: float = T0, nonce: int = 1) -> tuple[Signer, Verifier]:
    return Signer(KEY, endpoint=A, now=now, nonce=nonce), Verifier(KEY, endpoint=B)


def _check(v: Verifier, head: bytes, payload: bytes = MSG, *, sender: str | None = None,
           stream: Stream = Stream.DEALER, now: float = T0) -> str:
    """The sender the verified header names (``sender``: the one it must name)."""
    got = v.check(head, payload, sender=None if sender is None else sender.encode(),
                  stream=stream, now=now)
    return got.decode()


def _refused(v: Verifier, head: bytes, payload: bytes = MSG, **kw: object) -> str:
    with pytest.raises(Unauthenticated) as e:
        _check(v, head, payload, **kw)  # type: ignore[arg-type]
    return e.value.reason


def test_a_signed_message_verifies_once() -> None:
    s, v = _pair()
    head = s.sign(MSG, recipient=B.encode(), stream=Stream.DEALER, now=T0)
    assert len(head) == HEADER_BYTES + len(A) and is_signed(head) and head.startswith(MAGIC)
    assert _check(v, head) == A
    assert "replayed" in _refused(v, head)
    assert v.senders == 1


def test_a_sealed_frame_opens_to_its_payload_and_sender() -> None:
    s, v = _pair()
    frame = s.seal(MSG, recipient=B.encode(), stream=Stream.DEALER, now=T0)
    payload, named = v.open(frame, stream=Stream.DEALER, now=T0)
    assert bytes(payload) == MSG and named == A.encode()
    with pytest.raises(Unauthenticated, match="replayed"):
        v.open(frame, stream=Stream.DEALER, now=T0)
    big = bytes(range(256)) * 1024  # past the one-update size: MACed in two updates
    frame = s.seal(big, recipient=B.encode(), stream=Stream.DEALER, now=T0)
    assert bytes(v.open(frame, stream=Stream.DEALER, now=T0)[0]) == big
    for broken in (frame[:-1], frame + b"x", frame[:HEADER_BYTES + 3], MSG, b""):
        with pytest.raises(Unauthenticated):
            v.open(broken, stream=Stream.DEALER, now=T0)


def test_a_plain_message_is_never_mistaken_for_a_header() -> None:
    assert not is_signed(MSG) and not is_signed(b"")
    _, v = _pair()
    assert "no MAC" in _refused(v, b"")
    assert "no MAC" in _refused(v, MSG)


@pytest.mark.parametrize("what", ["payload", "named", "recipient", "stream", "key", "purpose",
                                  "header"])
def test_anything_changed_fails_the_mac(what: str) -> None:
    s, v = _pair()
    head = s.sign(MSG, recipient=B.encode(), stream=Stream.DEALER, now=T0)
    kw: dict[str, object] = {}
    if what == "payload":
        kw["payload"] = MSG + b"x"
    elif what == "named":  # a stranger renames the sender in the header: the MAC breaks
        head = head[:HEADER_BYTES] + C.encode()
    elif what == "recipient":  # captured on its way to B, replayed to C
        v = Verifier(KEY, endpoint=C)
    elif what == "stream":
        kw["stream"] = Stream.ROUTER
    elif what == "key":
        v = Verifier(Secret.from_bytes(b"x" * 32).key(PURPOSE_CONTROL), endpoint=B)
    elif what == "purpose":  # the bootstrap's key is not the control plane's
        v = Verifier(Secret.from_bytes(b"k" * 32).key(PURPOSE_BOOTSTRAP), endpoint=B)
    elif what == "header":  # e.g. a bumped sequence number
        head = head[:-1] + bytes([head[-1] ^ 1])
    assert "bad MAC" in _refused(v, head, **kw)
    assert v.senders == 0  # nothing remembered for a refusal


def test_a_reply_must_name_the_endpoint_its_dealer_dials() -> None:
    s, v = _pair()
    head = s.sign(MSG, recipient=B.encode(), stream=Stream.ROUTER, now=T0)
    assert "names sender" in _refused(v, head, sender=C, stream=Stream.ROUTER)
    assert _check(v, head, sender=A, stream=Stream.ROUTER) == A


def test_malformed_headers_are_refused() -> None:
    s, v = _pair()
    head = s.sign(MSG, recipient=B.encode(), stream=Stream.DEALER, now=T0)
    assert "malformed" in _refused(v, head + b"x")
    assert "malformed" in _refused(v, head[:-1])
    assert "no MAC" in _refused(v, head[:HEADER_BYTES - 1])
    assert v.senders == 0


def test_sequence_numbers_must_grow_per_sender_and_stream() -> None:
    s, v = _pair()
    heads = [s.sign(MSG, recipient=B.encode(), stream=Stream.DEALER, now=T0) for _ in range(3)]
    _check(v, heads[0])
    _check(v, heads[2])  # a gap is fine (a message to another peer took seq 2)
    assert "replayed" in _refused(v, heads[1])  # older than the newest: refused
    reply = s.sign(MSG, recipient=B.encode(), stream=Stream.ROUTER, now=T0)
    _check(v, reply, stream=Stream.ROUTER)  # its own stream: not ordered with the DEALER's
    assert v.senders == 2


def test_stale_and_future_timestamps_are_refused() -> None:
    s, v = _pair()
    old = s.sign(MSG, recipient=B.encode(), stream=Stream.DEALER, now=T0)
    assert "outside" in _refused(v, old, now=T0 + 121)
    future = s.sign(MSG, recipient=B.encode(), stream=Stream.DEALER, now=T0 + 121)
    assert "outside" in _refused(v, future, now=T0)
    _check(v, old, now=T0 + 119)  # within the window (clock skew) is fine
    assert v.senders == 1


def test_a_restarted_peer_is_accepted_and_each_run_keeps_its_own_sequence() -> None:
    first, v = _pair(now=T0, nonce=1)
    old = [first.sign(MSG, recipient=B.encode(), stream=Stream.DEALER, now=T0 + i)
           for i in range(3)]
    _check(v, old[1], now=T0)
    again = Signer(KEY, endpoint=A, now=T0 + 5, nonce=2)  # same endpoint, restarted
    new = again.sign(MSG, recipient=B.encode(), stream=Stream.DEALER, now=T0 + 5)
    _check(v, new, now=T0 + 5)  # its seq starts at 1 again: a new epoch
    assert "replayed" in _refused(v, new, now=T0 + 5)
    assert "replayed" in _refused(v, old[0], now=T0 + 6)  # the old run's, seen past it
    assert "replayed" in _refused(v, old[1], now=T0 + 6)
    _check(v, old[2], now=T0 + 6)  # never delivered, within the window: accepted once
    assert v.senders == 1


def _silencer(now: float, *, start: float, nonce: int, seq: int) -> bytes:
    """A frame naming A, signed with the deployment key by another holder of it, with
    the epoch and sequence number it chose."""
    from kvhandoff.session.control import auth
    names = auth._names(A.encode(), B.encode(), Stream.DEALER)
    signed = auth._SIGNED.pack(int(now * 1000), int(start * 1000), nonce, seq)
    return MAGIC + auth._Mac(KEY).tag(names, signed, MSG) + signed + auth._bound(A.encode())


@pytest.mark.parametrize("attack", ["future_epoch", "own_epoch_top_seq", "many_epochs"])
def test_a_frame_under_another_peers_name_cannot_silence_it(attack: str) -> None:
    """Finding "lower": a holder of the secret signs frames naming peer A. Before, one
    frame with an epoch starting later than A's (or A's epoch with the top sequence
    number) made every later frame of A a "replay" for the rest of the run. Now A's
    frames keep verifying; the forger cannot even learn A's nonce towards B from the
    frames A sends the forger."""
    s, v = _pair(now=T0, nonce=7)
    _check(v, s.sign(MSG, recipient=B.encode(), stream=Stream.DEALER, now=T0))
    seen_by_c = s.sign(MSG, recipient=C.encode(), stream=Stream.DEALER, now=T0)  # to C
    nonce_c = int.from_bytes(seen_by_c[4 + 16 + 16:4 + 16 + 24], "big")
    assert nonce_c != s.nonce(B.encode(), Stream.DEALER)
    if attack == "future_epoch":
        forged = [_silencer(T0 + 1, start=T0 + 1, nonce=99, seq=1 << 62)]
    elif attack == "own_epoch_top_seq":  # A's start and the nonce A uses towards C
        forged = [_silencer(T0 + 1, start=T0, nonce=nonce_c, seq=(1 << 64) - 1)]
    else:  # push A's own epoch out of B's memory
        forged = [_silencer(T0 + 1, start=T0 + 1, nonce=n, seq=1) for n in range(20)]
    for f in forged:
        _check(v, f, now=T0 + 1)  # they verify: the forger holds the key
    for i in range(3):
        _check(v, s.sign(MSG, recipient=B.encode(), stream=Stream.DEALER, now=T0 + 2 + i),
               now=T0 + 2 + i)
    assert v.senders == 1


def test_an_epoch_cannot_start_after_its_frame() -> None:
    head = _silencer(T0, start=T0 + 1, nonce=1, seq=1)
    assert "starts after" in _refused(Verifier(KEY, endpoint=B), head, now=T0)


def test_the_replay_state_is_bounded_and_only_verified_frames_enter_it() -> None:
    v = Verifier(KEY, endpoint=B, max_senders=4)
    stranger = Signer(Secret.from_bytes(b"z" * 32).key(PURPOSE_CONTROL), endpoint=C, now=T0)
    for _ in range(100):
        _refused(v, stranger.sign(MSG, recipient=B.encode(), stream=Stream.DEALER, now=T0))
    assert v.senders == 0
    for i in range(10):
        ep = f"tcp://10.0.1.{i}:1"
        head = Signer(KEY, endpoint=ep, now=T0).sign(MSG, recipient=B.encode(),
                                                     stream=Stream.DEALER, now=T0)
        assert _check(v, head) == ep
    assert v.senders == 4


def test_the_epoch_is_the_start_time_and_a_nonce_per_recipient() -> None:
    a = Signer(KEY, endpoint=A, now=T0)
    b = Signer(KEY, endpoint=A, now=T0)
    assert a.start == b.start == int(T0 * 1000)
    assert a.nonce(B.encode(), Stream.DEALER) != b.nonce(B.encode(), Stream.DEALER)
    assert a.nonce(B.encode(), Stream.DEALER) != a.nonce(C.encode(), Stream.DEALER)
    assert a.nonce(B.encode(), Stream.DEALER) != a.nonce(B.encode(), Stream.ROUTER)
    assert a.nonce(B.encode(), Stream.DEALER) == a.nonce(B.encode(), Stream.DEALER)


def test_the_epochs_kept_per_sender_are_bounded() -> None:
    v = Verifier(KEY, endpoint=B, max_epochs=3)
    for i in range(10):
        _check(v, Signer(KEY, endpoint=A, now=T0 + i).sign(
            MSG, recipient=B.encode(), stream=Stream.DEALER, now=T0 + i), now=T0 + i)
    assert v.senders == 1 and len(v._seen[(A.encode(), Stream.DEALER.value)]) == 3


def test_a_short_key_is_refused() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        Signer(b"short", endpoint=A, now=T0)
