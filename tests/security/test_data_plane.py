"""Strangers on the tcp data port (and the staging control port) cannot make a
receiver allocate, hold connections, or kill the accept loop; a legitimate handoff
before and after each attack is byte-exact (findings H4, H5, L3). The data-plane
handshake itself is tested in test_data_auth.py."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvhandoff.lab.testing.fixtures import bootstrap, instance, no_leaked_threads, rig
from kvhandoff.lab.testing.hostile import (
    data_port,
    dial,
    exact,
    frame,
    read_reply,
    refusal,
    until_closed,
)
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.transport import staging
from kvhandoff.transport.errors import ProtocolError
from kvhandoff.transport.framing import served as _served
from kvhandoff.transport.framing.handshake import (
    CLIENT_FRAME,
    SERVER_FRAME,
    derive_key,
)
from kvhandoff.transport.framing.served import prove
from kvhandoff.transport.framing.wire import HEADER, MAX_DESC, Kind, Records, Status
from kvhandoff.transport.regions import RegionTable
from kvhandoff.transport.tcp.transport import TcpEndpoint

FIXTURES = (bootstrap, instance, no_leaked_threads, rig)  # imported for pytest
VICTIM = Path(__file__).with_name("emfile_victim.py")



@pytest.mark.parametrize("kind", [Kind.HELLO, Kind.WRITE])
def test_a_huge_frame_before_the_handshake_is_never_read(rig: Rig, kind: Kind) -> None:
    """A header announcing 64 MiB, where the handshake's ANSWER belongs: the server
    reads exactly one ANSWER's bytes, refuses them and closes (before the handshake it
    allocated 64 MiB per connection, H5)."""
    rig.handoff(rig.plan(1))
    host, port, _ = data_port(rig.decode)
    with dial(host, port) as s:
        assert s.recv(SERVER_FRAME, socket.MSG_WAITALL).startswith(b"KVHA")  # the challenge
        s.sendall(frame(kind, b"x" * (CLIENT_FRAME - HEADER.size), desc_len=MAX_DESC))
        assert refusal(until_closed(s))
    rig.handoff(rig.plan(2, block=2))
    assert exact(rig, [rig.plan(1), rig.plan(2, block=2)]) == []


def test_staging_refuses_a_huge_hello_before_allocating() -> None:
    arena = staging.Arena(2, 4096)
    server = staging.StagingServer(host="127.0.0.1", key=b"t" * 32, endpoint_id="ab" * 8,
                                   arena=arena, slots_per_peer=1, table=RegionTable,
                                   io_timeout=10.0, quarantine=1.0)
    try:
        with dial(server.host, server.port) as s:
            assert s.recv(SERVER_FRAME, socket.MSG_WAITALL).startswith(b"KVHA")
            s.sendall(frame(Kind.HELLO, b"x" * (CLIENT_FRAME - HEADER.size),
                            desc_len=MAX_DESC))
            assert refusal(until_closed(s))
        with dial(server.host, server.port) as s:  # the real key still works, and after
            prove(s, key=b"t" * 32, endpoint_id="ab" * 8, timeout=10, peer="staging")
            s.settimeout(10)
            s.sendall(frame(Kind.HELLO, b"x", desc_len=MAX_DESC))  # it: a non-empty HELLO
            reply = read_reply(s)  # is refused from its header
            assert reply is not None and reply[0] is Status.MALFORMED, reply
        with dial(server.host, server.port) as s:
            prove(s, key=b"t" * 32, endpoint_id="ab" * 8, timeout=10, peer="staging")
            s.settimeout(10)
            s.sendall(frame(Kind.HELLO))
            reply = read_reply(s)
            assert reply is not None and reply[0] is Status.OK, reply
    finally:
        server.close()


@pytest.fixture
def tight_caps(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_served, "MAX_UNPROVEN_PER_HOST", 4)
    monkeypatch.setattr(_served, "HELLO_DEADLINE_S", 0.5)
    yield


def test_silent_connections_are_capped_and_cut(rig: Rig, tight_caps: None) -> None:
    rig.handoff(rig.plan(1))
    host, port, _ = data_port(rig.decode)
    idle = [dial(host, port) for _ in range(4)]
    try:
        with dial(host, port) as extra:  # over MAX_UNPROVEN_PER_HOST: refused at once
            assert refusal(until_closed(extra))
        for s in idle:  # never answered the challenge: cut after HELLO_DEADLINE_S
            assert len(until_closed(s)) <= SERVER_FRAME  # at most the challenge
    finally:
        for s in idle:
            s.close()
    rig.restart_prefill()  # a fresh prefill transport dials new data connections
    rig.handoff(rig.plan(2, block=2))
    assert exact(rig, [rig.plan(1), rig.plan(2, block=2)]) == []


def test_a_record_count_that_wraps_int64_is_malformed(rig: Rig) -> None:
    rig.handoff(rig.plan(1))
    ep = TcpEndpoint.parse(rig.decode.transport.endpoint())
    ptr = int(rig.darena.bufs[0].ctypes.data)  # 1 × 4096 B × 2**52 rows = 2**64 B
    table = struct.pack("<q7qq", 1, ptr, 0, 0, 4096, 1 << 52, 0, 1, 0)
    with dial(ep.host, ep.port) as s:
        # a peer that passed the handshake: the deployment's data key and the token
        key = derive_key(ep.token.encode(), rig.prefill_cfg.data_key())
        prove(s, key=key, endpoint_id=ep.id, timeout=10, peer="decode")
        s.settimeout(10)
        s.sendall(frame(Kind.WRITE, table, payload_len=0))
        reply = read_reply(s)  # before the fix: nbytes wrapped to 0, then a traceback
        assert reply is not None and reply[0] is Status.MALFORMED, reply
        assert "2**62" in reply[1]
    with pytest.raises(ProtocolError):
        _ = Records.decode(table).nbytes
    rig.handoff(rig.plan(2, block=2))
    assert exact(rig, [rig.plan(1), rig.plan(2, block=2)]) == []


def knock(host: str, port: int) -> socket.socket | None:
    """A connection to ``host:port``, or None if the listener reset it or never answered."""
    try:
        return dial(host, port, timeout=5)
    except (ConnectionError, TimeoutError):
        return None


def test_the_accept_loop_survives_running_out_of_descriptors() -> None:
    """A subprocess (its own RLIMIT_NOFILE) runs a rig, uses up its descriptors, and
    we connect to its decode's data port and control socket: accept fails with EMFILE.
    The data server logs it and backs off; the control socket (libzmq would retry at once,
    spinning a core) closes the waiting connections unread and stops taking more for a
    while, so the process stays nearly idle. Once descriptors are free again, a restarted
    prefill must still reach both."""
    proc = subprocess.Popen([sys.executable, str(VICTIM)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    conns: list[socket.socket] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline().split()
        assert line[:1] == ["HOGGED"], (line, proc.stderr.read() if proc.stderr else "")
        host, port, control = line[1], int(line[2]), int(line[3])
        # accept() now fails: EMFILE. The data server leaves our connections queued; the
        # control socket resets its queue and drops new ones while it backs off, so a knock
        # there may be reset or time out: what it does to a peer is not the point here
        conns = [dial(host, port) for _ in range(3)]
        conns += [c for c in (knock(host, control) for _ in range(3)) if c is not None]
        proc.stdin.write("CONNECTED\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=90)
        assert "ACCEPT-SURVIVED" in out, (out, err[-3000:])
        assert proc.returncode == 0, (out, err[-3000:])
    finally:
        for c in conns:
            c.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    seen = json.loads(next(x for x in out.splitlines() if x.startswith("SEEN"))[4:])
    assert seen["control_accept_failures"] >= 1 and seen["drained"] >= 1, seen
    # a spinning accept loop burns a core for as long as the descriptors lack: a slow
    # machine can only give it less CPU, never more, so this bound cannot fail by chance
    assert seen["cpu_s"] < 0.25 * seen["wall_s"] + 0.5, seen
