"""The session centre's small parts, with no socket and no agent: a request against a
fake :class:`~kvhandoff.session.request.host.RankHost`, the peer watch, the layout's components."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from kvhandoff.lab import shapes
from kvhandoff.layout import Component, Layout
from kvhandoff.protocol import Message
from kvhandoff.session import Receiver, RequestAborted, Sender, SessionConfig, Status
from kvhandoff.session.peers.prefill_groups import GroupKey, PrefillGroup
from kvhandoff.session.rank.liveness.watch import PeerWatch
from kvhandoff.session.request.components import Components, repageable
from kvhandoff.session.request.host import NO_BACKLOG, Backlog, Request, Role
from kvhandoff.state_types import StateType


class _Groups:
    def get(self, key: GroupKey) -> PrefillGroup:
        return PrefillGroup(key)  # stays CONNECTING: nobody handshakes here


class FakeHost:
    """Just enough of a RankHost to open and end a request; records what it was asked."""

    def __init__(self, role: Role) -> None:
        self.role = role
        self.config = SessionConfig()
        self.groups = _Groups()
        self.attached: list[Request] = []
        self.finished_sides: list[Request] = []
        self.posted: list[tuple[str, Message]] = []

    def attach(self, side: Request) -> Backlog:
        self.attached.append(side)
        return NO_BACKLOG

    def finished(self, side: Request) -> None:
        self.finished_sides.append(side)

    def post(self, endpoint: str, msg: Message) -> None:
        self.posted.append((endpoint, msg))


def test_a_sender_sees_only_its_host() -> None:
    host = FakeHost(Role.PREFILL)
    s = Sender(host, 7)  # type: ignore[arg-type]  # a partial host, on purpose
    assert host.attached == [s] and s.status is Status.BOOTSTRAPPING
    s.abort("test")
    assert s.status is Status.FAILED and isinstance(s.error, RequestAborted)
    assert s.settled and host.finished_sides == [s]
    assert host.posted == []  # no decode rank sent indices: nobody to tell


def test_a_receiver_sees_only_its_host() -> None:
    host = FakeHost(Role.DECODE)
    r = Receiver(host, "127.0.0.1:1", "r1", dp_rank=0)  # type: ignore[arg-type]
    assert host.attached == [r] and r.status is Status.BOOTSTRAPPING
    r.abort()
    assert r.released and r.release_reason == "no prefill rank was sent the indices"
    assert host.finished_sides == [r] and host.posted == []


def test_a_request_refuses_a_host_of_the_other_role() -> None:
    with pytest.raises(ValueError, match="a Sender needs a prefill agent"):
        Sender(FakeHost(Role.DECODE), 1)  # type: ignore[arg-type]


def _link_down(endpoint: str) -> bool:
    return False


def test_a_suspect_is_cleared_only_by_an_answer_to_a_later_ping() -> None:
    w = PeerWatch(interval=1.0, timeout=3.0)
    early = w.next_seq()
    w.suspect("a")
    assert w.suspects == 1
    assert w.tick(set(), 10.0, _link_down) == (["a"], [], [])  # watched, no request left
    w.acked("a", early)
    assert w.suspects == 1
    w.acked("a", w.next_seq())
    assert w.suspects == 0


def test_a_lost_peer_is_remembered_a_while_unless_it_speaks() -> None:
    w = PeerWatch(interval=1.0, timeout=3.0, memory=5.0)
    w.suspect("a")
    w.lost("a", 10.0)
    assert w.is_lost("a") and w.suspects == 0
    w.tick(set(), 14.0, _link_down)
    assert w.is_lost("a")
    w.tick(set(), 15.5, _link_down)
    assert not w.is_lost("a")
    w.lost("b", 20.0)
    w.heard("b", 20.5)
    assert not w.is_lost("b")


def test_a_probe_is_answered_or_times_out() -> None:
    w = PeerWatch(interval=1.0, timeout=3.0)
    assert w.probe(lambda seq: w.acked("a", seq), timeout=5.0)
    assert not w.probe(lambda seq: None, timeout=0.01)

    def later(seq: int) -> None:
        threading.Timer(0.01, w.acked, ("a", seq)).start()
    assert w.probe(later, timeout=5.0)


def test_components_name_each_part_of_a_layout() -> None:
    model = shapes.tiny(shapes.get("qwen3_next"))
    lay = shapes.layout_for(model, tp_rank=0, tp_size=1, page_size=4, num_pages=4,
                            num_slots=2, alloc=lambda n: 0)
    c = Components.of(lay)
    names = [x.name for x in lay.components]
    assert c.kv in names and c.aux == "aux" and c.aux_tensor is not None
    assert set(c.states) == set(names) - {c.kv, c.aux}
    assert c.kv_repageable == repageable(lay, c.kv)
    two = Layout(page_size=4, components=(
        *lay.components,
        dataclasses.replace(lay.component("aux"), name="aux2"),
    ))
    with pytest.raises(ValueError, match="at most one KV/MLA component and one aux"):
        Components.of(two)
    assert Components.of(Layout(page_size=1, components=(
        Component(type=StateType.MAMBA, name="m", tensors=lay.component(c.states[0]).tensors),
    ))).kv is None
