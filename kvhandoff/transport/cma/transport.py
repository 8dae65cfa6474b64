"""The single-copy same-host transport: cross-memory attach, pulled by the receiver.

Each byte moves once, from the sender's registered memory straight into the receiver's,
by ``process_vm_readv`` in the *receiving* process; no shared arena, no mirror, no
socket payload. Memory is registered in place (``register(layout)``: an engine's own
tensors, vLLM's or SGLang's CPU KV cache, the reference engine's pools); nothing is
allocated by the transport (``capabilities.needs_allocate`` is False).

Who copies, and what is checked where (why the receiver pulls):

* The sender checks its sources against its own registrations at ``submit``
  (``OutOfBounds``, as every transport), then sends the plan's paired records.
* The receiver checks every destination byte against *its own current* registrations
  and every source byte against the regions the sender declared, and only then copies,
  into itself. A pushing sender would write into a process that had not checked the
  write (trusting a snapshot of its regions); pulling, nothing ever writes into a
  process that did not check it, the receiver sees registrations made after the
  connect, and a hostile sender can at most make it read the sender's own memory.
* The receiver reads the process the kernel says is at the other end of the socket
  (``SO_PEERCRED``), not a pid the sender claims, and reads back a probe at connect, so
  it reads the right process and a kernel that forbids it (another user, Yama, a
  container without ``CAP_SYS_PTRACE``) fails ``connect`` with the cause and the fix.

Authentication: the endpoint carries a random token and a public id; the connection
opens with the data-plane handshake of :mod:`~kvhandoff.transport.framing.handshake`
(keyed with the token, or with HMAC(``data_secret``, token)); the receiver serves, and
reads, no process that did not prove the key. The socket is abstract (nothing on disk)
and lives in the network namespace: peers on another host or namespace cannot reach it
(``connect`` says so; :mod:`~kvhandoff.transport.auto` picks another transport there).

Completion and aborts: a handle is DONE once the receiver pulled every byte and
answered; the receiver stops between batches when the sender hangs up, when it closes,
or past half the I/O timeout, so a sender whose ``close`` returned, or whose transfer
failed by timeout, has no byte of it landing afterwards (:mod:`.server`).

Options (keyword-only): ``io_timeout`` (default 30 s), ``connect_timeout`` (default
5 s; also bounds the handshake and the probe), ``copy_threads`` (threads sharing one
large pull on the receiving side, default 2), ``data_secret``,
``max_connections_per_host`` (default 32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvhandoff.plan.model import Plan
from kvhandoff.transport.base import Availability, Capabilities, Handle, Peer
from kvhandoff.transport.cma import kernel
from kvhandoff.transport.cma.peer import CmaPeer
from kvhandoff.transport.cma.server import CmaServer
from kvhandoff.transport.errors import ConnectError
from kvhandoff.transport.framing.handshake import derive_key
from kvhandoff.transport.framing.served import (
    MAX_PER_HOST,
    ServedTransport,
    endpoint_fields,
)
from kvhandoff.transport.host import HostIdentity
from kvhandoff.transport.regions import RegionTable

ENDPOINT_KIND = "cma"
ENDPOINT_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class CmaEndpoint:
    """A parsed cma endpoint: where the receiver listens and what proves the right to
    send there."""

    host: HostIdentity
    address: str  # the abstract socket's name (without the leading NUL)
    token: str  # the handshake key's material (never sent on the socket)
    id: str  # public: names the endpoint in the handshake

    @staticmethod
    def parse(raw: bytes) -> CmaEndpoint:
        """ConnectError if ``raw`` is not a cma endpoint of this version."""
        host, address, token, eid = endpoint_fields(raw, ENDPOINT_KIND, ENDPOINT_VERSION,
                                                    "host", "address", "token", "id")
        identity = HostIdentity.parse(host)
        if identity is None:
            raise ConnectError(f"cma endpoint without a host identity: {raw[:80]!r}")
        return CmaEndpoint(host=identity, address=str(address), token=str(token), id=str(eid))


class CmaTransport(ServedTransport):
    """Thread-safe (see the base contract). Peers are closed with the transport."""

    name = "cma"
    capabilities = Capabilities(strided=True, cross_host=False, self_completing=True,
                                notices=True)
    peer_type = CmaPeer

    def __init__(self, *, io_timeout: float = 30.0, connect_timeout: float = 5.0,
                 copy_threads: int = 2, data_secret: bytes | None = None,
                 max_connections_per_host: int = MAX_PER_HOST) -> None:
        super().__init__(io_timeout=io_timeout, connect_timeout=connect_timeout,
                         data_secret=data_secret,
                         max_connections_per_host=max_connections_per_host,
                         copy_threads=copy_threads)
        self._copy_threads = copy_threads

    @classmethod
    def usable(cls) -> Availability:
        return kernel.probe()

    def _table(self) -> RegionTable:
        return self.local

    def endpoint(self) -> bytes:
        """Starts the receiving side on first use."""
        self._check_open()
        address = f"kvhandoff-cma-{self._id}"
        with self._lock:
            if self._server is None:
                self._server = CmaServer(
                    "\0" + address, key=derive_key(self._token.encode(), self._data_secret),
                    endpoint_id=self._id, table=self._table, io_timeout=self._io_timeout,
                    deliver=self._deliver_notice, copy_threads=self._copy_threads,
                    max_per_host=self._max_per_host)
        return json.dumps({"kind": ENDPOINT_KIND, "v": ENDPOINT_VERSION,
                           "host": HostIdentity.here().as_list(), "address": address,
                           "token": self._token, "id": self._id}).encode()

    def connect(self, peer_endpoint: bytes) -> CmaPeer:
        """Dial the receiver (ConnectError: another host or network namespace, no proof
        of the key, or a kernel that will not let it read this process)."""
        self._check_open()
        ep = CmaEndpoint.parse(peer_endpoint)
        elsewhere = HostIdentity.here().differs(ep.host)
        if elsewhere:
            raise ConnectError(f"the cma transport reaches peers on this host and network "
                               f"namespace only; the peer is on {elsewhere}: use tcp (or "
                               f"transport 'auto', which picks)")
        return self._adopt(CmaPeer(
            peer_endpoint, address="\0" + ep.address,
            key=derive_key(ep.token.encode(), self._data_secret), endpoint_id=ep.id,
            io_timeout=self._io_timeout, connect_timeout=self._connect_timeout,
            table=self._table))

    def submit(self, peer: Peer, plan: Plan, *, notice: bytes | None = None) -> Handle:
        cma_peer = self._admit(peer, notice, CmaPeer)
        self.check_sources(plan)
        return cma_peer.submit(plan, notice)
