"""Hostile clients against a bootstrap server that has the deployment secret (finding H1,
the bootstrap half of the hijack; section 1d): unsigned, forged, tampered, stale and
replayed registrations and deletions, deleting or replacing someone else's rank. Each
is refused with a reason and changes nothing; a legitimate rank registers, is looked up
and deregisters before and after."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvhandoff.bootstrap.client import (
    BootstrapRejected,
    RankRecord,
    deregister,
    lookup,
    register,
)
from kvhandoff.bootstrap.registration import deregister_rank, register_rank
from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.secret import PURPOSE_BOOTSTRAP, Secret, write_secret_file
from kvhandoff.session.config import SessionConfig
from kvhandoff.session.errors import BootstrapFailed

LEGIT = "tcp://10.0.0.1:17000"
ATTACKER = "tcp://127.0.0.1:6666"


def _legit_pair(url: str, key: bytes, rec: Any) -> list[RankRecord]:
    """Register both ranks of instance 'prod' the legitimate way (signed client)."""
    recs = [rec(0), rec(1)]
    for r in recs:
        assert register(url, r, key=key, retries=0).created
    return recs


def _endpoints(url: str) -> list[str]:
    return [r.control_endpoint for r in lookup(url, "prod", wait_timeout=0).ranks]


def test_legit_signed_register_lookup_deregister(secure: BootstrapServer, key: bytes,
                                                 rec: Any) -> None:
    recs = _legit_pair(secure.url, key, rec)
    assert _endpoints(secure.url) == [LEGIT, "tcp://10.0.0.1:17001"]
    assert register(secure.url, recs[0], key=key, retries=0).created is False  # idempotent
    assert deregister(secure.url, recs[0], key=key, retries=0)
    assert deregister(secure.url, recs[1], key=key, retries=0)
    assert secure.registry.health().ranks == 0


def test_unsigned_register_is_401_and_changes_nothing(raw: Any, secure: BootstrapServer,
                                                      rec: Any) -> None:
    status, body = raw.register(rec(0))
    assert status == 401 and body["error"] == "unauthorized"
    assert "not signed" in body["reason"] and "KVHANDOFF_SECRET_FILE" in body["reason"]
    assert secure.registry.health().ranks == 0
    with pytest.raises(BootstrapRejected) as e:  # the client without the key: 401, no retry
        register(secure.url, rec(0), retries=3)
    assert e.value.status == 401


@pytest.mark.parametrize("how", ["other_secret", "tampered_body", "tampered_path",
                                 "garbage_headers", "stale", "future"])
def test_forged_registrations_are_401(raw: Any, secure: BootstrapServer, key: bytes,
                                      rec: Any, tmp_path: Path, how: str) -> None:
    body = msgspec.json.encode(rec(0))
    kw: dict[str, Any] = {"key": key}
    if how == "other_secret":
        kw["key"] = Secret.load(write_secret_file(tmp_path / "mine")).key(PURPOSE_BOOTSTRAP)
        status, reply = raw.send("POST", "/v1/register", body, **kw)
    elif how == "tampered_body":  # signed for one record, sent with another
        from kvhandoff.bootstrap.auth import sign
        hdrs = sign(key, "POST", "/v1/register", body, now=time.time(),
                    server=secure.server_id)
        evil = msgspec.json.encode(rec(0, port=6666))
        status, reply = raw.send("POST", "/v1/register", evil, headers=hdrs)
    elif how == "tampered_path":
        from kvhandoff.bootstrap.auth import sign
        hdrs = sign(key, "DELETE", "/v1/register", body, now=time.time(),
                    server=secure.server_id)
        status, reply = raw.send("POST", "/v1/register", body, headers=hdrs)
    elif how == "garbage_headers":
        hdrs = {"X-Kvhandoff-Timestamp": "-1", "X-Kvhandoff-Nonce": "zz",
                "X-Kvhandoff-Signature": "v1=" + "0" * 64}
        status, reply = raw.send("POST", "/v1/register", body, headers=hdrs)
    else:
        now = time.time() + (-3600 if how == "stale" else 3600)
        status, reply = raw.send("POST", "/v1/register", body, key=key, now=now)
    assert status == 401, reply
    assert reply["error"] == "unauthorized" and reply["reason"]
    assert secure.registry.health().ranks == 0


def test_replayed_signature_is_refused(raw: Any, secure: BootstrapServer, key: bytes,
                                       rec: Any) -> None:
    from kvhandoff.bootstrap.auth import sign
    body = msgspec.json.encode(rec(0))
    hdrs = sign(key, "POST", "/v1/register", body, now=time.time(), server=secure.server_id)
    assert raw.send("POST", "/v1/register", body, headers=hdrs)[0] == 200
    # An eavesdropper replays the legitimate request, also after the rank left.
    status, reply = raw.send("POST", "/v1/register", body, headers=hdrs)
    assert status == 401 and "already used" in reply["reason"]
    assert deregister(secure.url, rec(0), key=key, retries=0)
    status, reply = raw.send("POST", "/v1/register", body, headers=hdrs)
    assert status == 401 and "already used" in reply["reason"]
    assert secure.registry.health().ranks == 0
    # A replayed DELETE cannot remove the rank once it registered again.
    dbody = msgspec.json.encode({"instance": "prod", "dp_rank": 0, "tp_rank": 0,
                                 "pp_rank": 0, "control_endpoint": LEGIT})
    dh = sign(key, "DELETE", "/v1/register", dbody, now=time.time(), server=secure.server_id)
    assert raw.send("DELETE", "/v1/register", dbody, headers=dh)[0] == 200
    assert register(secure.url, rec(0), key=key, retries=0).created
    assert raw.send("DELETE", "/v1/register", dbody, headers=dh)[0] == 401
    assert secure.registry.health().ranks == 1


@pytest.mark.parametrize("where", ["second_server", "restarted"])
def test_a_signed_request_cannot_be_replayed_at_another_server_run(
        secure: BootstrapServer, secret_file: str, key: bytes, rec: Any, client: Any,
        where: str) -> None:
    """Finding "lower": a rank's signed DELETE, captured at one server, replayed within
    the signature window at a second server holding the same secret, or at the same
    address once the server restarted. Before, each replay was accepted once (a server's
    memory of used signatures is its own, and one run long) and removed the rank there.
    Now it names the run it was signed for and is refused."""
    from kvhandoff.bootstrap.auth import sign
    dbody = msgspec.json.encode({"instance": "prod", "dp_rank": 0, "tp_rank": 0,
                                 "pp_rank": 0, "control_endpoint": LEGIT})
    captured = sign(key, "DELETE", "/v1/register", dbody, now=time.time(),
                    server=secure.server_id)
    assert client(secure.url).send("DELETE", "/v1/register", dbody, headers=captured)[0] == 200
    port = secure.port
    if where == "restarted":
        secure.close()
    other = BootstrapServer(port=port if where == "restarted" else 0,
                            secret=Secret.load(secret_file)).start()
    try:
        assert register(other.url, rec(0), key=key, retries=0).created
        status, reply = client(other.url).send("DELETE", "/v1/register", dbody,
                                               headers=captured)
        assert status == 401 and "another server" in reply["reason"], reply
        assert other.registry.health().ranks == 1
        assert deregister(other.url, rec(0), key=key, retries=0)  # signed afresh: fine
    finally:
        other.close()


def test_hijack_unsigned_delete_then_reregister_fails(raw: Any, secure: BootstrapServer,
                                                      key: bytes, rec: Any) -> None:
    """Finding H1/1d: DELETE without proof, then the attacker's record in the slot."""
    _legit_pair(secure.url, key, rec)
    for body in ({"instance": "prod", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0},
                 {"instance": "prod", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0,
                  "control_endpoint": LEGIT}):
        status, reply = raw.delete(body)
        assert status == 401, reply
    status, _ = raw.register(rec(0, port=6666))
    assert status in (401,)
    status, _ = raw.register(rec(0, instance="next", port=6666))  # squatting a future name
    assert status == 401
    assert _endpoints(secure.url) == [LEGIT, "tcp://10.0.0.1:17001"]
    assert raw.lookup("next")[0] == 404


def test_delete_needs_the_owners_endpoint(raw: Any, secure: BootstrapServer, key: bytes,
                                          rec: Any) -> None:
    """Signed (a secret holder) but not the owner: the DELETE must name the registered
    endpoint, and a different one is a conflict."""
    _legit_pair(secure.url, key, rec)
    status, reply = raw.delete({"instance": "prod", "dp_rank": 0, "tp_rank": 0,
                                "pp_rank": 0}, key=key)
    assert status == 400 and "control_endpoint" in reply["reason"]
    status, reply = raw.delete({"instance": "prod", "dp_rank": 0, "tp_rank": 0,
                                "pp_rank": 0, "control_endpoint": ATTACKER}, key=key)
    assert status == 409
    # Replacing the slot is a conflict too: deregister first.
    status, reply = raw.register(rec(0, port=6666), key=key)
    assert status == 409
    assert _endpoints(secure.url) == [LEGIT, "tcp://10.0.0.1:17001"]


def test_register_rank_signs_with_the_configured_secret(secure: BootstrapServer,
                                                        secret_file: str, rec: Any) -> None:
    cfg = SessionConfig(secret_file=secret_file, register_retries=0)
    never: Any = lambda endpoint, timeout: False  # noqa: E731
    register_rank(secure.url, rec(0, tp_size=1), config=cfg, probe=never, what="tp0")
    # A restarted rank (new endpoint) takes over the dead one's slot, signed.
    reborn = rec(0, tp_size=1, port=18000)
    register_rank(secure.url, reborn, config=cfg, probe=never, what="tp0")
    assert [r.control_endpoint for r in lookup(secure.url, "prod", wait_timeout=0).ranks] \
        == [reborn.control_endpoint]
    deregister_rank(secure.url, reborn, config=cfg)
    assert secure.registry.health().ranks == 0


def test_register_rank_without_the_secret_says_what_to_set(secure: BootstrapServer,
                                                           rec: Any) -> None:
    cfg = SessionConfig(register_retries=0)
    with pytest.raises(BootstrapFailed, match="KVHANDOFF_SECRET_FILE"):
        register_rank(secure.url, rec(0), config=cfg, probe=lambda e, t: False, what="tp0")
    assert secure.registry.health().ranks == 0


def test_register_rank_refuses_an_open_secret_file(secure: BootstrapServer, secret_file: str,
                                                   rec: Any) -> None:
    Path(secret_file).chmod(0o644)
    cfg = SessionConfig(secret_file=secret_file, register_retries=0)
    with pytest.raises(BootstrapFailed, match="0644"):
        register_rank(secure.url, rec(0), config=cfg, probe=lambda e, t: False, what="tp0")


def test_secret_file_from_the_environment(secret_file: str) -> None:
    cfg = SessionConfig.from_env({"KVHANDOFF_SECRET_FILE": secret_file})
    assert cfg.secret_file == secret_file


def test_lookups_health_and_metrics_stay_unsigned(raw: Any, secure: BootstrapServer,
                                                  key: bytes, rec: Any) -> None:
    _legit_pair(secure.url, key, rec)
    assert raw.lookup()[0] == 200
    assert raw.send("GET", "/health")[0] == 200
    assert raw.send("GET", "/metrics")[0] == 200


def test_hijack_end_to_end_is_refused_and_handoffs_keep_working(
        raw: Any, secure: BootstrapServer, secret_file: str) -> None:
    """Finding H1 with real agents: the prefill registers signed (its SessionConfig names
    the secret); the attacker's unsigned DELETE and re-registration of its slot are
    refused; decode keeps finding the real prefill, before and after; closing the prefill
    deregisters it, signed."""
    from kvhandoff.lab.testing.rig import Rig

    rig = Rig(secure.url, "h1", prefill_cfg={"secret_file": secret_file},
              decode_cfg={"secret_file": secret_file})
    try:
        rig.handoff(rig.plan(1))
        (held,) = lookup(secure.url, "h1", wait_timeout=0).ranks
        assert held.control_endpoint == rig.prefill.endpoint
        slot = {"instance": "h1", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0}
        assert raw.delete(slot)[0] == 401
        assert raw.delete(slot | {"control_endpoint": held.control_endpoint})[0] == 401
        evil = msgspec.structs.replace(held, control_endpoint=ATTACKER)
        assert raw.register(evil)[0] == 401
        assert lookup(secure.url, "h1", wait_timeout=0).ranks == [held]
        rig.handoff(rig.plan(2, block=1))
    finally:
        rig.close()
    assert secure.registry.health().ranks == 0  # the signed deregistration on close
