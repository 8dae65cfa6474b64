"""Tiny random-weight checkpoints that SGLang 0.5.23 serves on a CPU host (lab only).

Each :class:`TinyModel` is a recipe: a ``transformers`` model type and config, a seed,
the ``config.json`` fixes SGLang needs where transformers 5.19 and SGLang 0.5.23 name
things differently (``shared/reference/sglang_backend.md`` §7), and what a server needs
to run it here (lab shims, server arguments). :func:`build` writes the checkpoint
(safetensors + config, no tokenizer: servers run with ``--skip-tokenizer-init`` and take
``input_ids``) into a cache directory named by a hash of the recipe, so a changed recipe
is a new directory and an unchanged one is built once. Same recipe, same bytes.

Building needs torch and transformers: run it in the SGLang venv,
``python -m kvhandoff.lab.sglang.models build llama`` (prints the directory);
:func:`ensure` does that from any interpreter. The recipes themselves import nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["END_TO_END", "MODELS", "RECIPE_VERSION", "TinyModel", "build", "cache_root",
           "ensure", "model_dir"]

RECIPE_VERSION = 1
"""Bump when :func:`build` itself changes what it writes."""

VOCAB = 512

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}

# get_rope_cpu accepts only deepseek_yarn (rotary_embedding/factory.py), which SGLang's
# DeepSeek attention makes of any non-default rope (deepseek_v2.py:2066); factor 1 keeps
# it the plain rope the real V2-Lite scales.
_YARN = {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
         "rope_theta": 10000.0}

_MLA = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
        "num_key_value_heads": 4, "first_k_dense_replace": 2, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "rope_parameters": _YARN}
"""DeepSeek MLA sizes shared by V2 and V3.2 (dense layers only: first_k_dense_replace)."""


@dataclass(frozen=True, slots=True)
class TinyModel:
    """One tiny checkpoint recipe and what serving it on this CPU takes.

    ``config`` goes to ``AutoConfig.for_model(model_type, ...)`` on top of the common
    sizes; ``fixes`` are then written into ``config.json`` as they are (keys SGLang reads
    that transformers does not write). ``shims`` are lab shims every server of this
    model needs (:mod:`kvhandoff.lab.sglang.shims`), ``server_args`` extra
    ``launch_server`` flags. ``forward`` says whether SGLang can run it on CPU (else it
    only boots and registers its pools). ``window`` is the sliding window, if any.
    """

    name: str
    model_type: str
    config: Mapping[str, Any]
    fixes: Mapping[str, Any] = field(default_factory=dict)
    shims: tuple[str, ...] = ()
    server_args: tuple[str, ...] = ()
    forward: bool = True
    window: int | None = None
    seed: int = 0

    @property
    def sizes(self) -> dict[str, Any]:
        """The config the checkpoint is built from: the common sizes, then ``config``."""
        return {**_COMMON, **self.config}

    def recipe_hash(self) -> str:
        """A short digest of everything that decides the checkpoint's bytes."""
        recipe = {"v": RECIPE_VERSION, "type": self.model_type, "common": _COMMON,
                  "config": self.config, "fixes": self.fixes, "seed": self.seed}
        return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


MODELS: dict[str, TinyModel] = {m.name: m for m in (
    # Plain MHA KV pool (GQA: 4 query heads, 2 KV heads of 16).
    TinyModel("llama", "llama", {"num_hidden_layers": 2, "head_dim": 16}),
    # SGLang's hybrid SWA pool: 3 sliding-window layers (16 tokens) and 1 full one; the
    # one family on this CPU whose SWA layers get their own pool (StateType swa).
    TinyModel("mellum", "mellum", {
        "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 16,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "mlp_layer_types": ["dense"] * 4}, window=16),
    # DeepSeek-V2-Lite-style MLA: one latent buffer per layer (kv_lora 32 + rope 16).
    TinyModel("deepseek_v2", "deepseek_v2",
              {**_MLA, "num_hidden_layers": 2, "q_lora_rank": None},
              fixes={"moe_layer_freq": 1},  # read by deepseek_v2.py:2791, not written
              shims=("mla_torch_native",)),
    # Mamba2 + attention (NemotronH "M-*-"): boots with a Mamba pool, no CPU forward.
    TinyModel("nemotron_h", "nemotron_h", {
        "num_hidden_layers": 4, "hybrid_override_pattern": "M-*-", "head_dim": 16,
        "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 16,
        "conv_kernel": 4, "expand": 1, "chunk_size": 16},
        fixes={"layers_block_type": ["mamba", "mlp", "attention", "mlp"], "mamba_n_groups": 1},
        shims=("sgl_kernel_ops",),
        # extra_buffer (the default) needs a GPU platform, and no_buffer refuses the
        # overlap scheduler; unbounded, the Mamba pool sizes itself to ~7 GB of RAM
        server_args=("--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule",
                     "--max-mamba-cache-size", "64", "--max-running-requests", "16"),
        forward=False),
    # DeepSeek-V3.2 sparse attention (DSA indexer pool): boots with a faked CUDA
    # capability, its indexer has no torch path.
    TinyModel("deepseek_v32", "deepseek_v32",
              {**_MLA, "num_hidden_layers": 2, "q_lora_rank": 32, "index_head_dim": 128,
               "index_n_heads": 4, "index_topk": 64},
              fixes={"moe_layer_freq": 1},  # index_head_dim 128: memory_pool.py asserts it
              shims=("mla_torch_native", "fake_cuda_capability"), forward=False),
)}
"""Every tiny model, by name."""

END_TO_END: tuple[str, ...] = tuple(n for n, m in MODELS.items() if m.forward)
"""The models SGLang can generate with on this CPU."""


def cache_root() -> Path:
    """Where built checkpoints live: ``$KVHANDOFF_SGLANG_MODELS``, else
    ``$XDG_CACHE_HOME/kvhandoff/sglang-models`` (``~/.cache`` by default)."""
    env = os.environ.get("KVHANDOFF_SGLANG_MODELS")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvhandoff" / "sglang-models"


def model_dir(name: str, root: Path | None = None) -> Path:
    """The directory ``name``'s current recipe is (or will be) built in."""
    model = _get(name)
    return (root or cache_root()) / f"{name}-{model.recipe_hash()}"


def _get(name: str) -> TinyModel:
    if name not in MODELS:
        raise KeyError(f"unknown tiny SGLang model {name!r}: not one of {sorted(MODELS)}")
    return MODELS[name]


def build(name: str, root: Path | None = None) -> Path:
    """Build ``name``'s checkpoint unless its directory exists, and return the directory.
    Needs torch and transformers. Written into a temporary sibling and renamed, so a
    crash never leaves a half-written checkpoint where a server would load it, and two
    processes building the same recipe at once both end with the one directory."""
    out = model_dir(name, root)
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model = _get(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        cfg = AutoConfig.for_model(model.model_type, **{**_COMMON, **model.config})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(model.seed)
            net = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
        net = net.to(torch.bfloat16)
        net.config.dtype = torch.bfloat16
        net.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        config.update(model.fixes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        with contextlib.suppress(FileNotFoundError):
            (tmp / "generation_config.json").unlink()  # SGLang would read sampling defaults
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "config.json").exists():
                raise
            shutil.rmtree(tmp)  # another process built the same recipe meanwhile: same bytes
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def ensure(name: str, python: str | os.PathLike[str], *, root: Path | None = None,
           timeout: float = 600.0) -> Path:
    """Build ``name`` with ``python`` (an interpreter with torch and transformers, e.g.
    the SGLang venv's) unless it is cached; return the directory."""
    out = model_dir(name, root)
    if (out / "config.json").exists():
        return out
    cmd = [str(python), "-m", "kvhandoff.lab.sglang.models", "build", name]
    if root is not None:
        cmd += ["--root", str(root)]
    from kvhandoff.lab.sglang.env import lab_env

    done = subprocess.run(cmd, env=lab_env(), capture_output=True, text=True, timeout=timeout,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"building tiny model {name!r} failed ({done.returncode}):\n"
                           f"{done.stderr[-4000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvhandoff.lab.sglang.models",
                                 description="Build tiny random-weight checkpoints for SGLang.")
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build (or find) a checkpoint; prints its directory")
    b.add_argument("name", choices=sorted(MODELS))
    b.add_argument("--root", type=Path, default=None, help="cache directory")
    args = ap.parse_args(argv)
    print(build(args.name, args.root))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
