"""A :class:`~kvhandoff.integrations.HandoffHook` that appends what a handoff moved to a
file, for the vLLM tests and demo to compare prefill's bytes with decode's.

Load it into the connector with ``kv_connector_extra_config`` keys
``"hook": "kvhandoff.lab.testing.vllm_dump:DumpHook"`` and ``"hook_config": {"path":
FILE}`` on both servers. Each line is JSON:

* per handoff and component, a digest of its moved blocks (``side``, ``request``,
  ``component``, ``blocks``, ``bytes``, ``sha256``): prefill's when it sends, decode's when
  it landed;
* per successful handoff, its phases in milliseconds (``timing``; ``handoff`` for the
  whole of it), from the handoff's figures.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvhandoff.integrations import Figures
from kvhandoff.layout import Layout, MemoryKind
from kvhandoff.memory import raw_view


class DumpHook:
    """Appends digest and timing lines to ``config["path"]`` (see the module docstring)."""

    def __init__(self, config: Mapping[str, object]) -> None:
        path = config.get("path")
        if not isinstance(path, str) or not path:
            raise ValueError(f"DumpHook needs hook_config.path, got {path!r}")
        self.path = Path(path)

    def sending(self, request_id: str, layout: Layout, lists: Mapping[str, Sequence[int]]
                ) -> None:
        self._digests("prefill", request_id, layout, lists)

    def landed(self, request_id: str, layout: Layout, lists: Mapping[str, Sequence[int]]
               ) -> None:
        self._digests("decode", request_id, layout, lists)

    def finished(self, request_id: str, figures: Figures) -> None:
        if not figures.success:
            return
        ms = {p: 1e3 * s for p, s in figures.phases.items()}
        whole = None if figures.seconds is None else 1e3 * figures.seconds
        self._append([{"side": figures.role, "request": request_id,
                       "timing": {**ms, "handoff": whole}}])

    def _digests(self, side: str, rid: str, layout: Layout,
                 lists: Mapping[str, Sequence[int]]) -> None:
        self._append([
            {"side": side, "request": rid, "component": name, "blocks": len(blocks),
             "bytes": len(data), "sha256": hashlib.sha256(data.tobytes()).hexdigest()}
            for name, blocks in lists.items()
            for data in (block_bytes(layout, name, list(blocks)),)])

    def _append(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            with self.path.open("a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))


def block_bytes(layout: Layout, name: str, blocks: list[int]) -> np.ndarray[Any, Any]:
    """``blocks`` of every tensor of component ``name``, concatenated (for comparisons);
    blocks in GPU memory are copied to the host first."""
    c = layout.component(name)
    parts = [_read(t.ptr + b * t.item_stride, t.item_bytes, t.memory, t.device)
             for t in c.tensors for b in blocks]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def _read(ptr: int, nbytes: int, memory: MemoryKind, device: int) -> np.ndarray[Any, Any]:
    """A copy of ``nbytes`` at ``ptr`` (a host view when the memory is the host's)."""
    if memory is MemoryKind.HOST:
        return raw_view(ptr, nbytes)
    import torch

    ref = SimpleNamespace(__cuda_array_interface__={  # how torch reads a device pointer
        "shape": (nbytes,), "typestr": "|u1", "data": (ptr, True), "version": 3})
    return torch.as_tensor(ref, device=f"cuda:{device}").cpu().numpy()
