"""Prefill's ``transfer`` phase is the transport's: from when it began moving the first
write's bytes (``Handle.started``) to when it acknowledged the last (``Handle.finished``)
— the span NIXL's ``xferDuration`` covers. The transport's own preparation counts as
``prepare``, the session noticing the acknowledgement as ``settle``."""

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
