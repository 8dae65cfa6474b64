"""What an SGLang rank registered, read once: its ``KVArgs`` (an attribute bag the
scheduler fills; some fields are absent on one role or in one release) and the facts
``KVArgs`` leave out, from the model SGLang serves (KV heads on decode, a Mamba2 conv's
groups, the identity both sides must share). Imports SGLang only inside functions that
need a published process (:func:`model_heads`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvhandoff.integrations.sglang.layout import Mamba2Dims, Registered, StateEntry
from kvhandoff.sharding import mamba2_groups, mamba2_state

__all__ = ["Heads", "model_facts", "model_heads", "registered"]


def registered(args: Any, *, is_mla: bool = False, heads: Heads | None = None
               ) -> Registered:
    """``args`` read once (SGLang's attribute bag; optional fields may be absent; decode
    fills no head counts: ``heads`` then says them)."""
    h = heads or Heads()
    states = tuple(
        StateEntry(type=str(getattr(t, "value", t)), ptrs=tuple(p), lens=tuple(n),
                   item_lens=tuple(i), layer_ids=tuple(_at(args.state_layer_ids, k)),
                   dims=tuple(_at(getattr(args, "state_dim_per_tensor", []), k)),
                   outer=tuple(_at(getattr(args, "state_slice_outer_counts", []), k)),
                   conv_groups=tuple(None if g is None else tuple(g) for g in
                                     _at(getattr(args, "state_conv_shard_groups", []), k)))
        for k, (t, p, n, i) in enumerate(zip(args.state_types, args.state_data_ptrs,
                                             args.state_data_lens, args.state_item_lens,
                                             strict=True)))
    return Registered(
        kv_ptrs=tuple(args.kv_data_ptrs), kv_lens=tuple(args.kv_data_lens),
        kv_item_lens=tuple(args.kv_item_lens), kv_layer_ids=tuple(args.kv_layer_ids or ()),
        num_draft_entries=int(getattr(args, "num_draft_entries", 0) or 0),
        page_size=int(args.page_size),
        kv_head_num=int(getattr(args, "kv_head_num", 0) or 0) or h.local,
        total_kv_head_num=int(getattr(args, "total_kv_head_num", 0) or 0) or h.total,
        swa_head_num=h.swa_local, total_swa_head_num=h.swa_total,
        start_layer=int(getattr(args, "prefill_start_layer", 0) or 0),
        aux_ptrs=tuple(args.aux_data_ptrs), aux_lens=tuple(args.aux_data_lens),
        aux_item_lens=tuple(args.aux_item_lens), states=states,
        kv_cache_dtype=str(args.kv_cache_dtype_str), is_mla=is_mla,
        compression_ratios=tuple(getattr(args, "mla_compression_ratios", None) or ()))


@dataclass(frozen=True, slots=True)
class Heads:
    """KV heads, this rank's and the model's (and the sliding-window pool's)."""

    local: int = 0
    total: int = 0
    swa_local: int = 0
    swa_total: int = 0


def model_heads(attn_tp_size: int) -> Heads:
    """The KV heads of the model this process serves, as SGLang sizes its pools: decode's
    ``KVArgs`` carry none."""
    from sglang.srt.runtime_context import process_model_config

    mc = process_model_config()
    total = int(mc.get_total_num_kv_heads())
    swa_total = int(getattr(mc.hf_text_config, "swa_num_key_value_heads", 0) or total)
    return Heads(local=int(mc.get_num_kv_heads(attn_tp_size)), total=total,
                 swa_local=int(mc.get_swa_num_kv_heads(attn_tp_size)), swa_total=swa_total)


def _at(lists: list[list[Any]], k: int) -> list[Any]:
    return list(lists[k]) if k < len(lists) and lists[k] is not None else []


def model_facts(server_args: Any) -> tuple[Mamba2Dims | None, tuple[str, str]]:
    """From the model's ``config.json`` (a local checkpoint): its Mamba2 conv groups, if
    any, and the identity both sides must share; else only the model path."""
    path = Path(str(server_args.model_path)) / "config.json"
    try:
        raw = path.read_bytes()
        cfg = json.loads(raw)
    except (OSError, ValueError):
        return None, ("model", str(server_args.model_path))
    groups, state = mamba2_groups(cfg), mamba2_state(cfg)
    dims = Mamba2Dims(n_groups=groups, state=state) if groups and state else None
    arch = ",".join(cfg.get("architectures") or []) or str(cfg.get("model_type"))
    return dims, ("model config", f"{arch} {hashlib.sha256(raw).hexdigest()[:12]}")
