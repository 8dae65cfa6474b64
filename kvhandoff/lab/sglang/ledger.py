"""What SGLang's transfer managers register and send, recorded from inside (lab only).

SGLang reports one figure per finished transfer: ``KVTransferMetric`` from
``sender.get_transfer_metric()``, which the prefill scheduler turns into the
``sglang:kv_transfer_{latency_ms,total_mb,speed_gb_s}`` histograms. Its byte count is
SGLang's own accounting, not a wire measurement: KV pages sent × the per-page bytes of
every KV buffer, plus state indices × the per-slot bytes of every state buffer, times the
MLA replica factor (``CommonKVSender.get_transfer_metric``); the aux row is not counted.
Its latency is the backend's own (first enqueue → Success) where the backend says so
(``reports_transfer_latency``), else the time from the last chunk's enqueue to the poll
that saw Success (Mooncake).

The ``transfer_ledger`` shim (:mod:`.shims`) wraps ``CommonKVManager``,
``CommonKVSender`` (every Common-based backend: Mooncake, NIXL, kvhandoff) and the
scheduler's metric step, and appends JSON lines to ``$KVHANDOFF_SGLANG_LEDGER``:

* a :class:`Registration` when a manager is built: the buffers the pools registered
  (``KVArgs``: KV item sizes, each ``state_types`` entry's, aux), per role;
* a :class:`Transfer` per request prefill sent: the same accounting as SGLang's, split
  by component (``kv``, each state type, ``aux``), next to SGLang's total and the
  latency SGLang reports, keyed by bootstrap room. Because SGLang's latency means
  different things for different backends, the ledger also times every backend the same
  way (``lab_latency_s``): from the moment the scheduler hands the sender the request's
  last chunk to the moment it sees the transfer succeed. A sender that counts its own
  bytes per component (kvhandoff's: ``figures``, its handoff's
  :class:`~kvhandoff.observe.figures.Figures`) has that count recorded beside SGLang's
  (``own_components``), so a test can hold the backend's own accounting to the model's
  sizes too.

A backend's sender may override ``get_transfer_metric`` (kvhandoff's does): the shim
wraps every subclass's own override as the class is defined, so each backend's figure
is recorded, whichever class computes it.
"""

from __future__ import annotations

import json
import os
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ENV", "Registration", "Transfer", "install_manager", "install_sender",
           "install_stats", "registrations", "transfers"]

ENV = "KVHANDOFF_SGLANG_LEDGER"
"""The file SGLang processes append their records to."""


@dataclass(frozen=True, slots=True)
class Registration:
    """The buffers one transfer manager registered (SGLang's ``KVArgs``): bytes per item
    of each KV buffer, of each state component's buffers, of each aux buffer."""

    mode: str
    page_size: int
    is_mla: bool
    kv_item_lens: tuple[int, ...]
    state_types: tuple[str, ...]
    state_item_lens: tuple[tuple[int, ...], ...]
    aux_item_lens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Transfer:
    """One request's transfer as prefill's sender accounted it.

    ``components`` maps ``kv``, each state type (``swa``, ``mamba``, ...) and ``aux`` to
    bytes; ``own_components`` is the backend's own count by its component names, when it
    keeps one (kvhandoff: ``kv``, ``swa``, ..., ``metadata``), else None;
    ``sglang_total_bytes`` and ``latency_s`` are what SGLang reports for the
    transfer (``sglang:kv_transfer_total_mb`` and ``_latency_ms``; ``latency_s`` None
    when SGLang had no figure); ``lab_latency_s`` is the same clock for every backend:
    last chunk handed to the sender → the scheduler saw Success."""

    room: int
    sender: str
    components: Mapping[str, int]
    sglang_total_bytes: int
    latency_s: float | None
    lab_latency_s: float | None
    own_components: Mapping[str, int] | None = None


def _append(path: str | os.PathLike[str], record: Mapping[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:  # one write per line: O_APPEND
        f.write(json.dumps(record) + "\n")


def _name(state_type: object) -> str:
    return str(getattr(state_type, "value", state_type))


def install_manager(conn: types.ModuleType, path: str | os.PathLike[str]) -> None:
    """Wrap ``conn.CommonKVManager.__init__`` (``sglang.srt.disaggregation.common.conn``)
    to append a :class:`Registration` of every manager built."""
    cls = conn.CommonKVManager
    init = cls.__init__

    def manager_init(self: Any, args: Any, disaggregation_mode: Any, *rest: Any,
                     **kwargs: Any) -> None:
        init(self, args, disaggregation_mode, *rest, **kwargs)
        _append(path, {
            "event": "register", "mode": _name(disaggregation_mode),
            "page_size": int(args.page_size), "is_mla": bool(self.is_mla_backend),
            "kv_item_lens": [int(x) for x in args.kv_item_lens],
            "state_types": [_name(t) for t in args.state_types],
            "state_item_lens": [[int(x) for x in c] for c in args.state_item_lens],
            "aux_item_lens": [int(x) for x in args.aux_item_lens]})

    cls.__init__ = manager_init


def _components(sender: Any, counts: Mapping[str, int]) -> dict[str, int]:
    """Bytes per component, with SGLang's accounting (item bytes summed over buffers)."""
    args = sender.kv_mgr.kv_args
    factor = int(sender.kv_mgr.get_kv_replica_factor())
    out = {"kv": counts.get("kv", 0) * sum(args.kv_item_lens) * factor}
    for i, (kind, lens) in enumerate(zip(args.state_types, args.state_item_lens, strict=True)):
        out[_name(kind)] = out.get(_name(kind), 0) + counts.get(f"state{i}", 0) * sum(lens) * factor
    out["aux"] = sum(args.aux_item_lens)
    return out


_pending: dict[int, dict[str, Any]] = {}
"""Records the sender built, waiting for the scheduler's figures, by id of the metric."""


def _own_components(sender: Any) -> dict[str, int] | None:
    """The sender's own bytes per component, if it keeps a count (kvhandoff's sender
    exposes its handoff's figures; SGLang's own senders have no such attribute)."""
    figures = getattr(sender, "figures", None)  # any backend's sender: duck-typed
    counted = getattr(figures, "component_bytes", None)
    return None if counted is None else {str(k): int(v) for k, v in counted.items()}


def _recording(metric: Any) -> Any:
    """``get_transfer_metric`` that also prepares the request's :class:`Transfer`."""
    def get_transfer_metric(self: Any) -> Any:
        out = metric(self)
        _pending[id(out)] = {
            "event": "transfer", "room": int(self.bootstrap_room),
            "sender": type(self).__name__,
            "components": _components(self, self.__dict__.get("_kvh_ledger_counts", {})),
            "own_components": _own_components(self),
            "sglang_total_bytes": int(out.transfer_total_bytes or 0),
            "last_send": self.__dict__.get("_kvh_ledger_last_send")}
        return out

    return get_transfer_metric


def install_sender(conn: types.ModuleType) -> None:
    """Wrap ``conn.CommonKVSender`` so that it counts indices per component and, when
    SGLang asks for its metric, prepares the request's :class:`Transfer`; a subclass
    defined later that overrides ``get_transfer_metric`` gets its override wrapped."""
    cls = conn.CommonKVSender
    record = cls._record_transfer_indices

    def record_indices(self: Any, kv_indices: Any, state_indices: Any) -> None:
        self._kvh_ledger_last_send = time.perf_counter()  # CommonKVSender.send calls us
        record(self, kv_indices, state_indices)
        counts = self.__dict__.setdefault("_kvh_ledger_counts", {})
        counts["kv"] = counts.get("kv", 0) + len(kv_indices)
        for i, indices in enumerate(state_indices or ()):
            if indices is not None:
                counts[f"state{i}"] = counts.get(f"state{i}", 0) + len(indices)

    def init_subclass(sub: type, /, **kwargs: Any) -> None:
        super(cls, sub).__init_subclass__(**kwargs)
        own = sub.__dict__.get("get_transfer_metric")
        if own is not None:
            sub.get_transfer_metric = _recording(own)  # type: ignore[attr-defined]

    cls._record_transfer_indices = record_indices
    cls.get_transfer_metric = _recording(cls.get_transfer_metric)
    cls.__init_subclass__ = classmethod(init_subclass)


def install_stats(stats: types.ModuleType, path: str | os.PathLike[str]) -> None:
    """Wrap ``stats.SchedulerReqTimeStats.compute_and_observe_kv_transfer_metrics``
    (``sglang.srt.observability.req_time_stats``), where the prefill scheduler turns a
    sender's metric into SGLang's reported latency, so that the prepared record gets that
    latency and is appended to ``path``."""
    cls = stats.SchedulerReqTimeStats
    compute = cls.compute_and_observe_kv_transfer_metrics

    def compute_and_observe(self: Any, transfer_metric: Any) -> Any:
        done = time.perf_counter()  # the inflight queue's poll has just seen Success
        result = compute(self, transfer_metric)
        line = _pending.pop(id(transfer_metric), None)
        if line is not None:
            last_send = line.pop("last_send")
            line["lab_latency_s"] = None if last_send is None else done - last_send
            latency_ms = (result or {}).get("latency_ms")
            line["latency_s"] = None if latency_ms is None else float(latency_ms) / 1e3
            _append(path, line)
        return result

    cls.compute_and_observe_kv_transfer_metrics = compute_and_observe


def _records(path: str | os.PathLike[str], event: str) -> list[dict[str, Any]]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r for r in rows if r.get("event") == event]


def transfers(path: str | os.PathLike[str]) -> dict[int, Transfer]:
    """The transfers in a ledger file by room (the last one wins); {} if none."""
    return {int(d["room"]): Transfer(
        room=int(d["room"]), sender=str(d["sender"]),
        components={k: int(v) for k, v in d["components"].items()},
        sglang_total_bytes=int(d["sglang_total_bytes"]), latency_s=d["latency_s"],
        lab_latency_s=d["lab_latency_s"],
        own_components=None if d.get("own_components") is None
        else {k: int(v) for k, v in d["own_components"].items()})
        for d in _records(path, "transfer")}


def registrations(path: str | os.PathLike[str]) -> list[Registration]:
    """The registrations in a ledger file, in the order they were written."""
    return [Registration(
        mode=str(d["mode"]), page_size=int(d["page_size"]), is_mla=bool(d["is_mla"]),
        kv_item_lens=tuple(d["kv_item_lens"]), state_types=tuple(d["state_types"]),
        state_item_lens=tuple(tuple(c) for c in d["state_item_lens"]),
        aux_item_lens=tuple(d["aux_item_lens"])) for d in _records(path, "register")]
