"""``transport="auto"``: the fastest transport that works for each peer, chosen at connect.

An :class:`AutoTransport` holds one sub-transport per transport it offers
(:func:`~kvhandoff.transport.auto.policy.wanted`: the best same-host path that runs
here — ``cma`` —, an RDMA engine where this host has RDMA NICs, and ``tcp`` always).
Memory registered with it is registered with each of them, in place. Its endpoint
carries this host's identity (boot id and network namespace), whether it has RDMA, and
every sub-transport's endpoint; ``connect`` picks, for that peer, the best transport
both sides offer (:func:`~kvhandoff.transport.auto.policy.choose`), falls back to the
next when its connect fails, and returns a peer bound to it. ``submit`` goes to that
sub-transport. So two processes on one host move each byte once, and a peer on another
host (or network namespace) gets tcp, or RDMA where both have it.

What it picks is logged once at start-up (per process and set of offers) and once per
distinct choice at connect, never per request. Options are passed to every
sub-transport that takes them (``host``: tcp's listen address, ``io_timeout`` ...; an
option none takes is an error); ``offers``: restrict the transports offered (e.g.
``("cma", "tcp")``); ``data_secret``: keys each sub-transport's data plane.
"""

from __future__ import annotations

import base64
import inspect
import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvhandoff.layout import Region
from kvhandoff.plan.model import Plan
from kvhandoff.transport.auto.policy import Choice, Offer, choose, summary, wanted
from kvhandoff.transport.base import (
    Availability,
    Capabilities,
    Handle,
    NoticeHandler,
    Peer,
    TransferState,
    Transport,
)
from kvhandoff.transport.errors import ConnectError, TransportError
from kvhandoff.transport.framing.served import endpoint_fields
from kvhandoff.transport.host import HostIdentity
from kvhandoff.transport.registry import create_transport, transport_class, transport_names

log = logging.getLogger("kvhandoff.transport")

ENDPOINT_KIND = "auto"
ENDPOINT_VERSION = 1
_RDMA_SYSFS = "/sys/class/infiniband"
_said: set[str] = set()  # start-up and choice lines already logged in this process
_said_lock = threading.Lock()


def rdma_here() -> bool:
    """Whether this host has an RDMA device (``/sys/class/infiniband`` lists one)."""
    try:
        return bool(os.listdir(_RDMA_SYSFS))
    except OSError:
        return False


def usable_here() -> frozenset[str]:
    """The registered transports (but auto) that can run here. Never raises."""
    out = set()
    for n in transport_names():
        if n == ENDPOINT_KIND:
            continue
        try:
            if transport_class(n).usable().ok:
                out.add(n)
        except Exception as e:  # a broken engine module is not offered
            log.debug("auto: %s is not offered: %s", n, e)
    return frozenset(out)


def _once(level: int, line: str) -> None:
    with _said_lock:
        if line in _said:
            return
        _said.add(line)
    log.log(level, "%s", line)


class AutoPeer(Peer):
    """A peer reached through the sub-transport ``via`` (``inner`` is that one's peer)."""

    def __init__(self, endpoint: bytes, via: str, inner: Peer) -> None:
        super().__init__(endpoint, f"{via}>{inner.name}")
        self.via, self.inner = via, inner

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def close(self) -> None:
        self.inner.close()


class AutoTransport(Transport):
    """Thread-safe (see the base contract); its sub-transports are closed with it."""

    name = "auto"
    capabilities = Capabilities(strided=True, cross_host=True, self_completing=True,
                                notices=True)

    def __init__(self, *, offers: Sequence[str] | None = None,
                 data_secret: bytes | None = None, **options: Any) -> None:
        super().__init__()
        self._rdma = rdma_here()
        names = self._names(offers)
        self._subs: dict[str, Transport] = {}
        self._owners: dict[Handle, Transport] = {}  # pending handles of polled engines
        try:
            self._build(names, data_secret, options)
        except BaseException:
            self.close()
            raise
        caps = [type(t).capabilities for t in self._subs.values()]
        self.capabilities = replace(  # type: ignore[misc]  # what every sub-transport can do
            self.capabilities, memory=frozenset.intersection(*(c.memory for c in caps)),
            self_completing=all(c.self_completing for c in caps),
            notices=all(c.notices for c in caps))
        self.summary = summary(tuple(self._subs), self._rdma)
        _once(logging.INFO, f"transport {self.summary}")

    def _names(self, offers: Sequence[str] | None) -> tuple[str, ...]:
        usable = usable_here()
        if offers is None:
            return wanted(usable, self._rdma)
        bad = [n for n in offers if n not in usable or n in ("auto", "memory", "shm")]
        if bad or not offers:
            raise ValueError(f"auto: cannot offer {bad or 'nothing'}: offers are transports "
                             f"usable here that register memory in place "
                             f"({sorted(usable - {'auto', 'memory', 'shm'})})")
        return tuple(offers)

    def _build(self, names: tuple[str, ...], data_secret: bytes | None,
               options: dict[str, Any]) -> None:
        """One sub-transport per name, each given the options it takes."""
        used: set[str] = set()
        for n in names:
            params = inspect.signature(transport_class(n)).parameters
            mine = {k: v for k, v in options.items() if k in params}
            if n == "mooncake" and self._rdma and "protocol" in params:
                mine.setdefault("protocol", "rdma")
            used |= mine.keys()
            self._subs[n] = create_transport(n, data_secret=data_secret, **mine)
        unused = sorted(options.keys() - used)
        if unused:
            raise ValueError(f"auto: no transport it offers ({', '.join(names)}) takes "
                             f"option(s) {unused}")

    @classmethod
    def usable(cls) -> Availability:
        """Always (tcp always runs); the reason says what it would pick here."""
        rdma = rdma_here()
        return Availability(True, summary(wanted(usable_here(), rdma), rdma))

    @property
    def offered(self) -> tuple[str, ...]:
        """The transports this side offers, in order."""
        return tuple(self._subs)

    def _register_regions(self, regions: list[Region]) -> None:
        for t in self._subs.values():
            t.register(regions)

    def endpoint(self) -> bytes:
        self._check_open()
        subs = {n: base64.b64encode(t.endpoint()).decode() for n, t in self._subs.items()}
        return json.dumps({"kind": ENDPOINT_KIND, "v": ENDPOINT_VERSION,
                           "host": HostIdentity.here().as_list(), "rdma": self._rdma,
                           "offers": subs}).encode()

    def choice(self, peer_endpoint: bytes) -> tuple[Choice, dict[str, bytes]]:
        """What :meth:`connect` would try for that peer, and the peer's endpoints."""
        host, rdma, offers = endpoint_fields(peer_endpoint, ENDPOINT_KIND, ENDPOINT_VERSION,
                                             "host", "rdma", "offers")
        try:
            theirs = {str(n): base64.b64decode(str(e), validate=True)
                      for n, e in dict(offers).items()}
        except (ValueError, TypeError) as e:
            raise ConnectError(f"auto endpoint with malformed offers: {e}") from None
        mine = Offer(HostIdentity.here(), self._rdma, frozenset(self._subs))
        peer = Offer(HostIdentity.parse(host) or HostIdentity("", ""), bool(rdma),
                     frozenset(theirs))
        return choose(mine, peer), theirs

    def connect(self, peer_endpoint: bytes) -> AutoPeer:
        """Connect through the best transport both sides offer for this peer; the next
        one if that fails (logged once per reason). ConnectError if none works."""
        self._check_open()
        choice, theirs = self.choice(peer_endpoint)
        if not choice.names:
            raise ConnectError(f"auto: the peer offers {sorted(theirs)}, this side "
                               f"{list(self._subs)}: nothing in common for {choice.where}")
        failures = []
        for n in choice.names:
            try:
                inner = self._subs[n].connect(theirs[n])
            except TransportError as e:
                failures.append(f"{n}: {e}")
                _once(logging.WARNING, f"transport auto: {n} failed for {choice.where} "
                                       f"({e}); trying the next")
                continue
            _once(logging.INFO, f"transport auto: using {choice.reason(n)}")
            return AutoPeer(peer_endpoint, n, inner)
        raise ConnectError(f"auto: no transport reached the peer ({choice.where}): "
                           + "; ".join(failures))

    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        p = self._admit(peer, notice, AutoPeer)
        sub = self._subs[p.via]
        h = sub.submit(p.inner, plan, notice=notice)
        if not type(sub).capabilities.self_completing:  # its poll/wait drive progress
            with self._reg_lock:
                self._owners[h] = sub
            h.add_done_callback(self._disown)
        return h

    def _disown(self, h: Handle) -> None:
        with self._reg_lock:
            self._owners.pop(h, None)

    def poll(self, handle: Handle) -> TransferState:
        sub = self._owners.get(handle)
        return handle.state if sub is None else sub.poll(handle)

    def wait(self, handle: Handle, timeout: float) -> TransferState:
        sub = self._owners.get(handle)
        return handle.wait(timeout) if sub is None else sub.wait(handle, timeout)

    def on_notice(self, handler: NoticeHandler | None) -> None:
        super().on_notice(handler)
        for t in self._subs.values():
            t.on_notice(handler)

    @property
    def staging_slots_in_use(self) -> int:
        return sum(t.staging_slots_in_use for t in self._subs.values())

    def _close(self) -> None:
        for t in reversed(list(self._subs.values())):
            t.close()
