"""The bootstrap server and client: registration rules, readiness, refusals, retries and
lifecycle. Every server here runs in-process on 127.0.0.1 with an OS-chosen port."""

from __future__ import annotations

import http.client
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvhandoff.bootstrap.client import (
    BootstrapError,
    BootstrapRejected,
    BootstrapTimeout,
    BootstrapUnavailable,
    RankFilter,
    RankRecord,
    RegisterReply,
    RegistrationConflict,
    Slot,
    deregister,
    health,
    lookup,
    register,
)
from kvhandoff.bootstrap.server import BootstrapServer, Limits, Registry
from kvhandoff.errors import HandoffError
from kvhandoff.lab.servers import free_port

SIG = "0123456789abcdef"
FAST: dict[str, Any] = {"retries": 3, "backoff": 0.02, "max_backoff": 0.05, "timeout": 1.0}


def rec(dp: int = 0, tp: int = 0, pp: int = 0, *, instance: str = "llama", dp_size: int = 2,
        tp_size: int = 2, pp_size: int = 2, port: int | None = None, sig: str = SIG,
        transport: str = "tcp", **kw: Any) -> RankRecord:
    port = port if port is not None else 20000 + 100 * dp + 10 * pp + tp
    return RankRecord(instance=instance, dp_size=dp_size, dp_rank=dp, tp_size=tp_size,
                      tp_rank=tp, pp_size=pp_size, pp_rank=pp,
                      control_endpoint=f"tcp://10.0.0.1:{port}", transport=transport,
                      model_signature=sig, **kw)


def all_ranks(**kw: Any) -> list[RankRecord]:
    return [rec(dp, tp, pp, **kw) for dp, tp, pp in itertools.product(range(2), repeat=3)]


def raw(url_port: int, method: str, path: str, body: bytes | None = None
        ) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", url_port, timeout=5)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()



@pytest.fixture
def srv() -> Iterator[BootstrapServer]:
    with BootstrapServer("127.0.0.1", 0, insecure=True) as s:
        yield s


@pytest.fixture(scope="module")
def shared_srv() -> Iterator[BootstrapServer]:
    with BootstrapServer("127.0.0.1", 0, insecure=True) as s:
        yield s


# --- registration and readiness -----------------------------------------------------------


def test_lookup_waits_for_every_rank_then_serves_filtered(srv: BootstrapServer) -> None:
    ranks = all_ranks()  # DP 2 x TP 2 x PP 2
    for i, r in enumerate(ranks[:-1]):
        reply = register(srv.url, r, **FAST)
        assert (reply.created, reply.ready, reply.registered, reply.expected) == \
            (True, False, i + 1, 8)
    status, body = raw(srv.port, "GET", "/v1/instances/llama")
    assert status == 503 and body["ready"] is False
    assert body["missing"] == [{"dp_rank": 1, "tp_rank": 1, "pp_rank": 1}]
    with pytest.raises(BootstrapTimeout, match=r"7 of 8 .*missing \(dp=1, tp=1, pp=1\)") as ei:
        lookup(srv.url, "llama", wait_timeout=0.2, poll_interval=0.05)
    assert ei.value.missing == [Slot(dp_rank=1, tp_rank=1, pp_rank=1)]

    assert register(srv.url, ranks[-1], **FAST).ready
    full = lookup(srv.url, "llama", wait_timeout=1)
    assert full.ranks == sorted(ranks, key=lambda r: r.slot)
    assert (full.dp_size, full.tp_size, full.pp_size, full.model_signature, full.transport) \
        == (2, 2, 2, SIG, "tcp")

    some = lookup(srv.url, "llama", filters=RankFilter(dp_rank=1, tp_ranks=[0], pp_ranks=[0, 1]))
    assert [(r.dp_rank, r.tp_rank, r.pp_rank) for r in some.ranks] == [(1, 0, 0), (1, 0, 1)]
    assert some.rank(dp_rank=1, tp_rank=0, pp_rank=1) == rec(1, 0, 1)
    with pytest.raises(KeyError, match="not in this answer"):
        some.rank(tp_rank=1)


def test_lookup_returns_as_soon_as_the_last_rank_registers(srv: BootstrapServer) -> None:
    ranks = all_ranks()
    for r in ranks[:-1]:
        register(srv.url, r)
    late = threading.Timer(0.2, register, args=(srv.url, ranks[-1]))
    late.start()
    try:
        t0 = time.monotonic()
        info = lookup(srv.url, "llama", wait_timeout=5, poll_interval=0.02)
        assert len(info.ranks) == 8 and time.monotonic() - t0 < 2
    finally:
        late.join()


def test_unknown_instance_is_404_and_lookup_says_so(srv: BootstrapServer) -> None:
    assert raw(srv.port, "GET", "/v1/instances/nobody")[0] == 404
    with pytest.raises(BootstrapTimeout, match="unknown"):
        lookup(srv.url, "nobody", wait_timeout=0.1, poll_interval=0.05)


def test_bad_filters_are_400_and_not_waited_on(srv: BootstrapServer) -> None:
    register(srv.url, rec())
    for q in ("tp_rank=2", "dp_rank=0,1", "pp_rank=x", "color=red"):
        status, body = raw(srv.port, "GET", f"/v1/instances/llama?{q}")
        assert status == 400 and body["error"] == "malformed", q
    t0 = time.monotonic()
    with pytest.raises(BootstrapRejected, match=r"tp_rank .*out of range") as ei:
        lookup(srv.url, "llama", filters=RankFilter(tp_ranks=[5]), wait_timeout=10)
    assert ei.value.status == 400 and time.monotonic() - t0 < 2


def test_identical_reregistration_is_idempotent(srv: BootstrapServer) -> None:
    r = rec(metadata={"host": "node-1"})
    assert register(srv.url, r).created
    again = register(srv.url, r)
    assert not again.created and again.registered == 1
    assert health(srv.url).ranks == 1


# --- conflicts --------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "field", "old", "new"), [
    ({"port": 29999}, "control_endpoint", "tcp://10.0.0.1:20000", "tcp://10.0.0.1:29999"),
    ({"metadata": {"a": "b"}}, "metadata", {}, {"a": "b"}),
    ({"tp_size": 4}, "tp_size", 2, 4),
    ({"pp_size": 1}, "pp_size", 2, 1),
    ({"sig": "fedcba"}, "model_signature", SIG, "fedcba"),
    ({"transport": "mooncake"}, "transport", "tcp", "mooncake"),
])
def test_conflicting_registration_is_refused_naming_field_and_values(
        srv: BootstrapServer, change: dict[str, Any], field: str, old: object, new: object
) -> None:
    register(srv.url, rec())
    t0 = time.monotonic()
    with pytest.raises(RegistrationConflict, match=field) as ei:
        register(srv.url, rec(**change), retries=5, backoff=10.0)  # 409 is never retried
    assert time.monotonic() - t0 < 5.0  # one retry would have slept at least 5 s
    assert ei.value.status == 409
    assert [(c.field, c.existing, c.offered) for c in ei.value.conflicts] == [(field, old, new)]
    assert isinstance(ei.value, HandoffError)


def test_another_rank_must_match_the_instance(srv: BootstrapServer) -> None:
    register(srv.url, rec(0, 0, 0))
    # Other TP and PP ranks of the same model share the signature: accepted.
    register(srv.url, rec(0, 1, 1))
    with pytest.raises(RegistrationConflict) as ei:
        register(srv.url, rec(1, 1, 0, sig="abcd", tp_size=4))
    got = {c.field: (c.existing, c.offered) for c in ei.value.conflicts}
    assert got == {"tp_size": (2, 4), "model_signature": (SIG, "abcd")}
    assert "registered 2, offered 4" in str(ei.value)


def test_a_control_endpoint_belongs_to_one_rank(srv: BootstrapServer) -> None:
    register(srv.url, rec(0, 0, 0, port=7000))
    with pytest.raises(RegistrationConflict, match=r"already registered by instance 'llama'"):
        register(srv.url, rec(0, 1, 0, port=7000))
    with pytest.raises(RegistrationConflict, match="control_endpoint"):
        register(srv.url, rec(instance="other", port=7000))


def test_deregister_frees_the_slot_and_forgets_empty_instances(srv: BootstrapServer) -> None:
    r = rec(tp_size=1, pp_size=1, dp_size=1)
    register(srv.url, r)
    with pytest.raises(RegistrationConflict, match="another process"):
        deregister(srv.url, rec(tp_size=1, pp_size=1, dp_size=1, port=1))  # stale endpoint
    assert deregister(srv.url, r) is True
    assert deregister(srv.url, r) is False  # idempotent
    assert raw(srv.port, "GET", "/v1/instances/llama")[0] == 404
    # The instance is gone, so a redeployment may change sizes and endpoint.
    assert register(srv.url, rec(tp_size=4, port=1)).expected == 16


# --- malformed input --------------------------------------------------------------------


def good_body(**over: Any) -> bytes:
    body: dict[str, Any] = msgspec.to_builtins(rec())
    body.update(over)
    return json.dumps(body).encode()


@pytest.mark.parametrize(("body", "why"), [
    (b"", "truncated"),
    (b"{not json", "malformed"),
    (b"[1, 2]", "Expected `object`"),
    (good_body(color="red"), "unknown field `color`"),
    (good_body(tp_rank=True), "Expected `int`, got `bool`"),
    (good_body(tp_rank=2), "tp_rank 2 is not below tp_size 2"),
    (good_body(dp_size=0), "dp_size"),
    (good_body(model_signature="XYZ"), "model_signature"),
    (good_body(control_endpoint="10.0.0.1:1"), "control_endpoint"),
    (good_body(instance="a/b"), "instance"),
    (good_body(metadata={"k": 1}), "metadata"),
    (json.dumps({"instance": "x"}).encode(), "missing required field"),
])
def test_malformed_bodies_are_400_with_a_reason(srv: BootstrapServer, body: bytes,
                                                why: str) -> None:
    status, reply = raw(srv.port, "POST", "/v1/register", body)
    assert status == 400 and reply["error"] == "malformed"
    assert why in reply["reason"]
    assert health(srv.url).ranks == 0


def test_oversized_unsupported_and_unrouted_requests(srv: BootstrapServer) -> None:
    status, reply = raw(srv.port, "POST", "/v1/register", b" " * (80 * 1024))
    assert (status, reply["error"]) == (413, "too_large")
    status, reply = raw(srv.port, "POST", "/v1/register", good_body(protocol_version=99))
    assert (status, reply["error"]) == (400, "unsupported_version")
    assert raw(srv.port, "PUT", "/v1/register", b"{}")[0] == 405
    assert raw(srv.port, "GET", "/route")[0] == 404
    assert raw(srv.port, "DELETE", "/v1/register", b'{"instance": 1}')[0] == 400
    assert health(srv.url).ok


def test_an_invalid_record_is_refused_before_sending() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: proof that nothing was sent
    with pytest.raises(BootstrapRejected, match="not sent") as ei:
        register(url, rec(sig="NOT-HEX"), retries=0)
    assert ei.value.status is None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.one_of(st.binary(max_size=300),
                      st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                                   lambda c: st.lists(c, max_size=4)
                                   | st.dictionaries(st.text(max_size=8), c, max_size=4),
                                   max_leaves=12).map(lambda v: json.dumps(v).encode())))
def test_no_body_crashes_the_server(shared_srv: BootstrapServer, body: bytes) -> None:
    status, reply = raw(shared_srv.port, "POST", "/v1/register", body)
    assert status == 400 and reply["reason"]
    assert raw(shared_srv.port, "GET", "/health")[0] == 200


# --- limits -------------------------------------------------------------------------------


def test_capacity_limits_are_507_and_not_retried() -> None:
    limits = Limits(max_instances=1, max_ranks_per_instance=8, max_ranks=2)
    with BootstrapServer("127.0.0.1", 0, limits=limits, insecure=True) as s:
        with pytest.raises(BootstrapRejected, match="limit of 8 per instance") as ei:
            register(s.url, rec(tp_size=4), retries=5, backoff=1.0)
        assert ei.value.status == 507
        register(s.url, rec(0, 0, 0))
        with pytest.raises(BootstrapRejected, match="limit of 1 instances"):
            register(s.url, rec(instance="two"), retries=0)
        register(s.url, rec(0, 1, 0))
        with pytest.raises(BootstrapRejected, match="limit of 2 ranks"):
            register(s.url, rec(1, 0, 0), retries=0)


def test_registry_without_http() -> None:
    reg = Registry()
    for r in all_ranks():
        reg.register(r)
    assert reg.health().ready_instances == 1
    assert len(reg.lookup("llama", tp_ranks=[1]).ranks) == 4  # type: ignore[union-attr]


# --- availability, retries, lifecycle ---------------------------------------------------


def test_server_down_retries_with_backoff_then_unavailable() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(BootstrapUnavailable, match="after 4 attempt") as ei:
        register(url, rec(), retries=3, backoff=0.05, max_backoff=0.1, timeout=0.5)
    took = time.monotonic() - t0
    # Sleeps between attempts: jittered 0.5-1x of 0.05, 0.1, 0.1 s.
    assert 0.1 <= took < 2.0
    assert ei.value.attempts == 4 and "ConnectionRefused" in ei.value.last_error
    with pytest.raises(BootstrapUnavailable):
        health(url, timeout=0.5)
    with pytest.raises(BootstrapUnavailable, match="did not answer"):
        lookup(url, "llama", wait_timeout=0.2, poll_interval=0.05)


def test_registration_succeeds_when_the_server_starts_late() -> None:
    port = free_port()
    result: list[object] = []

    def worker() -> None:
        try:
            result.append(register(f"http://127.0.0.1:{port}", rec(), retries=30,
                                   backoff=0.02, max_backoff=0.1))
        except BootstrapError as e:
            result.append(e)

    t = threading.Thread(target=worker)
    t.start()
    time.sleep(0.3)
    with BootstrapServer("127.0.0.1", port, insecure=True) as s:
        t.join(10)
        assert not t.is_alive()
        assert getattr(result[0], "created", None) is True
        assert s.registry.health().ranks == 1


class _Flaky(BaseHTTPRequestHandler):
    """Answers ``fails`` 5xx statuses, then a RegisterReply."""

    script: ClassVar[list[int]] = []
    seen: ClassVar[int] = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        _Flaky.seen += 1
        status = _Flaky.script.pop(0) if _Flaky.script else 200
        body = (b'{"created":true,"ready":true,"registered":1,"expected":1}' if status == 200
                else b'{"error":"x","reason":"flaky"}')
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(("script", "ok", "seen"), [
    ([503, 500, 502], True, 4),  # transient: retried until it works
    ([507], False, 1),  # registry full: refused at once
])
def test_5xx_is_retried_but_507_is_not(script: list[int], ok: bool, seen: int) -> None:
    _Flaky.script, _Flaky.seen = list(script), 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    t = threading.Thread(target=httpd.serve_forever, args=(0.02,))
    t.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        if ok:
            assert register(url, rec(), **FAST).ready
        else:
            with pytest.raises(BootstrapRejected, match="flaky"):
                register(url, rec(), **FAST)
        assert _Flaky.seen == seen
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join()


def test_clean_shutdown_leaves_no_thread_or_socket() -> None:
    before = set(threading.enumerate())
    srv = BootstrapServer("127.0.0.1", 0, insecure=True)
    with srv:
        register(srv.url, rec())
        assert len(threading.enumerate()) > len(before)
        port = srv.port
    srv.close()  # idempotent
    assert set(threading.enumerate()) == before
    with socket.socket() as s:  # the port is free again: the listening socket is closed
        # SO_REUSEADDR: closed connections may linger in TIME_WAIT; only a live listener
        # on the port would make this bind fail.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    with pytest.raises(BootstrapUnavailable):
        health(f"http://127.0.0.1:{port}", timeout=0.5)


def test_a_busy_port_fails_start_with_a_clear_error() -> None:
    with BootstrapServer("127.0.0.1", 0, insecure=True) as a:
        before = set(threading.enumerate())
        with pytest.raises(BootstrapError, match=f"cannot listen on 127.0.0.1:{a.port}"):
            BootstrapServer("127.0.0.1", a.port, insecure=True).start()
        assert set(threading.enumerate()) == before


def test_serve_exits_cleanly_on_sigterm() -> None:
    code = ("import sys; from kvhandoff.bootstrap.server import serve; "
            "sys.exit(serve('127.0.0.1', 0))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line
        url = line.split()[-1]
        register(url, rec())
        assert health(url).ranks == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- concurrency ------------------------------------------------------------------------


def _together(n: int, fn: Any) -> list[object]:
    barrier = threading.Barrier(n)
    out: list[object] = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            out[i] = fn(i)
        except BootstrapError as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    return out


def test_sixteen_ranks_register_at_once(srv: BootstrapServer) -> None:
    ranks = [rec(dp, tp, pp, tp_size=4) for dp, tp, pp in
             itertools.product(range(2), range(4), range(2))]
    out = _together(16, lambda i: register(srv.url, ranks[i]))
    assert all(getattr(o, "created", False) for o in out), out
    assert sum(getattr(o, "ready", False) for o in out) == 1  # exactly one saw completion
    assert len(lookup(srv.url, "llama", wait_timeout=1).ranks) == 16


def test_racing_claims_on_one_slot_have_one_winner(srv: BootstrapServer) -> None:
    out = _together(16, lambda i: register(srv.url, rec(port=30000 + i)))
    winners = [o for o in out if not isinstance(o, BaseException)]
    assert len(winners) == 1
    assert all(isinstance(o, RegistrationConflict) for o in out if o not in winners)
    same = _together(16, lambda i: register(srv.url, rec(0, 1, 0)))
    assert all(isinstance(o, RegisterReply) for o in same), same
    assert sorted(o.created for o in same if isinstance(o, RegisterReply)) == [False] * 15 + [True]


# --- real layouts: the model signature a prefill agent registers ---------------------------


def _stage(model: str, pp: int, page: int) -> Any:
    from kvhandoff.lab import shapes
    return shapes.layout_for(shapes.tiny(shapes.get(model)), tp_rank=0, tp_size=1,
                             page_size=page, num_pages=4, num_slots=2, pp_rank=pp, pp_size=2)


def test_pp_stages_of_one_model_register_and_another_model_is_refused(
        srv: BootstrapServer) -> None:
    from kvhandoff.session import Agent, SessionConfig
    from kvhandoff.session.errors import BootstrapFailed
    cfg = SessionConfig.from_env({}, instance="pp", transport="memory", register_retries=0)
    first, second = _stage("qwen3_next", 0, 16), _stage("qwen3_next", 1, 16)
    assert first.signature != second.signature  # the stages hold different tensors
    with Agent.prefill(first, bootstrap_url=srv.url, config=cfg), \
            Agent.prefill(second, bootstrap_url=srv.url, config=cfg):
        info = lookup(srv.url, "pp", timeout=2.0)
        assert info.ready and info.model_signature == first.model_signature
        assert [r.pp_rank for r in info.ranks] == [0, 1]
    other = _stage("deepseek_v4", 1, 128)
    with Agent.prefill(first, bootstrap_url=srv.url, config=cfg), \
            pytest.raises(BootstrapFailed, match="model_signature") as ei:
        Agent.prefill(other, bootstrap_url=srv.url, config=cfg)
    assert first.model_signature in str(ei.value) and other.model_signature in str(ei.value)
