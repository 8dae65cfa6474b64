"""Transports that misbehave on purpose, for fault tests. Test support only.

* :class:`DelayedTcp` — a tcp transport whose writes start ``delay`` seconds after
  ``submit`` (from a helper thread), so a test can abort a request while its writes are
  genuinely in flight and check that none lands after decode was told "released".
* :class:`CorruptingTcp` — a tcp transport that, after a write completes, flips one byte
  the write put in component ``component`` (peer in the same process only: it writes
  through the destination address). Checksums must catch it.

Both keep ``name = "tcp"``, so they pair with a plain tcp peer at handshake.
"""

from __future__ import annotations

import ctypes
import threading
import time

from kvhandoff.plan.model import Plan
from kvhandoff.transport.base import Handle, Peer
from kvhandoff.transport.errors import TransportError
from kvhandoff.transport.tcp import TcpTransport


class DelayedTcp(TcpTransport):
    def __init__(self, *, delay: float = 0.3, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.delay = delay

    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        self.check_sources(plan)
        outer = Handle(nbytes=plan.nbytes, peer=peer.name)

        def later() -> None:
            time.sleep(self.delay)
            try:
                inner = super(DelayedTcp, self).submit(peer, plan, notice=notice)
            except TransportError as e:
                outer.set_failed(e)
                return
            state = inner.wait(60.0)
            if inner.error is not None:
                outer.set_failed(inner.error)
            elif state.value == "done":
                outer.set_done()
            else:
                outer.set_failed(TransportError(f"delayed write ended {state.value}"))
            inner.release()

        threading.Thread(target=later, name="test-delayed-write", daemon=True).start()
        return outer


class CorruptingTcp(TcpTransport):
    def __init__(self, *, component: str, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.component = component
        self.corrupted = 0

    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        target = next((e for e in plan.entries if e.component == self.component and e.nbytes),
                      None)
        if target is None:
            return super().submit(peer, plan, notice=notice)
        h = super().submit(peer, plan)  # the in-band status (if any) follows the corruption
        if h.wait(30.0).value == "done":
            do = int(target.pieces[0, 1])
            addr = target.dst_ptr + int(target.dst_idx[0]) * target.dst_unit + do
            cell = ctypes.c_ubyte.from_address(addr)
            cell.value ^= 0xFF
            self.corrupted += 1
        if notice is not None:
            h = super().submit(peer, Plan(entries=()), notice=notice)
        return h
