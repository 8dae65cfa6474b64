"""The data plane's mutual challenge–response (issue #11 item 4), attacked with raw
sockets: tcp's data port, the engines' staging control port and shm's Unix socket.

* A stranger without the key is refused before anything is allocated: memory, threads
  and descriptors stay bounded while its connections are held open (finding H5), and
  no frame it sends is ever read (3a, 4b).
* A client never writes to an impostor on the port: it refuses to go on, having sent
  nothing but its handshake ANSWER.
* With a deployment secret a sniffed token proves nothing (4a, 4b).
* Connections from one address are capped; the refusal is logged, with its reason.
* A peer that disconnects mid-frame (a torn write, L4) fails its request: no SUCCESS.

A legitimate handoff before and after each attack is byte-exact.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.fixtures import bootstrap, instance, no_leaked_threads, rig
from kvhandoff.lab.testing.hostile import (
    dial,
    eventually,
    exact,
    frame,
    memory_problems,
    refusal,
    until_closed,
)
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.lab.testing.transport import page_plan
from kvhandoff.secret import PURPOSE_DATA, Secret, write_secret_file
from kvhandoff.session import Status
from kvhandoff.transport import ConnectError, TransferState
from kvhandoff.transport.base import Peer
from kvhandoff.transport.framing import served
from kvhandoff.transport.framing.handshake import (
    CLIENT_FRAME,
    SERVER_FRAME,
    ClientHandshake,
    ServerHandshake,
    derive_key,
)
from kvhandoff.transport.framing.served import prove
from kvhandoff.transport.framing.wire import HEADER, MAX_DESC, Kind
from kvhandoff.transport.regions import RegionTable
from kvhandoff.transport.shm.transport import ShmTransport
from kvhandoff.transport.staging import Staging, StagingConfig
from kvhandoff.transport.tcp import transport as tcp
from kvhandoff.transport.tcp.client import TcpPeer, _Conn, _Frame
from kvhandoff.transport.tcp.transport import TcpEndpoint, TcpTransport
from kvhandoff.transport.throttle import Throttle

FIXTURES = (bootstrap, instance, no_leaked_threads, rig)  # imported for pytest
SECRET = Secret.from_bytes(b"kvhandoff data-plane test secret, 32+ bytes")
DATA_KEY = SECRET.key(PURPOSE_DATA)
TIMEOUT = 10.0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _serving(name: str) -> int:
    """Threads serving connections of the server called ``name`` (e.g. tcp-1234)."""
    return sum(t.name == f"kvh-{name}-serve" for t in threading.enumerate())


def _wrong_key_attempt(host: str, port: int, endpoint_id: str, key: bytes) -> str:
    """One whole handshake with ``key``: the server's refusal reason, or "" if it
    accepted (then a well-behaved client would be talking)."""
    with dial(host, port) as s:
        try:
            prove(s, key=key, endpoint_id=endpoint_id, timeout=TIMEOUT, peer="victim")
        except ConnectError as e:
            return str(e)
    return ""


# --- tcp: strangers ------------------------------------------------------------------


def test_no_key_is_refused_before_allocation_and_resources_stay_bounded(rig: Rig) -> None:
    """20 held connections that announce 64 MiB descriptions where the ANSWER belongs
    (before the fix: +64 MiB each, H5), then 100 wrong-key handshakes: each is refused,
    memory and descriptors stay bounded, and handoffs before and after are exact. (20:
    with prefill's 2, under the default cap of 32 connections per address.)"""
    first = rig.plan(1)
    rig.handoff(first)
    ep = TcpEndpoint.parse(rig.decode.transport.endpoint())
    server = f"tcp-{ep.port}"
    fds0, rss0, serving0 = _fds(), _rss(), _serving(server)
    held = []
    try:
        for _ in range(20):
            s = dial(ep.host, ep.port)
            held.append(s)
            assert len(s.recv(SERVER_FRAME, socket.MSG_WAITALL)) == SERVER_FRAME
            s.sendall(frame(Kind.WRITE, b"x", desc_len=MAX_DESC, payload_len=1 << 30))
        # the server holds at most one ANSWER's bytes for each: nothing was allocated
        assert _rss() - rss0 < 32 << 20, f"RSS grew by {(_rss() - rss0) >> 20} MiB"
        assert _serving(server) <= serving0 + 20
        for _ in range(100):  # the token is public here; the key derived from it is not
            reason = _wrong_key_attempt(ep.host, ep.port, ep.id, b"guessed" * 4)
            assert "refused our proof" in reason, reason
    finally:
        for s in held:
            s.close()
    assert eventually(lambda: _fds() <= fds0 + 2), (fds0, _fds())
    assert eventually(lambda: _serving(server) <= serving0), "serving threads linger"
    second = rig.plan(2, block=2)
    rig.handoff(second)
    assert exact(rig, [first, second]) == []


@pytest.mark.parametrize("how", ["secret_file", "option"])
def test_a_sniffed_token_proves_nothing_with_a_deployment_secret(
        bootstrap: BootstrapServer, instance: str, tmp_path: Path, how: str) -> None:
    """Both sides key the handshake with the deployment secret (decode's agent derives
    the key from its ``secret_file``, or takes the transport option): an attacker
    holding the decode's token (as a hijacked Hello hands it over, 4a) is refused; the
    rig's own handoffs, before and after, are exact."""
    url = bootstrap.url
    if how == "secret_file":
        secret_file = write_secret_file(tmp_path / "secret")
        key = Secret.load(secret_file).key(PURPOSE_DATA)
        cfg: dict[str, Any] = {"secret_file": secret_file}
        prefill_cfg, decode_cfg = cfg, cfg
        own = BootstrapServer(secret=Secret.load(secret_file)).start()  # the same secret
        url = own.url
    else:
        key, prefill_cfg, own = DATA_KEY, {}, None
        decode_cfg = {"transport_options": {"data_secret": DATA_KEY}}
    r = Rig(url, instance, prefill_transport=TcpTransport(data_secret=key),
            prefill_cfg=prefill_cfg, decode_cfg=decode_cfg)
    try:
        first = r.plan(1)
        r.handoff(first)
        ep = TcpEndpoint.parse(r.decode.transport.endpoint())
        reason = _wrong_key_attempt(ep.host, ep.port, ep.id, derive_key(ep.token.encode(), None))
        assert "refused our proof" in reason, reason
        with TcpTransport() as thief, pytest.raises(ConnectError, match="refused our proof"):
            thief.connect(r.decode.transport.endpoint())  # the whole endpoint, no secret
        with TcpTransport(data_secret=Secret.from_bytes(b"o" * 32).key(PURPOSE_DATA)) as other, \
                pytest.raises(ConnectError, match="refused our proof"):
            other.connect(r.decode.transport.endpoint())  # another deployment's secret
        second = r.plan(2, block=2)
        r.handoff(second)
        assert exact(r, [first, second]) == []
    finally:
        r.close()
        if own is not None:
            own.close()


# --- tcp: an impostor on the port --------------------------------------------------------


class Impostor:
    """A listener that speaks the handshake without the key: it sends a challenge, then
    a well-formed VERDICT made with ``key`` (its guess), and records every byte the
    client sends until it closes."""

    def __init__(self, key: bytes, endpoint_id: str) -> None:
        self.key, self.endpoint_id = key, endpoint_id
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, name="impostor", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(TIMEOUT)
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(TIMEOUT)
            hs = ServerHandshake.new(self.key, self.endpoint_id)
            conn.sendall(hs.challenge())
            answer = conn.recv(CLIENT_FRAME, socket.MSG_WAITALL)
            # the client's nonce is in its ANSWER: the impostor proves its own key for it
            mine = ClientHandshake(self.key, self.endpoint_id, answer[8:40], "self")
            conn.sendall(hs.verdict(mine.answer(hs.challenge())))
            self.received.append(answer + until_closed(conn))

    def close(self) -> None:
        self.listener.close()
        self.thread.join(TIMEOUT)


@pytest.mark.parametrize("secret", [None, DATA_KEY], ids=["token", "secret"])
def test_a_client_sends_nothing_to_an_impostor(secret: bytes | None) -> None:
    """The decode's endpoint is redirected to an impostor's port (a stale or hijacked
    lookup). The impostor knows the public endpoint id and, with a deployment secret,
    even the token: the client refuses to go on, having sent only its ANSWER."""
    with TcpTransport(data_secret=secret) as real, TcpTransport(data_secret=secret) as s:
        real.allocate(1 << 16)
        ep = json.loads(real.endpoint())
        guess = derive_key(ep["token"].encode(), None) if secret else b"guess"
        impostor = Impostor(guess, ep["id"])
        try:
            fake = json.dumps({**ep, "port": impostor.port}).encode()
            with pytest.raises(ConnectError, match="did not prove"):
                s.connect(fake)
            assert eventually(lambda: bool(impostor.received))
            assert [len(b) for b in impostor.received] == [CLIENT_FRAME]  # no frame, no KV
        finally:
            impostor.close()


# --- connections per peer address --------------------------------------------------------


@pytest.fixture
def fresh_throttles(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Refusals logged by this test are not suppressed by an earlier test's."""
    monkeypatch.setattr(served, "_refused", Throttle(served.log))
    yield


def test_connections_per_address_are_capped(caplog: pytest.LogCaptureFixture,
                                            fresh_throttles: None) -> None:
    with TcpTransport(max_connections_per_host=2) as r, TcpTransport() as s1, \
            TcpTransport(connections=1) as s2:
        dst = r.allocate(1 << 16)
        ep = r.endpoint()
        with caplog.at_level(logging.WARNING, logger="kvhandoff.transport"):
            p1 = s1.connect(ep)  # two connections: the cap
            with pytest.raises(ConnectError, match="cap is reached"):
                s2.connect(ep)
        assert "it holds 2 connections already (max_connections_per_host)" in caplog.text
        src = np.full(4096, 5, np.uint8)
        s1.register(src)
        plan = page_plan(src, dst, 3)
        h = s1.submit(p1, plan)
        assert s1.wait(h, TIMEOUT) is TransferState.DONE, h.error  # the capped peer works
        p1.close()

        def admitted() -> bool:  # the server frees p1's slots once it saw the close
            try:
                s2.connect(ep).close()
            except ConnectError:
                return False
            return True

        assert eventually(admitted)
        assert (dst[3 * 4096:4 * 4096] == 5).all() and not dst[:3 * 4096].any()


def test_the_cap_is_an_option() -> None:
    with pytest.raises(ValueError, match="max_connections_per_host"):
        TcpTransport(max_connections_per_host=0)
    with pytest.raises(ValueError):
        StagingConfig(max_connections_per_host=0)
    with pytest.raises(ValueError):
        ShmTransport(max_connections_per_host=0)


# --- torn writes (L4) ---------------------------------------------------------------------


class TornPeer(TcpPeer):
    """Sends half of the first frame that carries a payload, then cuts the connection
    (a prefill that dies mid-frame). ``armed`` is cleared once it tore one."""

    armed = threading.Event()

    def _write_frame(self, conn: _Conn, frame: _Frame) -> None:
        super()._write_frame(conn, frame)
        if frame.payload_len < 2 or not TornPeer.armed.is_set():
            return
        TornPeer.armed.clear()
        data = b"".join(bytes(v) for v in conn.sink.take())
        conn.sock.sendall(data[:len(data) - frame.payload_len // 2])  # half the payload
        conn.sock.shutdown(socket.SHUT_RDWR)


def test_a_torn_write_fails_the_request(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver writes a frame's bytes as they arrive, so half a frame lands; the
    frame is never acknowledged (nor its notice delivered): the request fails on both
    sides, never SUCCESS. A handoff after it, from a restarted prefill, is exact."""
    first = rig.plan(1)
    rig.handoff(first)
    monkeypatch.setattr(tcp, "TcpPeer", TornPeer)
    TornPeer.armed.set()
    rig.restart_prefill()  # dials its data connections anew: TornPeers
    torn = rig.plan(2, block=2)
    r = rig.receiver(torn)
    s, chunks, state = rig.sender(torn)
    rig.send_all(s, chunks, state)
    assert s.wait(TIMEOUT) is Status.FAILED, s.reason
    assert r.wait(TIMEOUT) is Status.FAILED, r.reason
    assert not TornPeer.armed.is_set(), "no frame was torn"
    # the torn bytes did land (documented; the request failed, so nobody reads them)
    torn_bytes = memory_problems(rig, rig.decodes[0], [first], [torn])
    assert torn_bytes != []
    assert r.wait_released(TIMEOUT) and s.wait_settled(TIMEOUT)
    monkeypatch.setattr(tcp, "TcpPeer", TcpPeer)
    rig.restart_prefill()
    third = rig.plan(3, block=4)
    rig.handoff(third)  # exact, and nothing else changed: only the torn bytes differ
    assert memory_problems(rig, rig.decodes[0], [first, third], [torn]) == torn_bytes


# --- staging's control port --------------------------------------------------------------


def _staging_receiver(config: StagingConfig, table: RegionTable) -> Staging:
    """A staging receiver without an engine (the control server is all it needs)."""
    def no_engine(*_args: Any) -> Any:
        raise AssertionError("the receiver made an engine call")

    return Staging("rx", config, register=lambda _r: None, write=no_engine, wait=no_engine,
                   table=lambda: table, host="127.0.0.1", io_timeout=TIMEOUT,
                   connect_timeout=TIMEOUT, data_secret=DATA_KEY)


def _staging_sender(config: StagingConfig, secret: bytes | None) -> Staging:
    def no_engine(*_args: Any) -> Any:
        raise AssertionError("nothing is staged in this test")

    return Staging("tx", config, register=lambda _r: None, write=no_engine, wait=no_engine,
                   table=RegionTable, host="127.0.0.1", io_timeout=TIMEOUT,
                   connect_timeout=TIMEOUT, data_secret=secret)


class _Peer(Peer):
    """The engine peer a staging link belongs to (only its name is used here)."""

    def __init__(self) -> None:
        super().__init__(b"", "rx")

    @property
    def closed(self) -> bool:
        return False

    def close(self) -> None:
        pass


def test_staging_refuses_strangers_before_leasing_and_caps_each_address(
        caplog: pytest.LogCaptureFixture, fresh_throttles: None) -> None:
    config = StagingConfig(slot_bytes=64 << 10, slots=8, slots_per_peer=2,
                           max_connections_per_host=2)
    rx = _staging_receiver(config, RegionTable())
    tx = _staging_sender(config, DATA_KEY)
    try:
        option = dict(rx.advertise())[Staging.OPTION]
        info = json.loads(option)
        server = f"staging-{info['port']}"
        fds0 = _fds()
        for key in (info["token"].encode(), b"guess"):  # the sniffed token; a guess
            assert "refused our proof" in _wrong_key_attempt(info["host"], info["port"],
                                                             info["id"], key)
        with dial(info["host"], info["port"]) as s:  # a 64 MiB HELLO: never read
            assert len(s.recv(SERVER_FRAME, socket.MSG_WAITALL)) == SERVER_FRAME
            s.sendall(frame(Kind.HELLO, b"x" * (CLIENT_FRAME - HEADER.size),
                            desc_len=MAX_DESC))
            assert "refused our proof" in refusal(until_closed(s))
        assert rx.slots_in_use == 0, "a stranger was leased slots"
        assert eventually(lambda: _fds() <= fds0 + 1)
        plain = _staging_sender(config, None)
        with pytest.raises(ConnectError, match="refused our proof"):  # no secret
            plain.connect({Staging.OPTION: option}, _Peer())
        plain.close()
        assert eventually(lambda: _serving(server) == 0)  # the refused ones are gone
        links = [tx.connect({Staging.OPTION: option}, _Peer()) for _ in range(2)]
        assert all(link is not None for link in links) and rx.slots_in_use == 4
        with caplog.at_level(logging.WARNING, logger="kvhandoff.transport"), \
                pytest.raises(ConnectError, match="cap is reached"):
            tx.connect({Staging.OPTION: option}, _Peer())
        assert "max_connections_per_host" in caplog.text
    finally:
        tx.close()
        rx.close()


def test_a_staging_sender_commits_nothing_to_an_impostor() -> None:
    config = StagingConfig(slot_bytes=64 << 10, slots=4, slots_per_peer=2)
    rx = _staging_receiver(config, RegionTable())
    tx = _staging_sender(config, DATA_KEY)
    try:
        info = json.loads(dict(rx.advertise())[Staging.OPTION])
        impostor = Impostor(derive_key(info["token"].encode(), None), info["id"])
        try:
            fake = json.dumps({**info, "port": impostor.port})
            with pytest.raises(ConnectError, match="did not prove"):
                tx.connect({Staging.OPTION: fake}, _Peer())
            assert eventually(lambda: bool(impostor.received))
            assert [len(b) for b in impostor.received] == [CLIENT_FRAME]
        finally:
            impostor.close()
    finally:
        tx.close()
        rx.close()


# --- shm's Unix socket ---------------------------------------------------------------------


def test_shm_hands_its_arenas_only_to_a_peer_that_proves_the_key() -> None:
    with ShmTransport(data_secret=DATA_KEY) as r, ShmTransport(data_secret=DATA_KEY) as s, \
            ShmTransport() as thief:
        dst = r.allocate(1 << 16)
        ep = json.loads(r.endpoint())
        assert ep["token"] not in ep["address"], "the socket's name gives the token away"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(TIMEOUT)
            raw.connect("\0" + ep["address"])
            challenge = raw.recv(SERVER_FRAME, socket.MSG_WAITALL)
            raw.sendall(ClientHandshake.new(ep["token"].encode(), ep["id"], peer="shm")
                        .answer(challenge))  # the token alone: the secret is missing
            data, fds, _flags, _addr = socket.recv_fds(raw, 4096, 16)
            rest = data + until_closed(raw)
            for fd in fds:
                os.close(fd)
            assert fds == [], "the arenas went to a stranger"
            assert "refused our proof" in refusal(rest)
        with pytest.raises(ConnectError, match="refused our proof"):
            thief.connect(r.endpoint())
        src = np.full(4096, 9, np.uint8)
        s.register(src)
        peer = s.connect(r.endpoint())
        plan = page_plan(src, dst, 1)
        h = s.submit(peer, plan)
        assert s.wait(h, TIMEOUT) is TransferState.DONE, h.error
        assert (dst[4096:8192] == 9).all() and not dst[:4096].any() and not dst[8192:].any()
        peer.close()

