"""The deployment secret reaches every data handshake kvhandoff builds a transport for:
the engines' staging channel (nixl, mooncake, through ``create_transport``), the vLLM
connector's host-staging transport (a decode on shm) and the test rig's prefill, also
after a restart. A client keyed with the endpoint token alone is refused; the
legitimate peer, holding the secret, hands off byte-exact.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvhandoff.bootstrap.server import BootstrapServer
from kvhandoff.lab.testing.fixtures import bootstrap, instance, no_leaked_threads
from kvhandoff.lab.testing.hostile import exact
from kvhandoff.lab.testing.params import transport_params
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.lab.testing.transport import PlanBuilder, noise
from kvhandoff.secret import PURPOSE_DATA, Secret, data_key, write_secret_file
from kvhandoff.session.config import SessionConfig
from kvhandoff.transport import ConnectError, TransferState
from kvhandoff.transport.engines.common import EnginePeer
from kvhandoff.transport.framing.served import prove
from kvhandoff.transport.registry import create_transport
from kvhandoff.transport.shm.transport import ShmTransport
from kvhandoff.transport.staging import Staging, StagingConfig

FIXTURES = (bootstrap, instance, no_leaked_threads)  # imported for pytest
DATA_KEY = Secret.from_bytes(b"kvhandoff engine staging test secret, 32+").key(PURPOSE_DATA)
TIMEOUT = 30.0
OPTIONS: dict[str, Any] = {"io_timeout": 5.0, "connect_timeout": 5.0,
           "staging": StagingConfig(slot_bytes=64 << 10, slots=8, slots_per_peer=2)}


def engines() -> list[object]:
    return transport_params(("mooncake", "nixl"))


@pytest.mark.parametrize("engine", engines())
def test_engine_staging_is_keyed_with_the_deployment_secret(engine: str) -> None:
    """``create_transport(engine, data_secret=...)`` keys the staging control server:
    the advertised token alone is refused, as is a whole transport without the secret
    (its connect fails: the staging channel refused it); a peer holding the secret
    stages a fragmented plan byte-exact."""
    with create_transport(engine, data_secret=DATA_KEY, **OPTIONS) as rx, \
            create_transport(engine, data_secret=DATA_KEY, **OPTIONS) as tx:
        rng = np.random.default_rng(3)

        def src_alloc(n: int) -> np.ndarray:
            a = np.empty(n, np.uint8)
            tx.register(a)
            return a

        def dst_alloc(n: int) -> tuple[int, np.ndarray]:
            a = rx.allocate(n)
            a[:] = noise(rng, n)
            return int(a.ctypes.data), a

        b = PlanBuilder(rng, src_alloc, dst_alloc)
        plan = b.plan("head_slice_gather")
        want = b.expected(plan)
        endpoint = rx.endpoint()
        info = json.loads(json.loads(endpoint)["options"][Staging.OPTION])
        with socket.create_connection((info["host"], info["port"]), timeout=TIMEOUT) as s, \
                pytest.raises(ConnectError, match="refused our proof"):  # the token alone
            prove(s, key=info["token"].encode(), endpoint_id=info["id"], timeout=TIMEOUT,
                  peer="staging")
        with create_transport(engine, **OPTIONS) as thief, \
                pytest.raises(ConnectError, match="refused our proof"):
            thief.connect(endpoint)
        assert rx.staging_slots_in_use == 0, "a peer without the secret was leased slots"
        peer = tx.connect(endpoint)
        assert isinstance(peer, EnginePeer) and peer.link is not None
        h = tx.submit(peer, plan)
        assert tx.wait(h, TIMEOUT) is TransferState.DONE, h.error
        assert peer.link.submitted == 1, "the plan was not staged"
        for i, ((_, got), exp) in enumerate(zip(b.dsts, want, strict=True)):
            assert np.array_equal(got, exp), f"destination tensor {i} differs"
        h.release()
        peer.close()


def test_vllm_host_staging_transport_is_keyed_with_the_secret_file(tmp_path: Path) -> None:
    """A decode worker on shm gets its mirror's transport from ``kv_memory`` (the agent
    is handed it, so cannot key it): that transport takes the data key of the config's
    ``secret_file``, as the agent's own would. A peer with the token alone is refused;
    one with the secret's data key reaches it."""
    torch = pytest.importorskip("torch")
    from kvhandoff.integrations.vllm.host_staging import kv_memory

    secret_file = write_secret_file(tmp_path / "secret")
    config = SessionConfig.from_env({}, transport="shm", secret_file=secret_file)
    tensors = {"model.layers.0.self_attn.attn": torch.zeros(4, 2, 16, 8)}
    mem = kv_memory(tensors, [list(tensors)], config, producer=False)
    try:
        assert mem.transport is not None and mem.staging is not None
        endpoint = mem.transport.endpoint()
        with ShmTransport() as thief, pytest.raises(ConnectError, match="refused our proof"):
            thief.connect(endpoint)
        with ShmTransport(data_secret=data_key(secret_file)) as peer_side:
            peer_side.connect(endpoint).close()
    finally:
        mem.close()


def test_data_key_is_none_without_a_secret_file(tmp_path: Path) -> None:
    assert data_key("") is None
    secret_file = write_secret_file(tmp_path / "secret")
    assert data_key(secret_file) == Secret.load(secret_file).key(PURPOSE_DATA)


def test_a_rig_with_a_secret_file_hands_off_after_restarting_prefill(
        instance: str, tmp_path: Path) -> None:
    """The rig builds its prefill transport itself (at start and on restart): keyed
    with the secret file's data key, or the decode's server would refuse it."""
    cfg = {"secret_file": write_secret_file(tmp_path / "secret")}
    with BootstrapServer(secret=Secret.load(cfg["secret_file"])) as srv:
        r = Rig(srv.url, instance, prefill_cfg=cfg, decode_cfg=cfg)
        try:
            first = r.plan(1)
            r.handoff(first)
            r.restart_prefill()
            second = r.plan(2, block=2)
            r.handoff(second)
            assert exact(r, [first, second]) == []
        finally:
            r.close()
