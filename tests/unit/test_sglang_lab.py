"""The SGLang lab's pure pieces, without SGLang: stand-ins that raise when called, the
post-import hooks, the shim list, the environment a lab process gets, model recipes.

The stand-ins are checked in fresh interpreters started the way the lab starts SGLang
(its ``sitecustomize`` on ``PYTHONPATH``), so what is proven is what servers get.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvhandoff.lab.sglang import env, hooks, models, shims, standins


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
