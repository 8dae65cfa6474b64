"""Transports that misbehave on purpose, for fault tests. Test support only.

* :class:`CountingTcp` — a tcp transport that records how many statuses each submit's
  in-band notice carried (``notices``); with ``refuse`` set, the next submit carrying
  several is refused as a closed peer's would be.
* :class:`DelayedTcp` — a tcp transport whose writes start ``delay`` seconds after
  ``submit`` (from a helper thread), so a test can abort a request while its writes are
  genuinely in flight and check that none lands after decode was told "released".
* :class:`CorruptingTcp` — a tcp transport that, after a write completes, flips one byte
  the write put in component ``component`` (peer in the same process only: it writes
  through the destination address). Checksums must catch it.
* :class:`SourceFlippingTcp` — a tcp transport that flips one byte of a write's
  *source* (component ``component``) while the write runs and restores it afterwards:
  the bytes on the wire differ from those the sender digested when it planned, as a
  faulty wire or NIC would make them. Works across processes; checksums must catch it.
  :class:`ArmedSourceFlippingTcp` does so only while a file exists.
* :class:`FailingTcp` — a tcp transport whose every write to the peers in ``fail_to``
  (their transport endpoints; change the set at any time) fails at once with a
  :class:`~kvhandoff.transport.errors.TransferFailed` naming that peer, while the peer
  itself stays up; ``close_peer`` also closes the transport peer, as a broken data
  connection would (so the session must re-dial it). Writes to other peers are untouched.
  ``connect_delay`` holds every later ``connect`` (a re-dial) that long; ``dialing`` is
  set when one starts, so a test can act while a re-dial is in flight.

All keep ``name = "tcp"``, so they pair with a plain tcp peer at handshake, and are keyed
as an agent of the default deployment keys its own (the user's default secret; pass
``data_secret`` otherwise).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

from kvhandoff.plan.model import Plan, TensorPlan
from kvhandoff.protocol import decode_notice
from kvhandoff.session.config import SessionConfig
from kvhandoff.transport.base import Handle, Peer
from kvhandoff.transport.errors import TransferFailed, TransportClosed, TransportError
from kvhandoff.transport.tcp.client import TcpPeer
from kvhandoff.transport.tcp.transport import TcpTransport


def first_entry(plan: Plan, component: str) -> TensorPlan | None:
    """The first entry of ``plan`` that moves bytes of ``component``, if any."""
    return next((e for e in plan.entries if e.component == component and e.nbytes), None)


def _keyed(options: dict[str, object]) -> dict[str, object]:
    """``options``, with the default deployment's data key unless one is given."""
    return {"data_secret": SessionConfig().data_key(), **options}


class CountingTcp(TcpTransport):
    def __init__(self, **options: object) -> None:
        super().__init__(**_keyed(options))  # type: ignore[arg-type]
        self.notices: list[int] = []
        self.refuse = False

    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        n = 0 if notice is None else len(decode_notice(notice).statuses)
        if self.refuse and n > 1:
            self.refuse = False
            raise TransportClosed("injected: peer closed by its owner")
        self.notices.append(n)
        return super().submit(peer, plan, notice=notice)


class DelayedTcp(TcpTransport):
    def __init__(self, *, delay: float = 0.3, **options: object) -> None:
        super().__init__(**_keyed(options))  # type: ignore[arg-type]
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
        super().__init__(**_keyed(options))  # type: ignore[arg-type]
        self.component = component
        self.corrupted = 0

    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        target = first_entry(plan, self.component)
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


class SourceFlippingTcp(TcpTransport):
    def __init__(self, *, component: str = "kv", **options: object) -> None:
        super().__init__(**_keyed(options))  # type: ignore[arg-type]
        self.component = component
        self.flipped = 0

    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        target = first_entry(plan, self.component)
        if target is None:
            return super().submit(peer, plan, notice=notice)
        so = int(target.pieces[0, 0])
        cell = ctypes.c_ubyte.from_address(
            target.src_ptr + int(target.src_idx[0]) * target.src_unit + so)
        cell.value ^= 0xFF
        h = super().submit(peer, plan, notice=notice)
        h.wait(30.0)
        cell.value ^= 0xFF
        self.flipped += 1
        return h


class ArmedSourceFlippingTcp(SourceFlippingTcp):
    """A :class:`SourceFlippingTcp` that flips only while the file ``armed`` exists, so
    a test arms it for one request of a long-running server (option ``armed``, e.g. in
    ``KVHANDOFF_TRANSPORT_OPTIONS``; registered in lab servers as ``tcp-flip-armed`` by
    the ``flip_transport`` shim)."""

    def __init__(self, *, armed: str, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.armed = armed

    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        if os.path.exists(self.armed):
            return super().submit(peer, plan, notice=notice)
        return TcpTransport.submit(self, peer, plan, notice=notice)


class FailingTcp(TcpTransport):
    def __init__(self, *, fail_to: set[bytes] | None = None, close_peer: bool = False,
                 **options: object) -> None:
        super().__init__(**_keyed(options))  # type: ignore[arg-type]
        self.fail_to: set[bytes] = set(fail_to or ())
        self.close_peer = close_peer
        self.failed = 0  # writes failed on purpose
        self.passed = 0  # writes handed to tcp
        self.connect_delay = 0.0
        self.dials = 0  # connects made (handshakes and re-dials)
        self.dialing = threading.Event()  # a connect started

    def connect(self, peer_endpoint: bytes) -> TcpPeer:
        self.dials += 1
        self.dialing.set()
        if self.connect_delay:
            time.sleep(self.connect_delay)
        return super().connect(peer_endpoint)

    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        if peer.endpoint not in self.fail_to:
            self.passed += 1
            return super().submit(peer, plan, notice=notice)
        self.failed += 1
        h = Handle(nbytes=plan.nbytes, peer=peer.name)
        h.set_failed(TransferFailed(f"injected write failure to {peer.name}"))
        if self.close_peer:
            peer.close()
        return h
