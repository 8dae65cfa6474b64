"""Hostile clients against the bootstrap server's bounds (findings M4, L1, L2 and the
registry part of M3): slowloris on request heads and bodies, a connection flood,
malformed and invalid-UTF-8 bodies, oversized bodies and metadata, huge lookup filters.
Each is refused or shed; ``/health`` and a legitimate rank keep working. Waits are
bounded; nothing asserts a duration."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from kvhandoff.bootstrap.client import health, lookup, register
from kvhandoff.bootstrap.server import BootstrapServer, Limits

PARTIAL = b"POST /v1/register HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
WAIT_S = 30.0  # the bound on every wait below; the server should need a second or two


@contextlib.contextmanager
def _server(**limits: Any) -> Iterator[BootstrapServer]:
    """A server with these limits; unsigned (what is tested here comes before any
    signature is read)."""
    with BootstrapServer(limits=Limits(**limits), insecure=True) as srv:
        yield srv


def _connect(srv: BootstrapServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT_S)
    return s


def _closed_by_server(s: socket.socket, timeout: float) -> bool:
    """Whether the server closed ``s`` (EOF or reset) within ``timeout`` seconds."""
    s.settimeout(timeout)
    try:
        return s.recv(4096) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _eventually_healthy(url: str) -> bool:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            return health(url, timeout=5.0).ok
        time.sleep(0.2)
    return False


def _legit_round_trip(srv: BootstrapServer, rec: Any, tp: int = 0) -> None:
    r = rec(0, instance=f"legit{tp}", tp_size=1, port=16000 + tp)
    assert register(srv.url, r, retries=2, backoff=0.05, timeout=10.0).ready
    assert lookup(srv.url, r.instance, wait_timeout=0, timeout=10.0).ranks == [r]


def test_a_half_sent_request_head_is_closed(rec: Any) -> None:
    """M4: no header timeout before; now a connection that trickles a request head one
    byte at a time is still closed once header_timeout has passed."""
    with _server(header_timeout=1.0) as srv:
        _legit_round_trip(srv, rec)
        s = _connect(srv)
        s.sendall(PARTIAL)
        closed = False
        deadline = time.monotonic() + WAIT_S
        with s:
            while not closed and time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    s.sendall(b"X")  # keep trickling: it must not extend the deadline
                closed = _closed_by_server(s, 0.3)
        assert closed, "the server kept a half-sent request head open"
        _legit_round_trip(srv, rec, 1)


def test_a_slow_body_gets_408(rec: Any) -> None:
    with _server(body_timeout=1.0) as srv:
        s = _connect(srv)
        with s:
            s.sendall(PARTIAL + b"\r\n" + b"{")
            s.settimeout(WAIT_S)
            answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"not received within" in answer
        _legit_round_trip(srv, rec)


def test_slowloris_flood_does_not_lock_out_health(rec: Any) -> None:
    """M4: many half-sent requests (more than the connection cap) while /health and a
    legitimate registration must still be answered; the oldest idle ones are shed."""
    n = 200
    with _server(max_connections=32, header_timeout=120.0) as srv:
        attackers: list[socket.socket] = []
        try:
            for _ in range(n):
                s = _connect(srv)
                s.sendall(PARTIAL)
                attackers.append(s)
            assert _eventually_healthy(srv.url)
            _legit_round_trip(srv, rec)
            # Shed, not merely outlived: the header timeout (120 s) has not fired.
            deadline = time.monotonic() + WAIT_S
            shed = 0
            for s in attackers:
                left = max(0.01, deadline - time.monotonic())
                shed += _closed_by_server(s, min(left, 0.05) if shed >= n // 2 else left)
                if shed >= n // 2:
                    break
            assert shed >= n // 2, f"only {shed} of {n} half-sent connections were shed"
        finally:
            for s in attackers:
                s.close()
        assert _eventually_healthy(srv.url)


BAD_BODIES = [b"", b"{", b"null", b"[]", b'"x"', b"\xff\xfe\xfd", b'{"instance": "\xff\xfe"}',
              b'{"instance": "a\x00"}', b"[" * 60000, b'{"metadata": ' + b"[" * 60000 + b"}",
              b'{"instance": "prod", "dp_size": 1e309}', b'{"instance": 1}']


@pytest.mark.parametrize("method", ["POST", "DELETE"])
@pytest.mark.parametrize("body", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_malformed_bodies_are_4xx_never_500(client: Any, method: str, body: bytes) -> None:
    """L1: invalid UTF-8 was a 500 with a traceback."""
    with _server() as srv:
        status, reply = client(srv.url).send(method, "/v1/register", body)
        assert 400 <= status < 500, reply
        assert reply["error"] == "malformed"


@pytest.mark.parametrize("body", BAD_BODIES[:8], ids=range(8))
def test_signed_malformed_bodies_are_4xx(raw: Any, key: bytes, body: bytes) -> None:
    status, reply = raw.send("POST", "/v1/register", body, key=key)
    assert 400 <= status < 500 and reply["error"] == "malformed", reply


def test_oversized_body_is_413(client: Any, rec: Any) -> None:
    with _server() as srv:
        status, reply = client(srv.url).send("POST", "/v1/register", b"{" + b" " * 100_000)
        assert status == 413 and reply["error"] == "too_large"
        _legit_round_trip(srv, rec)


def test_huge_rank_lists_are_refused(client: Any, rec: Any) -> None:
    """L2: a 4000-entry tp_rank list made each lookup scan ranks × list."""
    with _server(max_filter_ranks=64) as srv:
        for tp in range(4):
            register(srv.url, rec(tp, tp_size=4), retries=0)
        raw = client(srv.url)
        status, reply = raw.lookup("prod", "tp_rank=" + ",".join(["0"] * 2000))
        assert status == 400 and "at most 64" in reply["reason"]
        status, reply = raw.lookup("prod", "pp_rank=" + ",".join(["0"] * 65))
        assert status == 400
        status, reply = raw.lookup("prod", "tp_rank=" + ",".join(["1", "3"] * 32))
        assert status == 200 and [r["tp_rank"] for r in reply["ranks"]] == [1, 3]


def test_metadata_and_registry_bytes_are_capped(client: Any, rec: Any) -> None:
    """M3 (registry): 16384 records of 32 KiB metadata each held 700 MB; one lookup
    answer was 144 MB."""
    limits = {"max_metadata_bytes": 512, "max_instance_bytes": 8 << 10,
              "max_total_bytes": 12 << 10}
    with _server(**limits) as srv:
        raw = client(srv.url)
        fat = {f"k{i}": "v" * 60 for i in range(10)}  # 10 × 62 bytes > 512
        status, reply = raw.register(rec(0, metadata=fat))
        assert status == 413 and "metadata" in reply["reason"]
        meta = {f"k{i}": "v" * 40 for i in range(10)}  # ~420 bytes: allowed
        held, refused = 0, None
        for tp in range(64):
            status, reply = raw.register(rec(tp, tp_size=64, metadata=meta))
            if status != 200:
                refused = (status, reply)
                break
            held += 1
        assert refused is not None and refused[0] == 507, refused
        assert "per instance" in refused[1]["reason"]
        assert 0 < held < 64
        # Another instance may still use the rest, up to the server's total.
        others = 0
        for tp in range(64):
            status, reply = raw.register(rec(tp, instance="other", tp_size=64, metadata=meta,
                                             port=19000 + tp))
            if status != 200:
                assert status == 507 and "bytes of records" in reply["reason"], reply
                break
            others += 1
        assert others < held
        # Deregistering gives the bytes back.
        for tp in range(others):
            status, _ = raw.delete({"instance": "other", "dp_rank": 0, "tp_rank": tp,
                                    "pp_rank": 0})
            assert status == 200
        status, _ = raw.register(rec(held, tp_size=64, metadata={}))
        assert status == 200


def test_lookup_answer_size_is_bounded_by_the_instance_cap(client: Any, rec: Any) -> None:
    cap = 16 << 10
    with _server(max_instance_bytes=cap) as srv:
        raw = client(srv.url)
        meta = {f"k{i}": "v" * 100 for i in range(30)}
        for tp in range(4):
            assert raw.register(rec(tp, tp_size=4, metadata=meta))[0] == 200
        status, reply = raw.register(rec(0, instance="big", tp_size=64, port=20000,
                                         metadata=meta | {"x": "y" * 1000}))
        assert status == 200  # alone it fits; the rest of 'big' will not
        ok = sum(raw.register(rec(tp, instance="big", tp_size=64, metadata=meta,
                                  port=20000 + tp))[0] == 200 for tp in range(1, 64))
        assert ok < 63
        status, reply = raw.lookup("prod")
        assert status == 200
        assert len(msgspec.json.encode(reply)) <= cap + 1024
        assert len(json.dumps(reply)) > 4 * 3000  # the metadata did come back
