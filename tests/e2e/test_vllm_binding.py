"""A request's KV goes only to the decode it was routed to, through real vLLM servers
(``.venv-vllm``, issue #30 item 1).

One bootstrap, a prefill server, the decode the request is routed to, and a rogue decode
server of the same model and bootstrap. The test plays the proxy: it asks prefill for a
request's KV, gets its ``kv_transfer_params`` (with the request's key, ``kvh_key``),
hands them to the real decode, and hands the rogue what a rogue could have — every
param but the key, with a key of its own — before, after or at the same time as the
real decode. The rogue never loads a byte: prefill refuses its claim while the request
waits (counted in ``kvhandoff_refused_claims``), and after the handoff nothing waits for
it; vLLM's load-failure policy then fails its request. The real decode's tokens equal a
local run and its bytes equal prefill's. Twice: in a default deployment (every server
holds the user's default secret: the rogue holds the deployment key) and in an
``insecure`` one.

``make test`` builds ``.venv-vllm`` first; outside CI the tests skip with a reason when it
is missing, in CI they fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvhandoff.binding import RequestKey
from kvhandoff.lab.testing.fixtures import vllm_or_skip
from kvhandoff.lab.vllm.demo import DUMP_HOOK
from kvhandoff.lab.vllm.serve import VllmServer, free_ports, get_text, post_json

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
ORDERS = ["rogue_first", "overlapping", "rogue_after"]


@dataclass
class Trio:
    model: str
    prefill: VllmServer
    decode: VllmServer
    rogue: VllmServer
    dumps: dict[str, Path]
    metrics: str  # prefill's kvhandoff metrics (KVHANDOFF_METRICS_PORT)



def _kv(role: str, bootstrap: str, dump: Path) -> dict[str, object]:
    """The connector's config; its test hook records what each handoff moved in ``dump``."""
    return {"kv_connector": "KvhandoffConnector",
            "kv_connector_module_path": "kvhandoff.integrations.vllm", "kv_role": role,
            "kv_connector_extra_config": {"bootstrap": bootstrap, "hook": DUMP_HOOK,
                                          "hook_config": {"path": str(dump)}}}


@pytest.fixture(scope="module", params=["default", "insecure"])
def trio(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Trio]:
    py = vllm_or_skip()
    insecure = request.param == "insecure"
    root = tmp_path_factory.mktemp(f"vllm-binding-{request.param}")
    model = root / "model"
    subprocess.run([str(py), "-m", "kvhandoff.lab.vllm.tiny", "llama", str(model)],
                   check=True, timeout=600, capture_output=True)
    boot_port, pp, dp, rp, mp = free_ports(5)
    boot = subprocess.Popen([sys.executable, "-m", "kvhandoff.lab.cli", "bootstrap", "--host",
                             "127.0.0.1", "--port", str(boot_port),
                             *(["--insecure"] if insecure else [])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"127.0.0.1:{boot_port}"
    dumps = {n: root / f"{n}.jsonl" for n in ("prefill", "decode", "rogue")}
    env = {"KVHANDOFF_INSECURE": "1" if insecure else "0", "KVHANDOFF_SECRET_FILE": "",
           "KVHANDOFF_INDICES_TIMEOUT": "30", "KVHANDOFF_WAITING_TIMEOUT": "15",
           "KVHANDOFF_RELEASE_TIMEOUT": "10"}
    servers = {
        "prefill": VllmServer(model, pp, log_path=root / "prefill.log",
                              kv_transfer_config=_kv("kv_producer", url, dumps["prefill"]),
                              env={**env, "KVHANDOFF_METRICS_PORT": str(mp),
                                   "VLLM_CPU_OMP_THREADS_BIND": "0"}),
        **{name: VllmServer(model, port, log_path=root / f"{name}.log",
                            kv_transfer_config=_kv("kv_consumer", url, dumps[name]),
                            env={**env, "VLLM_CPU_OMP_THREADS_BIND": "1"})
           for name, port in (("decode", dp), ("rogue", rp))}}
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready(900)
        yield Trio(str(model), servers["prefill"], servers["decode"], servers["rogue"],
                   dumps, f"http://127.0.0.1:{mp}/metrics")
    finally:
        for s in servers.values():
            s.stop()
        boot.kill()
        boot.wait(30)


def _prompt() -> str:
    """A prompt of several blocks no server has seen (unique from its first token: no
    prefix-cache hit, so a decode loads every block prefill sent)."""
    return f"{uuid.uuid4().hex} " + " ".join(["the quick brown fox jumps over"] * 12)


def _complete(server: VllmServer, model: str, prompt: str, **extra: object
              ) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            **extra}
    out = post_json(server.url + "/v1/completions", body, timeout=300)
    assert isinstance(out, dict)
    return out


def _text(resp: dict[str, Any]) -> str:
    return str(resp["choices"][0]["text"])


def _refused(trio: Trio) -> float:
    """Prefill's count of refused claims (every reason)."""
    total = 0.0
    for line in get_text(trio.metrics).splitlines():
        if line.startswith("kvhandoff_refused_claims_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _decoded(dump: Path, rid: str) -> dict[str, str]:
    """What a decode server recorded as landed for request ``rid``: component → digest."""
    if not dump.exists():
        return {}
    rows = [json.loads(x) for x in dump.read_text().splitlines()]
    return {r["component"]: r["sha256"] for r in rows
            if r.get("request") == rid and r.get("side") == "decode" and "component" in r}


def _rogue_try(trio: Trio, prompt: str, params: dict[str, Any], out: dict[str, object]
               ) -> None:
    """The rogue decode, handed the request's params with a key of its own."""
    stolen = {**params, "kvh_key": RequestKey.new().hex()}
    try:
        out["rogue"] = _complete(trio.rogue, trio.model, prompt, kv_transfer_params=stolen)
    except urllib.error.HTTPError as e:
        out["rogue"] = e.code


@pytest.mark.parametrize("order", ORDERS)
def test_a_rogue_decode_server_never_loads_the_kv(trio: Trio, order: str) -> None:
    prompt = _prompt()
    local = _text(_complete(trio.prefill, trio.model, prompt))
    pre = _complete(trio.prefill, trio.model, prompt, max_tokens=1,
                    kv_transfer_params={"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    rid = str(params["kvh_request_id"])
    assert RequestKey.from_hex(params["kvh_key"])  # prefill keyed the request
    refused = _refused(trio)
    out: dict[str, object] = {}

    def real() -> None:
        out["decode"] = _complete(trio.decode, trio.model, prompt, kv_transfer_params=params)

    if order == "rogue_first":
        _rogue_try(trio, prompt, params, out)
        real()
    elif order == "overlapping":
        rogue = threading.Thread(target=_rogue_try, args=(trio, prompt, params, out))
        rogue.start()
        real()
        rogue.join(300)
    else:  # after the real decode loaded it: the Sender is gone, nothing waits
        real()
        _rogue_try(trio, prompt, params, out)
    decoded = out["decode"]
    assert isinstance(decoded, dict) and _text(decoded) == local
    assert isinstance(out["rogue"], int) and out["rogue"] >= 400, out["rogue"]  # no tokens
    assert _decoded(trio.dumps["rogue"], rid) == {}  # not one block landed there
    real = _decoded(trio.dumps["decode"], rid)
    prefill = {r["component"]: r["sha256"] for r in (
        json.loads(x) for x in trio.dumps["prefill"].read_text().splitlines())
        if r.get("request") == rid and r.get("side") == "prefill" and "component" in r}
    assert real and real == prefill  # the real decode's bytes are prefill's
    if order == "rogue_first":  # the Sender was alive: the claim was refused and counted
        assert _refused(trio) == refused + 1
    # (overlapping: refused the same way if it reached prefill before the real decode's
    # transfer ended, else, as after it, it waited for a Sender that never comes)


def test_a_rogue_without_any_key_computes_locally(trio: Trio) -> None:
    """Params without a key are not loaded at all (the connector refuses them up front);
    the request is computed on the rogue, and the real decode still gets the KV."""
    prompt = _prompt()
    pre = _complete(trio.prefill, trio.model, prompt, max_tokens=1,
                    kv_transfer_params={"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    keyless = {k: v for k, v in params.items() if k != "kvh_key"}
    local = _text(_complete(trio.rogue, trio.model, prompt, kv_transfer_params=keyless))
    assert _decoded(trio.dumps["rogue"], str(params["kvh_request_id"])) == {}
    handed = _complete(trio.decode, trio.model, prompt, kv_transfer_params=params)
    assert _text(handed) == local
