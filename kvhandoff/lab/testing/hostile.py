"""Hostile peers for the security tests (``tests/security``). Test support.

* :func:`exact`: a rig's decode memory against the oracle, byte for byte;
  :func:`landed`: one request's bytes only.
* :func:`data_port` / :func:`frame` / :func:`read_frame` / :func:`read_reply`: raw frames
  to a tcp transport's data port, as a stranger without (or with) its token would send
  them, and what comes back.
* :func:`dial` / :func:`until_closed` / :func:`refusal`: a bare connection to a data
  server, everything it answers until it hangs up, and the handshake refusal in that.
* :class:`Impostor`: a control-plane peer that names itself ``tcp://…`` (a ROUTER of its
  own, so prefill's answers to that endpoint reach it) and sends from a DEALER with that
  identity, as a spoofing process on the same host can.
* :func:`hello_as`: a decode agent's own Hello, with another control and transport
  endpoint (what a spoofed Hello carries).
* :func:`prefill_desk`: a rig's prefill desk, whose tables the tests read.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Self

import msgspec
import numpy as np
import zmq

from kvhandoff.lab.testing.handoff import RequestPlan, place, request_of
from kvhandoff.lab.testing.oracle import ByteMap, expected_writes
from kvhandoff.lab.testing.rig import DecodeSide, Rig
from kvhandoff.plan.execute import HostMemory
from kvhandoff.protocol import Hello, Message, decode_message, encode_message
from kvhandoff.session import Agent
from kvhandoff.session.rank.prefill_desk import PrefillDesk
from kvhandoff.transport.framing.handshake import SERVER_FRAME, ClientHandshake, HandshakeFailed
from kvhandoff.transport.framing.wire import HEADER, Header, Kind, Status


def eventually(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether ``cond()`` holds within ``timeout`` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def memory_problems(rig: Rig, side: DecodeSide, done: list[RequestPlan],
                    failed: Sequence[RequestPlan] = ()) -> list[str]:
    """``side``'s memory against the oracle: every byte of the ``done`` requests equals
    the prefill bytes it came from, every other byte still holds its initial noise but
    the aux rows of ``failed`` requests (decode clears a request's row at init)."""
    bufs = side.arena.bufs
    expected = [side.arena.initial(i, len(b)) for i, b in enumerate(bufs)]
    aux = side.dst.component("aux").tensors[0]
    for rp in failed:
        row = aux.ptr + (rp.block + 1) * aux.item_bytes
        i = next(j for j, b in enumerate(bufs) if int(b.ctypes.data) == aux.ptr)
        off = row - aux.ptr
        expected[i][off:off + aux.item_bytes] = bufs[i][off:off + aux.item_bytes]
    src_mem = HostMemory(rig.parena.bufs)
    for rp in done:
        bm = _writes(rig, side, rp)
        place(expected, bufs, bm.dst, src_mem.read(bm.src))
    out = []
    for i, (b, e) in enumerate(zip(bufs, expected, strict=True)):
        bad = np.flatnonzero(b != e)
        if len(bad):
            out.append(f"buffer {i}: {len(bad)} of {len(b)} bytes differ "
                       f"(first at offset {int(bad[0])})")
    return out


def landed(rig: Rig, rp: RequestPlan, side: DecodeSide | None = None) -> bool:
    """Whether every byte the oracle says ``rp`` writes holds, on ``side`` (the rig's
    own decode by default), the prefill byte it comes from. Only those bytes:
    :func:`memory_problems` also checks that nothing else was written."""
    side = side or rig.decodes[0]
    bm = _writes(rig, side, rp)
    return bool(np.array_equal(HostMemory(side.arena.bufs).read(bm.dst),
                               HostMemory(rig.parena.bufs).read(bm.src)))


def _writes(rig: Rig, side: DecodeSide, rp: RequestPlan) -> ByteMap:
    """The oracle's writes of ``rp`` from the rig's prefill into ``side``; it must write."""
    bm = expected_writes([rig.src], side.dst, request_of(rig.scn, rp, rig.src, side.dst))
    assert len(bm.dst), "the oracle expects no write"
    return bm


def exact(rig: Rig, done: list[RequestPlan]) -> list[str]:
    """:func:`memory_problems` of the rig's own decode side."""
    return memory_problems(rig, rig.decodes[0], done)


def data_port(agent: Agent) -> tuple[str, int, bytes]:
    """``(host, port, token)`` of an agent's tcp transport endpoint."""
    ep = json.loads(agent.transport.endpoint())
    return str(ep["host"]), int(ep["port"]), str(ep["token"]).encode()


def frame(kind: Kind, desc: bytes = b"", *, desc_len: int | None = None, payload_len: int = 0,
          code: int = 0, seq: int = 1) -> bytes:
    """A raw frame: a header announcing ``desc_len`` (default: ``len(desc)``) description
    bytes and ``payload_len`` payload bytes, then ``desc``."""
    n = len(desc) if desc_len is None else desc_len
    return Header(kind, code, seq, n, payload_len).pack() + desc


def read_frame(sock: socket.socket) -> tuple[Header, bytes] | None:
    """The next frame on ``sock``: its header and description bytes; None if the peer
    closed first. Raises ``TimeoutError`` past the socket's timeout."""
    head = _recv_all(sock, HEADER.size)
    if head is None:
        return None
    h = Header.unpack(head)
    body = _recv_all(sock, h.desc_len)
    return None if body is None else (h, body)


def read_reply(sock: socket.socket) -> tuple[Status, str] | None:
    """The next REPLY on ``sock`` (status, message); None if the peer closed first.
    Raises ``TimeoutError`` past the socket's timeout."""
    got = read_frame(sock)
    if got is None:
        return None
    h, body = got
    return Status(h.code), body.decode(errors="replace")


def _recv_all(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            return None
        buf += got
    return buf


def dial(host: str, port: int, timeout: float = 10.0) -> socket.socket:
    """A bare TCP connection (no handshake); ``timeout`` bounds the connect and each read."""
    s = socket.create_connection((host, port), timeout=timeout)
    s.settimeout(timeout)
    return s


def until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes ``sock`` (a reset, as when it closes
    with our bytes unread, counts as closed). Raises ``TimeoutError`` if it never does."""
    out = b""
    while True:
        try:
            part = sock.recv(65536)
        except ConnectionError:
            return out
        if not part:
            return out
        out += part


def refusal(data: bytes) -> str:
    """The reason in the handshake REFUSED frame that ``data`` ends with ("" if none)."""
    try:
        ClientHandshake.new(b"k", "00" * 8, peer="server").answer(data[-SERVER_FRAME:])
    except HandshakeFailed as e:
        return str(e) if "refused" in str(e) else ""
    return ""


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (EOF or reset before its timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True


def prefill_desk(rig: Rig) -> PrefillDesk:
    """The rig's prefill desk (its backlog, claims and decode peers)."""
    desk = rig.prefill._desk
    assert isinstance(desk, PrefillDesk)
    return desk


def hello_as(decode: Agent, *, control_endpoint: str, transport_endpoint: bytes) -> Hello:
    """``decode``'s own Hello, claiming other endpoints."""
    hello = decode._desk.groups._hello  # type: ignore[union-attr]
    assert isinstance(hello, Hello)
    return msgspec.structs.replace(hello, control_endpoint=control_endpoint,
                                   transport_endpoint=transport_endpoint)


class Impostor:
    """A control peer at ``tcp://127.0.0.1:<port>`` (see the module docstring). Call
    :meth:`close` (or use it as a context manager)."""

    def __init__(self, target: str, *, ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 listen: bool = True, identity: str | None = None) -> None:
        self._own = ctx is None
        self.ctx = ctx if ctx is not None else zmq.Context()
        self.router: zmq.Socket[bytes] | None = None
        if listen:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            port = self.router.bind_to_random_port("tcp://127.0.0.1")
            identity = f"tcp://127.0.0.1:{port}"
        assert identity is not None, "an impostor that does not listen needs an identity"
        self.endpoint = identity
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.ROUTING_ID, identity.encode())
        self.dealer.connect(target)

    def send(self, msg: Message) -> None:
        self.dealer.send(encode_message(msg))

    def answer(self, timeout: float = 10.0) -> Message | None:
        """The next message for us: one sent to our endpoint (our ROUTER) or one
        answered on our connection (the DEALER); None after ``timeout`` seconds."""
        poller = zmq.Poller()
        poller.register(self.dealer, zmq.POLLIN)
        if self.router is not None:
            poller.register(self.router, zmq.POLLIN)
        ready = dict(poller.poll(int(timeout * 1000)))
        if self.dealer in ready:
            return decode_message(self.dealer.recv())
        if self.router is not None and self.router in ready:
            return decode_message(self.router.recv_multipart()[-1])
        return None

    def close(self) -> None:
        self.dealer.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)
        if self._own:
            self.ctx.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
