"""``KvhandoffConnector``: kvhandoff as a vLLM (0.32) KV connector. Imports vLLM.

vLLM builds the connector twice: in the scheduler process (``role=SCHEDULER``, backed by
:class:`~kvhandoff.integrations.vllm.scheduler.SchedulerSide`) and in each worker
(``role=WORKER``, backed by :class:`~kvhandoff.integrations.vllm.worker.WorkerSide` once
vLLM registered its KV caches). Load it with::

    --kv-transfer-config '{"kv_connector": "KvhandoffConnector",
                           "kv_connector_module_path": "kvhandoff.integrations.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"bootstrap": "10.0.0.3:8998"}}'

``kv_connector_extra_config`` keys: ``bootstrap`` (required: ``host:port`` of a running
``kvhandoff bootstrap``), ``transport`` (``auto`` default: per peer, ``cma`` on this
host, tcp or RDMA across; or name one: ``cma``, ``tcp``, ``shm``, ``mooncake``, ``nixl``),
``instance`` (the prefill deployment's name, default ``default``), ``host`` (control
socket bind address), ``aux_rows`` (handoffs in flight per worker, default 1024),
``host_staging``, ``staging_path`` and ``gpu_direct`` (see below), ``hook`` and
``hook_config`` (a test rig's :class:`~kvhandoff.integrations.HandoffHook`:
``"module:factory"``, called with the ``hook_config`` mapping), and any other
:class:`~kvhandoff.session.config.SessionConfig` field (e.g. ``transfer_timeout``).

GPU memory: with vLLM's KV cache on CUDA, the worker keeps a host mirror and copies each
request's blocks through it
(:class:`~kvhandoff.integrations.vllm.host_staging.HostStaging`), over every transport:
that path is the one tested on a GPU (an H100, ``make gpu-check``). ``gpu_direct: true``
asks nixl or mooncake to register the device memory itself instead. It stays opt-in:
on the H100 NIXL moved GPU → GPU between processes byte-exact, but host → GPU made no
progress as kvhandoff drives it (no target progress), and torch's device copies failed
in a process whose NIXL agent had loaded UCX's CUDA modules (README, "GPU memory").
``host_staging: true`` forces the mirror for CPU tensors too (how the path is tested
without a GPU). ``staging_path`` picks how a mirror's copies run: ``blocks`` (default, one
copy per run of blocks), ``packed`` (one device gather, one contiguous copy, one host
placement per layer) or ``mapped`` (the GPU reads and writes the pinned mirror itself;
tcp and cma only); the last two have not yet run on a GPU (docs/gpu.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvhandoff.integrations import (
    AuxPool,
    HandoffHook,
    SessionConfig,
    bootstrap_url,
    load_hook,
)
from kvhandoff.integrations.vllm.host_staging import (
    flag,
    kv_memory,
    staging_path_option,
    tensor_info,
)
from kvhandoff.integrations.vllm.layout import (
    GroupInfo,
    MambaInfo,
    build_layout,
    component_name,
)
from kvhandoff.integrations.vllm.metrics import KvhandoffPromMetrics, KvhandoffStats
from kvhandoff.integrations.vllm.requests import StepMeta, backoff, rules_for
from kvhandoff.integrations.vllm.scheduler import SchedulerConfig, SchedulerSide
from kvhandoff.integrations.vllm.worker import AUX_NAME, WorkerSide
from kvhandoff.layout import Region
from kvhandoff.sharding import mamba2_groups

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvhandoff.integrations.vllm")

_OWN_KEYS = {"bootstrap", "aux_rows", "host_staging", "staging_path", "gpu_direct", "hook",
             "hook_config"}


class KvhandoffMetadata(KVConnectorMetadata):  # type: ignore[misc]
    def __init__(self, step: StepMeta) -> None:
        self.step = step


def _kind(spec: object) -> str:
    if isinstance(spec, MambaSpec):
        return "mamba"
    if isinstance(spec, SlidingWindowSpec):
        return "sliding"
    if isinstance(spec, MLAAttentionSpec):
        return "mla"
    if isinstance(spec, FullAttentionSpec):
        return "full"
    return type(spec).__name__


class KvhandoffConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """See the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        ktc = vllm_config.kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        if not extra.get("bootstrap"):
            raise ValueError("KvhandoffConnector needs kv_connector_extra_config.bootstrap: "
                             "host:port of a running `kvhandoff bootstrap`")
        if not (ktc.is_kv_producer or ktc.is_kv_consumer) or (
                ktc.is_kv_producer and ktc.is_kv_consumer):
            raise ValueError(f"KvhandoffConnector needs kv_role kv_producer (prefill) or "
                             f"kv_consumer (decode), got {ktc.kv_role!r}")
        self.producer = bool(ktc.is_kv_producer)
        self.bootstrap = bootstrap_url(str(extra["bootstrap"]))
        self.session = SessionConfig.from_env(
            **{k: v for k, v in extra.items() if k not in _OWN_KEYS})
        ids = tuple(kv_cache_config.transfer_group_ids)
        tp = vllm_config.parallel_config.tensor_parallel_size
        heads = vllm_config.model_config.get_total_num_kv_heads()
        hf = vllm_config.model_config.hf_config
        self.groups = tuple(
            GroupInfo(index=i, kind=_kind(kv_cache_config.kv_cache_groups[i].kv_cache_spec),
                      spec=type(kv_cache_config.kv_cache_groups[i].kv_cache_spec).__name__,
                      block_size=kv_cache_config.kv_cache_groups[i].kv_cache_spec.block_size,
                      layer_names=tuple(kv_cache_config.kv_cache_groups[i].layer_names),
                      total_heads=heads,
                      mamba=_mamba(kv_cache_config.kv_cache_groups[i].kv_cache_spec, hf))
            for i in ids)
        self.identity = _identity(vllm_config, self.groups, tp)
        self._aux_rows = int(extra.get("aux_rows", 1024))
        self._host_staging = flag(extra, "host_staging")
        self._gpu_direct = flag(extra, "gpu_direct")
        self._staging_path = staging_path_option(extra)
        self._extra = extra
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            specs = [kv_cache_config.kv_cache_groups[i].kv_cache_spec for i in ids]
            self._sched = SchedulerSide(SchedulerConfig(
                producer=self.producer, bootstrap=self.bootstrap, instance=self.session.instance,
                rules=rules_for(self.groups,
                                [getattr(s, "sliding_window", 0) or 0
                                 if isinstance(s, SlidingWindowSpec) else 0 for s in specs],
                                [s.num_speculative_blocks if isinstance(s, MambaSpec) else 0
                                 for s in specs]),
                transfer_groups=ids,
                backoff=backoff(has_mamba=any(isinstance(s, MambaSpec) for s in specs),
                                lookahead=int(getattr(vllm_config, "num_prefill_lookahead_tokens",
                                                      0) or 0))))

    # --- worker role -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp = self._vllm_config.parallel_config.tensor_parallel_size
        rank = get_tensor_model_parallel_rank() if tp > 1 else 0
        mem = kv_memory(kv_caches, [g.layer_names for g in self.groups], self.session,
                        producer=self.producer, host_staging=self._host_staging,
                        gpu_direct=self._gpu_direct, staging_path=self._staging_path)
        if mem.staging is not None:
            log.info("kvhandoff: vLLM's KV cache goes through a %s host mirror of %d B "
                     "(%s copies)", "pinned" if mem.staging.pinned else "pageable",
                     mem.staging.nbytes, mem.staging.path.value)
        try:
            rows = AuxPool(self._aux_rows, allocate=mem.allocate, name=AUX_NAME)
            aux = rows.component.tensors[0]
            layout = build_layout(
                self.groups, {name: tensor_info(t) for name, t in mem.tensors.items()},
                tp_rank=rank, tp_size=tp, extra=(rows.component,),
                extra_regions=(Region(ptr=aux.ptr, nbytes=aux.nbytes),), identity=self.identity,
                model=str(self._vllm_config.model_config.architecture))
            kv = next((component_name(g) for g in self.groups if g.kind in ("full", "mla")),
                      None)
            self._worker = WorkerSide(layout, rows, producer=self.producer,
                                      bootstrap=self.bootstrap, config=mem.config, kv_name=kv,
                                      staging=mem.staging, transport=mem.transport,
                                      hook=self._hook())
        except BaseException:
            mem.close()
            raise
        log.info("kvhandoff %s worker tp %d/%d ready: %s", "prefill" if self.producer
                 else "decode", rank, tp, layout.describe())

    def _hook(self) -> HandoffHook | None:
        spec = self._extra.get("hook")
        options = self._extra.get("hook_config") or {}
        if not isinstance(options, dict):
            raise ValueError(f"kv_connector_extra_config.hook_config must be a mapping, got "
                             f"{options!r}")
        return load_hook(str(spec), options) if spec else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KvhandoffMetadata)
            self._worker.start(meta.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        sending, recving, failed = self._worker.finished()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """For callers of the older API; vLLM 0.32 calls :meth:`get_transfer_results`."""
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_kv_connector_stats(self) -> KvhandoffStats | None:
        if self._worker is None or self._worker.stats.empty():
            return None
        return KvhandoffStats(data=self._worker.stats.take())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvhandoffStats:
        return KvhandoffStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KvhandoffPromMetrics:
        return KvhandoffPromMetrics(vllm_config, metric_types, labelnames,
                                    per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    # --- scheduler role --------------------------------------------------------------

    def _s(self) -> SchedulerSide:
        assert self._sched is not None, "a scheduler call on a worker-role connector"
        return self._sched

    def on_new_request(self, request: Request) -> None:
        self._s().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KvhandoffMetadata(self._s().build_meta())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._s().update_finished(connector_output.finished_sending,
                                  connector_output.finished_recving)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, [block_ids])

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.pending_push


_MAMBA_KINDS = {"MAMBA1": "mamba1", "MAMBA2": "mamba2", "GDN_ATTN": "gdn"}


def _log_through_vllm() -> None:
    """Show the library's own lines (which transport ``auto`` picked for a peer and why,
    a lease that ran out, a peer dropped) in vLLM's log: vLLM configures only its
    ``vllm`` logger, so they would otherwise go nowhere. The ``kvhandoff`` logger gets
    vLLM's handlers at INFO, once per process, unless a deployment configured it
    already (it has handlers) or vLLM's logging is off (no handlers to share)."""
    lib, vllm_log = logging.getLogger("kvhandoff"), logging.getLogger("vllm")
    if lib.handlers or not vllm_log.handlers:
        return
    for h in vllm_log.handlers:
        lib.addHandler(h)
    if lib.level == logging.NOTSET:
        lib.setLevel(logging.INFO)
    lib.propagate = False  # the root's handlers, if any, would print each line twice


def _mamba(spec: object, hf: Any) -> MambaInfo | None:
    """What the layout needs of a MambaSpec: its states' local shapes and element sizes,
    the conv layout, and the model's Mamba2 group count (which the spec leaves out)."""
    if not isinstance(spec, MambaSpec):
        return None
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    name = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    groups = mamba2_groups(hf) or 0
    return MambaInfo(kind=_MAMBA_KINDS.get(name, name.lower()),
                     shapes=tuple(tuple(int(d) for d in s) for s in spec.shapes),
                     itemsizes=tuple(torch.empty(0, dtype=d).element_size()
                                     for d in spec.dtypes),
                     conv_dim_first=bool(is_conv_state_dim_first()), n_groups=groups,
                     replicated=bool(getattr(spec, "tp_replicated", False)))


def _identity(cfg: VllmConfig, groups: tuple[GroupInfo, ...], tp: int
              ) -> tuple[tuple[str, str], ...]:
    """What prefill and decode must share beyond shapes; the handshake names each field
    that differs with both values."""
    mc = cfg.model_config
    hf = json.dumps(mc.hf_config.to_diff_dict(), sort_keys=True, default=str)
    return (
        ("model config", f"{mc.architecture} {hashlib.sha256(hf.encode()).hexdigest()[:12]}"),
        ("dtype", str(mc.dtype).removeprefix("torch.")),
        ("kv_cache_dtype", str(cfg.cache_config.cache_dtype)),
        ("block_size", ",".join(f"{g.kind}:{g.block_size}" for g in groups)),
        ("kv cache groups", ",".join(f"{g.index}:{g.spec}:{len(g.layer_names)}"
                                     for g in groups)),
    )
