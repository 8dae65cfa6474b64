"""A process of another user on the host, for ``test_other_users.py`` (run as a script,
never collected).

It is started as root only so that it can load the interpreter and the library (this
host keeps them where other users cannot read), then drops to the other user's uid and
gid — from there on the kernel treats it as that user — and attacks a default
deployment of root's with the library's own clients, as a co-tenant with kvhandoff
installed would: it tries to read the deployment's secret, makes its own default secret
(as any process of that user would), registers a rank and deregisters the victim's at
the bootstrap, aborts the live request on both control planes (unsigned, and signed
with its own secret), and dials the decode's data port with its own data key, knowing
even the endpoint's token.

Protocol: one JSON job on stdin (``uid``, ``gid``, ``bootstrap``, ``secret``,
``instance``, ``victim`` control endpoint, ``prefill``, ``decode``, ``rid``,
``data_endpoint``); one JSON object on stdout, each attack → what came of it.
"""

from __future__ import annotations

import encodings.idna  # noqa: F401  (imported now: nothing can be read once we are them)
import json
import os
import sys
import time
from typing import Any

import zmq

from kvhandoff.bootstrap import auth as _auth  # noqa: F401
from kvhandoff.bootstrap.client import BootstrapError, RankId, RankRecord, deregister, register
from kvhandoff.protocol import Abort, encode_message
from kvhandoff.protocol import RankId as WireRank
from kvhandoff.secret import PURPOSE_BOOTSTRAP, PURPOSE_CONTROL, PURPOSE_DATA, deployment_secret
from kvhandoff.session.control.auth import Signer, Stream
from kvhandoff.transport.errors import TransportError
from kvhandoff.transport.tcp.transport import TcpTransport


def _become(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    assert os.geteuid() == uid and os.getegid() == gid


def _bootstrap(job: dict[str, Any], key: bytes | None) -> dict[str, str]:
    url, out = job["bootstrap"], {}
    rec = RankRecord(instance=job["instance"] + "-mine", dp_size=1, dp_rank=0, tp_size=1,
                     tp_rank=0, pp_size=1, pp_rank=0, control_endpoint="tcp://127.0.0.1:1",
                     transport="tcp", model_signature="0123456789abcdef")
    victim = RankId(instance=job["instance"], dp_rank=0, tp_rank=0, pp_rank=0,
                    control_endpoint=job["victim"])
    for name, call in (("register", lambda k: register(url, rec, retries=0, key=k)),
                       ("deregister", lambda k: deregister(url, victim, retries=0, key=k))):
        for signed, k in (("unsigned", None), ("signed", key)):
            try:
                call(k)
                out[f"{name}_{signed}"] = "accepted"
            except BootstrapError as e:
                out[f"{name}_{signed}"] = f"refused: {e}"
    return out


def _abort(job: dict[str, Any], key: bytes | None) -> dict[str, str]:
    """An Abort of the live request to each agent, claiming the other agent's endpoint:
    unsigned, then signed with our own control key."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    out = {}
    try:
        for target, claimed, name in ((job["prefill"], job["decode"], "prefill"),
                                      (job["decode"], job["prefill"], "decode")):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 500)
            d.setsockopt(zmq.ROUTING_ID, claimed.encode())
            d.connect(target)
            msg = encode_message(Abort(request_id=job["rid"], rank=WireRank(instance="x"),
                                       reason=f"aborted by another user ({os.geteuid()})"))
            d.send(msg)
            if key is not None:
                signer = Signer(key, endpoint=claimed, now=time.time())
                d.send(signer.seal(msg, recipient=target.encode(), stream=Stream.DEALER,
                                   now=time.time()))
            out[f"abort_{name}"] = "sent"
            d.close()
    finally:
        ctx.term()
    return out


def _data(job: dict[str, Any], key: bytes | None) -> dict[str, str]:
    """Dial the decode's data port knowing its endpoint's token: keyed with our own data
    key, and with the token alone (a deployment without a secret's key)."""
    out = {}
    for name, k in (("data_keyed", key), ("data_token", None)):
        with TcpTransport(data_secret=k, connect_timeout=5.0) as t:
            try:
                t.connect(job["data_endpoint"].encode()).close()
                out[name] = "accepted"
            except TransportError as e:
                out[name] = f"refused: {e}"
    return out


def main() -> int:
    job = json.loads(sys.stdin.read())
    _become(int(job["uid"]), int(job["gid"]))
    out: dict[str, str] = {}
    try:
        with open(job["secret"], "rb") as f:
            f.read()
        out["read_secret"] = "read"
    except OSError as e:
        out["read_secret"] = f"refused: {e.strerror}"
    mine = deployment_secret()  # what any process of this user would use by default
    assert mine is not None
    out.update(_bootstrap(job, mine.key(PURPOSE_BOOTSTRAP)))
    out.update(_abort(job, mine.key(PURPOSE_CONTROL)))
    out.update(_data(job, mine.key(PURPOSE_DATA)))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
