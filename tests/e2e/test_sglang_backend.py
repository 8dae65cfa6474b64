"""kvhandoff as SGLang's ``kvhandoff`` transfer backend, in SGLang 0.5.23's own
interpreter (``.venv-sglang``; each check a subprocess with its python):

* the plugin: SGLang's ``load_plugins()`` makes ``kvhandoff`` resolve to kvhandoff's
  classes (also where ``prefill.py`` and ``decode.py`` imported ``get_kv_class``) and
  leaves Mooncake and NIXL as they were; SGLang's own CLI takes the backend only with the
  plugin; another SGLang version is refused, naming both;
* the pools test: SGLang's real memory pools on CPU (MHA, MLA, SWA, a Mamba pool in a
  hybrid pool, the DSA pool), two or three managers in as many processes through the
  backend (SGLang's bootstrap server hosting kvhandoff's registry, real control sockets,
  tcp), every byte decode holds checked against kvhandoff's oracle and every other byte
  untouched, prefill TP != decode TP (MHA 1 -> 2 with a decode prefix, MLA 1 -> 2, Mamba
  2 -> 1); one flipped byte found by the check, and one flipped on the wire caught by
  checksums;
* refusals and faults: a pair whose pools differ fails every request at registration with
  the handshake's reason; an abort, a killed peer and a silent prefill end as ``Failed``
  on the other side with a reason, and leave no live request behind.

Skipped, with the reason, only where SGLang's virtualenv is absent (``make sglang-venv``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvhandoff.lab.testing.sglang_pools import REPO_ROOT, Result, run_handoff, sglang_python
from kvhandoff.lab.vllm.serve import free_ports
from kvhandoff.secret import write_secret_file

PY = sglang_python()
pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not PY.exists(), reason=f"{PY} is missing: run "
                                 "`make sglang-venv` (make test does)")]

SUCCESS, FAILED = 4, 0


def _probe(*args: str, plugins: str = "kvhandoff") -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "SGLANG_PLUGINS": plugins}
    out = subprocess.run([str(PY), "-m", "kvhandoff.lab.testing.sglang_probe", *args],
                         env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line is not None, out.stderr[-3000:]
    return dict(json.loads(line[6:]))


def test_the_plugin_resolves_kvhandoff_and_leaves_mooncake_and_nixl_alone() -> None:
    got = _probe("plugin")
    assert "kvhandoff" in got["backends"] and "kvhandoff" in got["choices"], \
        "the plugin did not load: is kvhandoff installed in .venv-sglang? (make sglang-venv)"
    ours = "kvhandoff.integrations.sglang.conn.Kvhandoff"
    assert got["kvhandoff"] == {
        "kvargs": "sglang.srt.disaggregation.base.conn.KVArgs",
        "manager": f"{ours}KVManager", "sender": f"{ours}KVSender",
        "receiver": f"{ours}KVReceiver", "bootstrap_server": f"{ours}KVBootstrapServer"}
    assert got["prefill_module"] == f"{ours}KVSender"
    assert got["decode_module"] == f"{ours}KVReceiver"
    # a CPU sender must not ask prefill for pinned host index tensors and CUDA events
    assert got["host_tensor_indices"] is False
    for backend, prefix in (("mooncake", "Mooncake"), ("nixl", "Nixl")):
        assert got[backend]["sender"] == \
            f"sglang.srt.disaggregation.{backend}.conn.{prefix}KVSender"
        assert got[backend]["manager"].endswith(f"{prefix}KVManager")


def test_the_cli_takes_kvhandoff_only_with_the_plugin() -> None:
    assert _probe("cli") == {"accepted": True, "backend": "kvhandoff"}
    without = _probe("cli", plugins=",")  # a whitelist naming no plugin: none loads
    assert without["accepted"] is False and without["exit"] == 2
    assert "invalid choice: 'kvhandoff'" in without["error"]


def test_another_sglang_version_is_refused_naming_both() -> None:
    got = _probe("version", "0.5.24")
    assert "kvhandoff" not in got["backends"] and "kvhandoff" not in got["choices"]
    assert ("kvhandoff's SGLang transfer backend is built for SGLang 0.5.23, but SGLang "
            "0.5.24 is installed") in got["log"]


def _handoff(tmp_path: Path, **case: Any) -> dict[tuple[str, int], Result | None]:
    (port,) = free_ports(1)
    return run_handoff(PY, REPO_ROOT, tmp_path, port=port, timeout=90.0, **case)


def _exact(results: dict[tuple[str, int], Result | None]) -> None:
    """Every rank succeeded, counted in kvhandoff's metrics; every decode byte as the
    oracle says, nothing else touched, one flipped byte found; nothing left live."""
    for (role, rank), r in results.items():
        assert r is not None, f"{role} rank {rank} left no result"
        assert r.status == SUCCESS and r.live == 0 and r.counted == 1, (role, rank, r)
        if role == "decode":
            assert r.checked > 0 and r.wrong == 0 and r.untouched_changed == 0, r
            assert r.flipped_found == 1, r
        else:
            assert r.metric_bytes, r  # get_transfer_metric reports what moved
            assert r.keyed, r  # bound to its room's decode (a secret is on by default)


@pytest.mark.parametrize(("family", "ptp", "dtp", "prefix"), [
    ("mha", 1, 2, 4),  # heads split across decode ranks; decode already holds page 0
    ("mla", 1, 2, 0),  # the latent replicated to both decode ranks
    ("swa", 1, 1, 0),  # full pages and the sliding window's own pages
    ("mamba", 2, 1, 0),  # Mamba2 conv [x|B|C] and SSM heads from two prefill ranks
    ("dsa", 1, 1, 0),  # MLA latent and the DSA indexer's pages (64-token pages)
])
def test_sglang_pools_hand_off_byte_exact(tmp_path: Path, family: str, ptp: int, dtp: int,
                                          prefix: int) -> None:
    _exact(_handoff(tmp_path, family=family, prefill_tp=ptp, decode_tp=dtp, prefix=prefix))


def test_one_byte_flipped_on_the_wire_is_caught(tmp_path: Path) -> None:
    """Prefill's transport flips one source byte while it writes (after the sender
    digested its bytes); decode, asking for checksums, fails the request naming them."""
    # the flipping transport is a tcp one: decode must speak tcp too (not the default auto)
    got = _handoff(tmp_path, family="mha", flip=True,
                   decode_env={"KVHANDOFF_CHECKSUM": "1", "KVHANDOFF_TRANSPORT": "tcp"})
    decode = got[("decode", 0)]
    assert decode is not None and decode.status == FAILED, decode
    assert "component 'kv': decode bytes crc32" in decode.reason and decode.live == 0


def test_a_pair_whose_pools_differ_is_refused_at_registration(tmp_path: Path) -> None:
    """Decode's KV heads are 32 wide, prefill's 16: SGLang's own handshake (dtype only)
    would pass them; kvhandoff's refuses the pair when decode registers, and the request
    fails with the reason, naming the component and both sizes."""
    got = _handoff(tmp_path, family="mha", decode_head_dim=32)
    decode = got[("decode", 0)]
    assert decode is not None and decode.status == FAILED, decode
    assert "kvhandoff refuses this prefill/decode pair" in decode.reason
    assert "component 'kv' tensor 'k' layer 0" in decode.reason and \
        "prefill item 256 B vs decode item 512 B" in decode.reason, decode.reason


def test_with_a_deployment_secret_only_its_holders_hand_off(tmp_path: Path) -> None:
    """With ``KVHANDOFF_SECRET_FILE`` the registry, the control plane and the data plane
    are keyed as everywhere in kvhandoff: a pair holding the secret hands off byte-exact;
    a decode without it is refused, and says why."""
    secret = write_secret_file(tmp_path / "secret")
    keyed = {"KVHANDOFF_SECRET_FILE": secret}
    _exact(_handoff(tmp_path / "keyed", family="mha", env=keyed))
    got = _handoff(tmp_path / "stranger", family="mha", env=keyed,
                   decode_env={"KVHANDOFF_SECRET_FILE": ""})
    decode = got[("decode", 0)]
    assert decode is not None and decode.status == FAILED, decode
    assert "KVHANDOFF_SECRET_FILE" in decode.reason and "not authenticated" in decode.reason


def test_a_decode_without_the_rooms_key_gets_nothing(tmp_path: Path) -> None:
    """Both sides derive the request's key from its room and the deployment secret; a
    decode that holds the secret but claims the room with another room's key (an
    impostor, or a misrouted request) is refused before anything is planned or written
    and fails saying so; prefill, whose decode never came, fails too, and neither side
    keeps anything live."""
    got = _handoff(tmp_path, family="mha", scenario="foreign_key",
                   env={"KVHANDOFF_INDICES_TIMEOUT": "5"})
    decode, prefill = got[("decode", 0)], got[("prefill", 0)]
    assert decode is not None and decode.status == FAILED, decode
    assert "proof does not match the request's key" in decode.reason, decode.reason
    assert prefill is not None and prefill.status == FAILED and prefill.keyed, prefill
    assert decode.live == 0 and prefill.live == 0, got


# decode's abort and a killed decode run through real servers in test_sglang_faults.py
@pytest.mark.parametrize(("scenario", "failed", "dead", "words", "decode_env"), [
    ("prefill_abort", "decode", None, "abort", {}),
    ("kill_prefill", "decode", "prefill", "", {}),
    ("prefill_silent", "decode", None, "waiting_timeout", {"KVHANDOFF_WAITING_TIMEOUT": "4"}),
])
def test_faults_fail_the_other_side_with_a_reason_and_leak_nothing(
        tmp_path: Path, scenario: str, failed: str, dead: str | None, words: str,
        decode_env: dict[str, str]) -> None:
    got = _handoff(tmp_path, family="mha", scenario=scenario, decode_env=decode_env)
    other = got[(failed, 0)]
    assert other is not None and other.status == FAILED and other.reason, (scenario, other)
    assert words in other.reason, other.reason
    assert other.live == 0, other  # its request cleared, released: nothing left
    if dead is not None:
        assert got[(dead, 0)] is None  # it died on purpose, printing nothing
    for r in got.values():
        assert r is None or r.live == 0, r
