"""Decode's held control messages (:mod:`kvhandoff.session.control.post_batch`): what goes out,
packed, in which order; no socket, no agent."""

from __future__ import annotations

import threading

import pytest

from kvhandoff.protocol import (
    Abort,
    Heartbeat,
    IndexListMsg,
    LocalProtocolError,
    Message,
    RankId,
    TransferInit,
    TransferInits,
)
from kvhandoff.session.control.post_batch import PostBatcher, init_bytes, pack

ME = RankId(instance="decode")


def init(rid: int, pages: int = 1) -> TransferInit:
    return TransferInit(request_id=rid, rank=ME, indices={"kv": IndexListMsg.of(range(pages))})


def abort(rid: int) -> Abort:
    return Abort(request_id=rid, rank=ME, reason="engine")


def flat(out: list[tuple[str, Message]]) -> list[tuple[str, object]]:
    """What each endpoint hears, message by message: an init's id, a pack's ids."""
    def one(m: Message) -> object:
        if isinstance(m, TransferInits):
            return tuple(i.request_id for i in m.inits)
        if isinstance(m, TransferInit):
            return m.request_id
        return type(m).__name__
    return [(ep, one(m)) for ep, m in out]


def test_each_endpoints_inits_go_as_one_pack_in_order_and_a_lone_one_as_itself() -> None:
    posts = [("a", init(1)), ("b", init(2)), ("a", init(3)), ("a", init(4)), ("c", init(5))]
    assert flat(pack(posts)) == [("a", (1, 3, 4)), ("b", 2), ("c", 5)]


def test_nothing_is_reordered_around_a_message_that_is_not_an_init() -> None:
    """An Abort held after its request's init still follows it; inits before and after
    it pack separately."""
    posts = [("a", init(1)), ("a", init(2)), ("a", abort(2)), ("a", init(3)),
             ("b", Heartbeat(seq=1, sender="d")), ("b", init(4)), ("a", init(5))]
    assert flat(pack(posts)) == [("a", (1, 2)), ("a", "Abort"), ("a", (3, 5)),
                                 ("b", "Heartbeat"), ("b", 4)]


def test_a_pack_is_bounded_in_count_and_in_index_bytes() -> None:
    posts = [("a", init(i)) for i in range(7)]
    assert flat(pack(posts, max_inits=3)) == [("a", (0, 1, 2)), ("a", (3, 4, 5)), ("a", 6)]
    big = [("a", init(i, pages=100)) for i in range(4)]
    room = 2 * init_bytes(big[0][1])  # two fit, a third would not
    assert flat(pack(big, max_bytes=room)) == [("a", (0, 1)), ("a", (2, 3))]
    assert flat(pack(big, max_bytes=1)) == [("a", 0), ("a", 1), ("a", 2), ("a", 3)]


def test_init_bytes_bounds_the_encoded_size() -> None:
    from kvhandoff.protocol import encode_message
    for m in (init(1, 0), init(2, 1000), TransferInit(
            request_id="r\u00e9" * 500, rank=RankId(instance="i" * 300, dp_rank=2**40,
                                                   tp_rank=7, tp_size=8, pp_rank=3, pp_size=4),
            indices={f"c{i}" * 20: IndexListMsg.of([1], first_row=2**50, num_rows=2**50,
                                                  positions=[4]) for i in range(30)}
            | {"none": None}, decode_prefix_len=2**40, expect_checksum=True)):
        assert len(encode_message(m)) <= init_bytes(m)


class Wire:
    def __init__(self, fail_on: object = None) -> None:
        self.sent: list[tuple[str, Message]] = []
        self.fail_on = fail_on

    def send(self, endpoint: str, msg: Message) -> None:
        if isinstance(msg, TransferInit) and msg.request_id == self.fail_on:
            raise LocalProtocolError("cannot encode it")
        self.sent.append((endpoint, msg))


def test_posts_wait_for_the_outermost_block_of_their_own_thread() -> None:
    wire = Wire()
    b = PostBatcher(wire.send)
    assert not b.hold("a", init(0))  # outside any block: the caller sends it
    other: list[bool] = []
    with b.held():
        with b.held():
            assert b.hold("a", init(1))
        assert b.hold("a", init(2))
        t = threading.Thread(target=lambda: other.append(b.hold("a", init(9))))
        t.start()
        t.join()
        assert wire.sent == []  # nested exit sends nothing
    assert other == [False]  # another thread's posts are never held
    assert flat(wire.sent) == [("a", (1, 2))]
    with b.held():
        pass
    assert len(wire.sent) == 1  # an empty block sends nothing


def test_a_post_that_cannot_go_does_not_keep_the_others_back() -> None:
    wire = Wire(fail_on=2)
    b = PostBatcher(wire.send)
    with pytest.raises(LocalProtocolError), b.held():
        b.hold("a", init(1))
        b.hold("b", init(2))
        b.hold("c", init(3))
    assert flat(wire.sent) == [("a", 1), ("c", 3)]
    with b.held():  # the failure left nothing behind
        b.hold("a", init(4))
    assert flat(wire.sent)[-1] == ("a", 4)
