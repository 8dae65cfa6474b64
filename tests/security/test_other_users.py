"""Safe without configuration (issue #30 item 2): a default deployment — a bootstrap
server and agents given no secret and no flag — is closed to processes of other users
on the host. A real second user (made with ``useradd``) cannot read the deployment's
secret, register or deregister at the bootstrap, abort the live request on either
control plane, or pass the decode's data-plane handshake even knowing its token; the
request then completes byte-exact. The same attacks on an explicitly ``insecure``
deployment (the old default) all succeed, which is what the default now prevents.

Needs root (to create the user and to drop to it); elsewhere the tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.fixtures import instance, no_leaked_threads
from kvhandoff.lab.testing.hostile import eventually, exact
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.secret import default_secret_file
from kvhandoff.session import Status

FIXTURES = (instance, no_leaked_threads)  # imported for pytest
INTRUDER = Path(__file__).with_name("intruder.py")
USER = "kvh-intruder"
INTRUDER_S = 120.0
"""Bounds the intruder's run; the live request waits for its chunks at least as long (the
rig's 5 s waiting timeout ran out while a loaded machine ran the intruder)."""


@pytest.fixture(scope="module")
def other_user() -> tuple[int, int]:
    """(uid, gid) of a second, unprivileged user of this host (made if missing; kept)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: to create a second user and run a process as it")
    useradd = shutil.which("useradd")
    if useradd is None:
        pytest.skip("useradd is missing (Debian: apt-get install passwd)")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        made = subprocess.run([useradd, "--system", "--no-create-home", "--shell",
                               "/usr/sbin/nologin", USER], capture_output=True, timeout=60)
        if made.returncode not in (0, 9):  # 9: made meanwhile by another session
            pytest.fail(f"useradd {USER}: {made.stderr.decode(errors='replace')}")
    entry = pwd.getpwnam(USER)
    return entry.pw_uid, entry.pw_gid


@pytest.fixture(params=["default", "insecure"])
def deployment(request: pytest.FixtureRequest, instance: str) -> Iterator[Rig]:
    """A bootstrap server and a rig configured with nothing (or explicitly insecure) but a
    waiting timeout the intruder cannot outlast."""
    insecure = request.param == "insecure"
    cfg: dict[str, Any] = {"waiting_timeout": INTRUDER_S} | ({"insecure": True} if insecure
                                                              else {})
    with BootstrapServer(insecure=insecure) as srv:
        rig = Rig(srv.url, instance, prefill_cfg=cfg, decode_cfg=cfg)
        try:
            yield rig
        finally:
            rig.close()


def _intrude(rig: Rig, uid: int, gid: int, rid: object) -> dict[str, str]:
    job = {"uid": uid, "gid": gid, "bootstrap": rig.url, "secret": default_secret_file(),
           "instance": rig.prefill_cfg.instance, "victim": rig.prefill.endpoint,
           "prefill": rig.prefill.endpoint, "decode": rig.decode.endpoint, "rid": rid,
           "data_endpoint": rig.decode.transport_endpoint.decode()}
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, str(INTRUDER)], input=json.dumps(job).encode(),
                         capture_output=True, timeout=INTRUDER_S, env=env)
    assert run.returncode == 0, run.stderr.decode(errors="replace")[-3000:]
    out: dict[str, str] = json.loads(run.stdout)
    return out


def test_another_user_cannot_touch_a_default_deployment(
        deployment: Rig, other_user: tuple[int, int], request: pytest.FixtureRequest) -> None:
    rig = deployment
    insecure = rig.prefill_cfg.insecure
    first, rp = rig.plan(1), rig.plan(2, block=1)
    rig.handoff(first)
    s, chunks, state = rig.sender(rp)
    r = rig.receiver(rp)
    assert eventually(lambda: s.status is Status.WAITING_FOR_INPUT)
    registered = rig.prefill.endpoint
    got = _intrude(rig, *other_user, rp.rid)
    if insecure:  # what the default used to allow
        assert got["read_secret"].startswith("refused")  # there is none to read
        for attack in ("register_unsigned", "deregister_unsigned", "data_token"):
            assert got[attack] == "accepted", got
        assert r.wait(10) is Status.FAILED and "another user" in str(r.reason), r.reason
        assert s.wait(10) is Status.FAILED
        return
    assert got["read_secret"].startswith("refused: Permission denied"), got
    for attack in ("register_unsigned", "register_signed", "deregister_unsigned",
                   "deregister_signed", "data_keyed", "data_token"):
        assert got[attack].startswith("refused"), (attack, got)
    for attack in ("register", "deregister"):
        assert "401" in got[f"{attack}_signed"] and "401" in got[f"{attack}_unsigned"], got
    assert eventually(lambda: rig.prefill.stats["unauthenticated"] >= 2
                      and rig.decode.stats["unauthenticated"] >= 2)
    rig.send_all(s, chunks, state)
    assert r.wait(10) is Status.SUCCESS, r.reason
    assert s.wait(10) is Status.SUCCESS, s.reason
    assert exact(rig, [first, rp]) == []
    assert rig.decode.handshake(rig.url) is None  # still registered, at its own endpoint
    assert rig.prefill.endpoint == registered
