"""Real SGLang 0.5.23 servers on this CPU (``.venv-sglang``), PD disaggregation end to end.

Per model (Llama: plain KV; Mellum: the hybrid SWA pool, prompts longer than its window;
DeepSeek-V2: the MLA latent pool) over kvhandoff's backend, and Llama also over SGLang's
own ``mooncake_tcp`` as the rig's control (:func:`~kvhandoff.lab.testing.sglang.backends_for`;
``tests/e2e/conftest.py`` deselects the other rows), a prefill and a decode server behind
sglang-router serve every prompt (5 to 1500 tokens):

* decode's greedy tokens equal the colocated server's, token for token;
* prefill sent exactly the bytes the model's sizes call for, per component (SGLang's own
  accounting, from inside its scheduler, and kvhandoff's own count where it is the
  backend), and the total SGLang reports agrees;
* given another prompt than prefill's, decode still generates prefill's prompt's tokens
  (the negative control: decode's tokens come from the transferred state alone);
* both sides registered the same pools, with the model's state types.

NemotronH (Mamba2) and DeepSeek-V3.2 (DSA) boot in both roles over kvhandoff's backend and
register ``mamba`` and ``dsa`` state; how SGLang reads ``SGLANG_PLUGINS`` is pinned.

The servers start once per run of this module, one model's at a time, all of a model's at
once (:mod:`kvhandoff.lab.testing.sglang`), and the last model's stop when the module ends:
idle, SGLang's CPU schedulers spin at about half a core each, which would slow every later
test of the session. ``make test``
builds ``.venv-sglang`` first; elsewhere these tests skip, saying how to build it.
"""

from __future__ import annotations

import random
import subprocess
import textwrap
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvhandoff.integrations import AuxSpec
from kvhandoff.lab.sglang.client import generate, stream
from kvhandoff.lab.sglang.env import lab_env
from kvhandoff.lab.sglang.rig import Deployment, Reference, all_running, make_pair
from kvhandoff.lab.testing.sglang import (
    BOOT_ONLY,
    MAX_NEW_TOKENS,
    STATE_TYPES,
    Run,
    backend,
    deployment,
    expected_bytes,
    model,
    model_deployments,
    reference,
    reference_tokens,
    runs,
    sglang_logs,
    sglang_or_skip,
    shape,
)

FIXTURES = (backend, deployment, model, model_deployments, reference, reference_tokens, runs,
            sglang_logs)
pytestmark = pytest.mark.sglang


def test_decode_tokens_equal_colocated(runs: list[Run],
                                       reference_tokens: Mapping[str, tuple[int, ...]]) -> None:
    wrong = {r.prompt: (r.answer.output_ids, reference_tokens[r.prompt]) for r in runs
             if r.answer.output_ids != reference_tokens[r.prompt]}
    assert not wrong, f"PD tokens differ from colocated (got, want): {wrong}"
    assert all(len(r.answer.output_ids) == MAX_NEW_TOKENS for r in runs)


def test_prefill_sent_every_component(runs: list[Run], model: str) -> None:
    for r in runs:
        want = expected_bytes(model, len(r.input_ids))
        got = dict(r.entry.components)
        aux = got.pop("aux")
        assert aux > 0, r
        assert got == want, f"{r.prompt}: bytes per component {got}, expected {want}"
        own = None if r.entry.own_components is None else dict(r.entry.own_components)
        if own is None:  # SGLang's own backends report the KV and state bytes
            assert r.entry.sglang_total_bytes == sum(want.values()), r
            continue
        # kvhandoff counts every component itself: the same KV and state bytes, SGLang's
        # metadata row, its arrival guard row, and reports the sum of them all to SGLang
        assert own.pop("metadata") == aux and own.pop("aux") == AuxSpec().row_bytes, r
        assert own == want, f"{r.prompt}: kvhandoff's bytes per component {own}, expected {want}"
        assert r.entry.sglang_total_bytes == sum(want.values()) + aux + AuxSpec().row_bytes, r


def test_decode_follows_the_state_it_receives(deployment: Deployment,
                                             reference: Reference) -> None:
    """The negative control: prefill computes prompt X, decode is given prompt Y of the
    same length in the same room. Decode's tokens are X's, not Y's: what it generates
    comes from the transferred state alone (no recompute), and the comparison above
    tells different states apart."""
    rng = random.Random(1)
    x, y = (tuple(rng.randrange(3, 512) for _ in range(300)) for _ in range(2))
    ref_url = reference.ready().url
    want_x, want_y = (stream(ref_url, p, max_new_tokens=MAX_NEW_TOKENS).output_ids
                      for p in (x, y))
    assert want_x != want_y
    room = deployment.prefill.bootstrap(rng.getrandbits(62))
    with ThreadPoolExecutor(2) as pool:
        to_prefill = pool.submit(generate, deployment.prefill.url, x,
                                 max_new_tokens=MAX_NEW_TOKENS, bootstrap=room)
        to_decode = pool.submit(generate, deployment.decode.url, y,
                                max_new_tokens=MAX_NEW_TOKENS, bootstrap=room)
        got = tuple(to_decode.result()["output_ids"])
        to_prefill.result()
    assert got == want_x


def test_both_sides_register_the_same_pools(deployment: Deployment, model: str) -> None:
    regs = {r.mode: r for r in deployment.registrations()}
    assert set(regs) == {"prefill", "decode"}, regs
    p = regs["prefill"]
    assert shape(p) == shape(regs["decode"])
    assert p.state_types == STATE_TYPES[model]
    assert p.is_mla == (model == "deepseek_v2")
    # page size 1: one item of every KV buffer is one token's KV in one layer
    assert p.page_size == 1 and sum(p.kv_item_lens) == expected_bytes(model, 1)["kv"]


@pytest.mark.parametrize("backend_name", ["kvhandoff"])
def test_boot_only_models_start_in_both_roles(backend_name: str, tmp_path: Path) -> None:
    """NemotronH (Mamba2) and DeepSeek-V3.2 (DSA) cannot run a forward pass on CPU, but
    their prefill and decode servers start over kvhandoff's backend, build their pools and
    register the state components it must carry: what the pool tests build on."""
    py = sglang_or_skip()
    pairs = [make_pair(m, backend_name, log_dir=tmp_path / m, python=py) for m in BOOT_ONLY]
    with all_running([s for pair in pairs for s in (pair.prefill, pair.decode)], 600):
        for pair in pairs:
            regs = {r.mode: r for r in pair.registrations()}
            assert set(regs) == {"prefill", "decode"}, (pair.model, regs)
            p = regs["prefill"]
            assert shape(p) == shape(regs["decode"]), regs
            assert p.state_types == STATE_TYPES[pair.model], regs
            assert all(n > 0 for c in p.state_item_lens for n in c), regs


def test_plugin_whitelist(tmp_path: Path) -> None:
    """How SGLang reads SGLANG_PLUGINS, which the lab relies on: empty loads every
    installed plugin (here a broken one), a value naming none (the lab's ``,``) loads
    none, a name loads only that one."""
    py = sglang_or_skip()
    dist = tmp_path / "kvh_probe_broken-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvh-probe-broken\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nkvh_probe_broken = kvh_probe_no_such_module:register\n")
    code = textwrap.dedent("""
        import logging, os, sys
        import sglang.srt.plugins as plugins
        seen = []
        class Catch(logging.Handler):
            def emit(self, record):
                seen.append(record.getMessage())
        logging.getLogger("sglang.srt.plugins").addHandler(Catch())
        logging.getLogger("sglang.srt.plugins").setLevel(logging.INFO)
        for value in ("", ",", "some_other_plugin"):
            os.environ["SGLANG_PLUGINS"] = value  # read at each load
            plugins._plugins_loaded = False  # load_plugins runs once per process
            seen.clear()
            plugins.load_plugins()
            print(repr(value),
                  "FAILED" if any("Failed to load plugin kvh_probe_broken" in m for m in seen)
                  else "SKIPPED" if any("Skipping plugin kvh_probe_broken" in m for m in seen)
                  else "ABSENT")
    """)
    env = lab_env(backend="mooncake_tcp")
    env["PYTHONPATH"] += f":{tmp_path}"
    done = subprocess.run([str(py), "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-3:] == [
        "'' FAILED", "',' SKIPPED", "'some_other_plugin' SKIPPED"], done.stdout
