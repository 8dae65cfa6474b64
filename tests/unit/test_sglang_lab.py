"""The SGLang lab's pure pieces, without SGLang: stand-ins that raise when called, the
post-import hooks, the shim list, the environment a lab process gets, model recipes.

The stand-ins are checked in fresh interpreters started the way the lab starts SGLang
(its ``sitecustomize`` on ``PYTHONPATH``), so what is proven is what servers get.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from kvhandoff.lab.sglang import env, hooks, ledger, models, shims, standins


def _run_lab(code: str, *, shim_names: tuple[str, ...] = ("standins",),
             lab: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with the lab's environment and exactly the
    shims ``shim_names``, or (``lab=False``) as an ordinary process of this checkout."""
    e = env.lab_env()
    if lab:
        e[shims.ENV] = ",".join(shim_names)
    else:
        e["PYTHONPATH"] = str(env.REPO_ROOT)
        del e[shims.ENV]
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e,
                          capture_output=True, text=True, timeout=120, check=False)


def test_standins_import_and_raise_naming_the_function() -> None:
    done = _run_lab("""
        import torchvision.transforms as T
        from torchvision.transforms.functional import InterpolationMode
        from sgl_kernel import copy_all_layer_kv_cache_cpu
        import sgl_kernel.kvcacheio
        from kvhandoff.lab.sglang.standins import StandInCalled
        mode = InterpolationMode.BICUBIC          # reading is fine
        for call in (lambda: T.Resize(4, interpolation=mode),
                     lambda: copy_all_layer_kv_cache_cpu(1, 2, 3, 4),
                     lambda: sgl_kernel.kvcacheio.transfer_kv_per_layer()):
            try:
                call()
            except StandInCalled as e:
                print("RAISED", e)
            else:
                print("NO RAISE")
        try:
            class Sub(T.Compose):
                pass
        except StandInCalled as e:
            print("RAISED", e)
    """)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4 and all(line.startswith("RAISED") for line in lines), lines
    assert "torchvision.transforms.Resize was called" in lines[0]
    assert "CPU stand-in" in lines[0]
    assert "sgl_kernel.copy_all_layer_kv_cache_cpu was called" in lines[1]
    assert "sgl_kernel.kvcacheio.transfer_kv_per_layer was called" in lines[2]
    assert "torchvision.transforms.Compose" in lines[3]


def test_standins_are_not_installations() -> None:
    """A stand-in has no version and no distribution: version checks see nothing."""
    done = _run_lab("""
        import importlib.metadata, sgl_kernel
        print(hasattr(sgl_kernel, "__version__"))
        try:
            importlib.metadata.version("torchvision")
        except importlib.metadata.PackageNotFoundError:
            print("no dist")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "no", "dist"]


def test_a_process_the_lab_did_not_start_gets_no_standins() -> None:
    done = _run_lab("import sgl_kernel", lab=False)
    assert done.returncode != 0
    assert "No module named 'sgl_kernel'" in done.stderr


def test_unknown_shim_ends_the_process_naming_it() -> None:
    done = _run_lab("print('ran')", shim_names=("standins", "no_such_shim"))
    assert done.returncode != 0
    assert "ran" not in done.stdout
    assert "no_such_shim" in done.stderr and "standins" in done.stderr


def test_sgl_kernel_op_standins_raise() -> None:
    done = _run_lab("""
        import torch
        from kvhandoff.lab.sglang.standins import StandInCalled
        ns = torch.ops.sgl_kernel
        print(hasattr(ns, "fused_gdn_gating_cpu"), hasattr(ns, "convert_weight_packed"))
        try:
            ns.fused_gdn_gating_cpu(torch.zeros(1))
        except StandInCalled as e:
            print("RAISED", e)
    """, shim_names=("standins", "sgl_kernel_ops"))
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first == "True False"  # only the named ops: AMX detection still sees none
    assert second.startswith("RAISED torch.ops.sgl_kernel.fused_gdn_gating_cpu was called")


def test_install_refuses_an_imported_package() -> None:
    sys.modules["sgl_kernel"] = type(sys)("sgl_kernel")
    try:
        with pytest.raises(RuntimeError, match="already imported"):
            standins.install(["sgl_kernel"])
    finally:
        del sys.modules["sgl_kernel"]


def test_hook_runs_after_the_module_body_once(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "kvh_hooked_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []
    hooks.when_imported("kvh_hooked_mod", lambda m: seen.append(m.VALUE))
    import kvh_hooked_mod  # type: ignore[import-not-found]

    assert seen == [1]
    importlib.reload(kvh_hooked_mod)
    assert seen == [1]  # once: the first import only
    hooks.when_imported("kvh_hooked_mod", lambda m: seen.append(2))  # already imported: now
    assert seen == [1, 2]
    del sys.modules["kvh_hooked_mod"]


def test_shim_names_are_checked() -> None:
    assert shims.parse(" standins, mooncake_cpu ,") == ("standins", "mooncake_cpu")
    with pytest.raises(ValueError, match=r"unknown shim.*'nope'"):
        shims.parse("standins,nope")
    for name in {s for m in models.MODELS.values() for s in m.shims} | set(env.BASE_SHIMS):
        assert name in shims.SHIMS


def test_plugin_whitelist_is_always_explicit() -> None:
    """An empty SGLANG_PLUGINS loads every installed plugin: the lab never sends one."""
    assert env.plugins_for("mooncake_tcp") == env.NO_PLUGINS == ","
    assert env.plugins_for("kvhandoff") == "kvhandoff"
    lab = env.lab_env(shims=("mla_torch_native",), backend="mooncake_tcp")
    assert lab["SGLANG_PLUGINS"] == ","
    assert lab["PYTHONPATH"].split(":")[:2] == [str(env.SITE_DIR), str(env.REPO_ROOT)]
    assert lab[shims.ENV] == "standins,mooncake_cpu,mla_torch_native"
    assert lab["SGLANG_USE_CPU_ENGINE"] == "1"


def test_model_recipes() -> None:
    assert set(models.END_TO_END) == {"llama", "mellum", "deepseek_v2"}
    assert models.MODELS["mellum"].window == 16
    a = models.model_dir("llama", Path("/c"))
    assert a.parent == Path("/c") and a.name.startswith("llama-")
    changed = models.TinyModel("llama", "llama", {"num_hidden_layers": 3, "head_dim": 16})
    assert changed.recipe_hash() != models.MODELS["llama"].recipe_hash()
    assert models.model_dir("llama", Path("/c")) == a  # stable
    with pytest.raises(KeyError, match="unknown tiny SGLang model 'gpt9'"):
        models.model_dir("gpt9")


class _KVArgs:
    """SGLang's KVArgs as far as the ledger reads it: 2 KV buffers, 3 SWA buffers, 2 aux."""

    def __init__(self) -> None:
        self.kv_item_lens = [64, 64]
        self.state_types = [types.SimpleNamespace(value="swa")]
        self.state_item_lens = [[32, 32, 32]]
        self.aux_item_lens = [8, 8]
        self.page_size = 1


class _Manager:
    def __init__(self, args: object, mode: object, *rest: object, **kw: object) -> None:
        self.kv_args = args
        self.is_mla_backend = False

    def get_kv_replica_factor(self) -> int:
        return 1


class _Metric:
    transfer_total_bytes: int | None = None
    transfer_latency_s = None


class _Sender:
    """SGLang's CommonKVSender as far as the ledger touches it."""

    def __init__(self, room: int) -> None:
        self.bootstrap_room = room
        self.kv_mgr = _Manager(_KVArgs(), "prefill")
        self.metric = _Metric()
        self.kv = 0
        self.states = 0

    def _record_transfer_indices(self, kv_indices: list[int], state_indices: list[object]) -> None:
        self.kv += len(kv_indices)
        self.states += sum(len(s) for s in state_indices or () if s is not None)  # type: ignore[arg-type]

    def get_transfer_metric(self) -> _Metric:
        self.metric.transfer_total_bytes = self.kv * 128 + self.states * 96
        return self.metric


class _Stats:
    def compute_and_observe_kv_transfer_metrics(self, metric: _Metric) -> dict[str, float]:
        return {"latency_ms": 2.5}


def test_ledger_splits_sglangs_accounting_per_component(tmp_path: Path) -> None:
    """Counts per component × item bytes summed over buffers; aux once; SGLang's own total
    and latency carried along; a manager's registration recorded with its role."""
    book = tmp_path / "ledger.jsonl"
    conn = types.SimpleNamespace(CommonKVSender=type("S", (_Sender,), {}),
                                 CommonKVManager=type("M", (_Manager,), {}))
    stats = types.SimpleNamespace(SchedulerReqTimeStats=type("T", (_Stats,), {}))
    ledger.install_manager(conn, book)  # type: ignore[arg-type]
    ledger.install_sender(conn)  # type: ignore[arg-type]
    ledger.install_stats(stats, book)  # type: ignore[arg-type]

    conn.CommonKVManager(_KVArgs(), types.SimpleNamespace(value="decode"), None)
    sender = conn.CommonKVSender(7)
    sender._record_transfer_indices(list(range(10)), [None])  # a first chunk
    sender._record_transfer_indices(list(range(5)), [[1, 2, 3]])  # the last, with state
    stats.SchedulerReqTimeStats().compute_and_observe_kv_transfer_metrics(
        sender.get_transfer_metric())

    (reg,) = ledger.registrations(book)
    assert reg.mode == "decode" and reg.state_types == ("swa",)
    assert reg.kv_item_lens == (64, 64) and reg.state_item_lens == ((32, 32, 32),)
    got = ledger.transfers(book)[7]
    assert dict(got.components) == {"kv": 15 * 128, "swa": 3 * 96, "aux": 16}
    assert got.sglang_total_bytes == 15 * 128 + 3 * 96
    assert got.latency_s == 0.0025 and got.sender == "S"
    assert got.lab_latency_s is not None and got.lab_latency_s >= 0
    assert ledger.transfers(tmp_path / "none.jsonl") == {}


def test_demo_fails_on_any_mismatch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from kvhandoff.lab import cli
    from kvhandoff.lab.sglang import demo

    def rows(model: str, backends: list[str], lengths: list[int], **kw: object) -> list[demo.Row]:
        return [demo.Row(model, b, n, {"kv": 10 * n, "aux": 8}, 10 * n, 1.0, 0.5, 2.0, 3.0,
                         exact=(n != 600), trials=3) for b in backends for n in lengths]

    fake = tmp_path / "python"
    fake.touch()
    monkeypatch.setenv("KVHANDOFF_SGLANG_PYTHON", str(fake))
    monkeypatch.setattr(demo, "run_model", rows)
    base = ["demo-sglang", "--work-dir", str(tmp_path), "--json", str(tmp_path / "r.json")]
    assert cli.main([*base, "--tokens", "16,600"]) == 1
    assert "MISMATCH" in capsys.readouterr().out
    assert cli.main([*base, "--tokens", "16", "--backend", "a", "--backend", "b"]) == 0
    out = capsys.readouterr().out
    assert "every row token-exact" in out and " a " in out and " b " in out
    assert len(json.loads((tmp_path / "r.json").read_text())) == 2
