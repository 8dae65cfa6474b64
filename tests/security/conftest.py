"""Fixtures of the hostile-client tests: a deployment secret, a bootstrap server that
requires it, and a raw HTTP client that sends exactly what a test tells it to (no
signing, no validation, no retries), as an attacker would, and a ZeroMQ context for its
control-plane sockets."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvhandoff.bootstrap.auth import sign
from kvhandoff.bootstrap.client import RankRecord
from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.secret import PURPOSE_BOOTSTRAP, Secret, write_secret_file

SIG = "0123456789abcdef"


def record(tp: int = 0, *, instance: str = "prod", tp_size: int = 2, port: int | None = None,
           **kw: Any) -> RankRecord:
    """A rank of a 1×tp_size×1 instance, at tcp://10.0.0.1:(17000 + tp) by default."""
    return RankRecord(instance=instance, dp_size=1, dp_rank=0, tp_size=tp_size, tp_rank=tp,
                      pp_size=1, pp_rank=0,
                      control_endpoint=f"tcp://10.0.0.1:{port if port is not None else 17000 + tp}",
                      transport="tcp", model_signature=SIG, **kw)


class Raw:
    """An HTTP client that sends what it is told. ``key``: sign with it (the legitimate
    client's scheme, for tests that need a valid or deliberately broken signature)."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        self.host, self.port = parts.hostname, parts.port

    def send(self, method: str, path: str, body: bytes | None = None, *,
             headers: dict[str, str] | None = None, key: bytes | None = None,
             now: float | None = None) -> tuple[int, dict[str, Any]]:
        hdrs = dict(headers or {})
        if key is not None:
            hdrs.update(sign(key, method, path, body or b"",
                             now=time.time() if now is None else now, server=self.server_id()))
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10.0)
        try:
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, {"raw": data.decode("utf-8", "replace")}

    def server_id(self) -> str:
        """The server run's id, as ``/health`` tells it (what a signed request names)."""
        status, health = self.send("GET", "/health")
        assert status == 200, health
        return str(health["server_id"])

    def register(self, rec: RankRecord, **kw: Any) -> tuple[int, dict[str, Any]]:
        return self.send("POST", "/v1/register", msgspec.json.encode(rec), **kw)

    def delete(self, body: dict[str, Any], **kw: Any) -> tuple[int, dict[str, Any]]:
        return self.send("DELETE", "/v1/register", json.dumps(body).encode(), **kw)

    def lookup(self, instance: str = "prod", query: str = "") -> tuple[int, dict[str, Any]]:
        return self.send("GET", f"/v1/instances/{instance}" + (f"?{query}" if query else ""))


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A ZeroMQ context for an attacker's own sockets, terminated after the test."""
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def secret_file(tmp_path: Path) -> str:
    return write_secret_file(tmp_path / "secret")


@pytest.fixture
def key(secret_file: str) -> bytes:
    """The bootstrap key every legitimate rank derives from the deployment secret."""
    return Secret.load(secret_file).key(PURPOSE_BOOTSTRAP)


@pytest.fixture
def secure(secret_file: str) -> Iterator[BootstrapServer]:
    """A bootstrap server that requires signed registrations."""
    with BootstrapServer(secret=Secret.load(secret_file)) as srv:
        yield srv


@pytest.fixture
def raw(secure: BootstrapServer) -> Raw:
    return Raw(secure.url)


@pytest.fixture
def rec() -> Any:
    """:func:`record`, for the test modules (a conftest is not importable)."""
    return record


@pytest.fixture
def client() -> type[Raw]:
    """:class:`Raw`, for servers a test starts itself."""
    return Raw
