"""Prefill's ``transfer`` phase is the transport's: from when it began moving the first
write's bytes (``Handle.started``) to when it acknowledged the last (``Handle.finished``).
The transport's own preparation counts as ``prepare``, the session noticing the
acknowledgement as ``settle``. Its ``move`` phase is the part in which the bytes moved,
timed where they moved — the span NIXL's ``xferDuration`` covers: cma's receiver reports
its own; for a transport that pushes, it is the transfer."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.observe import timeline as tl
from kvhandoff.transport import Handle


def test_the_transfer_phase_is_the_transports_span(monkeypatch: pytest.MonkeyPatch) -> None:
    with BootstrapServer() as srv:
        rig = Rig(srv.url, "phases")
        try:
            transport = rig.prefill.transport
            real = transport.submit
            handles: list[Handle] = []

            def submit(peer: Any, plan: Any, **kw: Any) -> Handle:
                h = real(peer, plan, **kw)
                h.started = time.monotonic()  # later than the submit call began
                handles.append(h)
                return h

            monkeypatch.setattr(transport, "submit", submit)
            s, _ = rig.handoff(rig.plan("timed", block=1))
            assert len(handles) > 1, "the rig's request should be written in several chunks"
            at = s.timeline
            # writes may complete in any order: the earliest start, the latest end
            assert at.at(tl.WRITE) == min(h.started for h in handles if h.started)
            assert at.at(tl.WRITTEN) == max(h.finished for h in handles if h.finished)
            events = [at.at(e) for e in (tl.INDICES, tl.WRITE, tl.WRITTEN, tl.SETTLED)]
            assert None not in events and events == sorted(events)  # type: ignore[type-var]
        finally:
            rig.close()


@pytest.mark.parametrize("name", ["cma", "tcp"])
def test_the_move_phase_is_timed_where_the_bytes_move(monkeypatch: pytest.MonkeyPatch,
                                                      name: str) -> None:
    with BootstrapServer() as srv:
        rig = Rig(srv.url, f"moves-{name}", transport=name)
        try:
            transport = rig.prefill.transport
            real = transport.submit
            handles: list[Handle] = []

            def submit(peer: Any, plan: Any, **kw: Any) -> Handle:
                handles.append(real(peer, plan, **kw))
                return handles[-1]

            monkeypatch.setattr(transport, "submit", submit)
            s, _ = rig.handoff(rig.plan("moved", block=1))
            at = s.timeline
            done = [h for h in handles if h.finished is not None]
            assert len(done) > 1
            if name == "cma":  # the receiver's span, inside the sender's, on one clock
                assert all(h.moving is not None and h.moved is not None for h in done)
                assert all(h.started <= h.moving <= h.moved <= h.finished  # type: ignore[operator]
                           for h in done)
                assert at.at(tl.MOVING) == min(h.moving for h in done)  # type: ignore[type-var]
                assert at.at(tl.MOVED) == max(h.moved for h in done)  # type: ignore[type-var]
            else:  # tcp pushes: its move is its transfer
                assert all(h.moving is None and h.moved is None for h in done)
                assert at.at(tl.MOVING) == at.at(tl.WRITE)
                assert at.at(tl.MOVED) == at.at(tl.WRITTEN)
            events = [at.at(e) for e in tl.ORDER["prefill"]]
            assert None not in events and events == sorted(events)  # type: ignore[type-var]
        finally:
            rig.close()
