"""The CPU shims the SGLang lab applies inside the processes it launches.

Each shim has a name; ``KVHANDOFF_SGLANG_SHIMS`` (a comma-separated list, set by
:func:`kvhandoff.lab.sglang.env.lab_env`) names the ones a process gets, and the lab's
``sitecustomize`` calls :func:`activate` with it at interpreter start-up, before SGLang
is imported. Patches to SGLang run when their module is first imported
(:func:`~kvhandoff.lab.sglang.hooks.when_imported`), in every SGLang process alike.
Nothing here is installed with kvhandoff: a process the lab did not start gets none.
"""

from __future__ import annotations

import importlib
import os
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvhandoff.lab.sglang import census, ledger, standins
from kvhandoff.lab.sglang.hooks import when_imported

__all__ = ["ENV", "SHIMS", "Shim", "activate", "parse"]

ENV = "KVHANDOFF_SGLANG_SHIMS"
"""The environment variable that names a process's shims."""

SGL_KERNEL_CPU_OPS: tuple[str, ...] = (
    "fused_sigmoid_gating_delta_rule_update_cpu",
    "fused_gdn_gating_cpu",
    "fused_qkvzba_split_reshape_cat_cpu",
)
"""``torch.ops.sgl_kernel`` names SGLang's hybrid-linear attention backend reads when it
is built (``gdn_backend.py``, ``gdn_triton.py``), for Mamba2 models too."""


def _standins() -> None:
    finder = standins.install()

    # transformers decides whether torchvision is installed by find_spec, which the
    # stand-in answers, and then reads its version ("N/A": InvalidVersion) or imports
    # its transforms for image processors. A stand-in is not an installation: report
    # these packages absent to it, so it takes its no-torchvision paths.
    def hide(import_utils: types.ModuleType) -> None:
        real = vars(import_utils)["_is_package_available"]

        def is_package_available(pkg_name: str, return_version: bool = False
                                 ) -> tuple[bool, str | None]:
            if pkg_name in finder.packages:
                return False, ("N/A" if return_version else None)
            return real(pkg_name, return_version)  # type: ignore[no-any-return]

        vars(import_utils)["_is_package_available"] = is_package_available

    when_imported("transformers.utils.import_utils", hide)


def _mooncake_cpu() -> None:
    # MooncakeKVSender advertises host tensor indices, and prefill then builds them with
    # torch.empty(pin_memory=True) and records a torch.cuda.Event (prefill.py:1746):
    # "pin_memory=True requires a CUDA or other accelerator backend" on CPU.
    def patch(conn: types.ModuleType) -> None:
        conn.MooncakeKVSender.supports_host_tensor_indices = False

    when_imported("sglang.srt.disaggregation.mooncake.conn", patch)


def _mla_torch_native() -> None:
    # DeepSeek models pick MHA or MLA per backend name; torch_native has no entry and
    # falls back to triton's rule, which picks MHA for a prefill without prefix: against
    # the latent (MLA) pool that dies in torch_native_backend.py. The absorbed MLA path
    # is the one torch_native implements.
    def patch(handler: types.ModuleType) -> None:
        methods = importlib.import_module(
            "sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods")
        mla_method = methods.AttnForwardMethod.MLA

        def mla(attn: object, forward_batch: object) -> object:
            return mla_method

        handler.AttentionBackendRegistry.register("torch_native", mla)

    when_imported("sglang.srt.models.deepseek_common.attention_backend_handler", patch)


def _sgl_kernel_ops() -> None:
    # Read (not called) when the hybrid-linear backend is built: stand-ins that raise
    # when called, so a Mamba2 engine boots and allocates its pools but cannot run a
    # forward pass silently.
    def patch(torch: types.ModuleType) -> None:
        namespace = torch.ops.sgl_kernel
        for name in SGL_KERNEL_CPU_OPS:
            setattr(namespace, name, standins.StandIn(f"torch.ops.sgl_kernel.{name}"))

    when_imported("torch", patch)


def _fake_cuda_capability() -> None:
    # DeepSeek-V3.2 resolves its DSA backends by asking for the CUDA capability on any
    # platform that is not NPU/XPU (model_hook.py:341); answering Hopper lets it build
    # the DSA pool. Its indexer has no torch path, so a forward still fails.
    def patch(torch: types.ModuleType) -> None:
        def capability(device: object = None) -> tuple[int, int]:
            return (9, 0)

        torch.cuda.get_device_capability = capability

    when_imported("torch", patch)


def _transfer_ledger() -> None:
    path = os.environ.get(ledger.ENV)
    if not path:
        raise ValueError(f"the transfer_ledger shim needs ${ledger.ENV}: the file to append to")
    def patch(conn: types.ModuleType) -> None:
        ledger.install_manager(conn, path)
        ledger.install_sender(conn)

    when_imported("sglang.srt.disaggregation.common.conn", patch)
    when_imported("sglang.srt.observability.req_time_stats",
                  lambda stats: ledger.install_stats(stats, path))


def _flip_transport() -> None:
    from kvhandoff.transport.registry import register_transport

    register_transport("tcp-flip-armed", "kvhandoff.lab.testing.faulty:ArmedSourceFlippingTcp")


def _census() -> None:
    when_imported("sglang.srt.managers.scheduler_components.internal_state", census.install)


@dataclass(frozen=True, slots=True)
class Shim:
    """One named CPU shim: what it is for, and how to apply it in this process."""

    name: str
    purpose: str
    apply: Callable[[], None]


SHIMS: dict[str, Shim] = {s.name: s for s in (
    Shim("standins", "torchvision and sgl_kernel import, and raise when called", _standins),
    Shim("mooncake_cpu", "MooncakeKVSender without pinned host index tensors", _mooncake_cpu),
    Shim("mla_torch_native", "torch_native runs DeepSeek attention as MLA", _mla_torch_native),
    Shim("sgl_kernel_ops", "torch.ops.sgl_kernel names a Mamba2 engine reads at start-up",
         _sgl_kernel_ops),
    Shim("fake_cuda_capability", "torch.cuda reports capability 9.0 (DSA pool boot)",
         _fake_cuda_capability),
    Shim("transfer_ledger", "transfer managers record their buffers and transfers in a file",
         _transfer_ledger),
    Shim("census", "/server_info tells what the scheduler holds (pages, rows, queues)",
         _census),
    Shim("flip_transport", "kvhandoff transport 'tcp-flip-armed' flips a source byte on "
         "the wire while its armed file exists (negative controls)", _flip_transport),
)}
"""Every shim, by name."""


def parse(value: str) -> tuple[str, ...]:
    """The shim names in a ``KVHANDOFF_SGLANG_SHIMS`` value; an unknown one raises
    ``ValueError`` naming it and the known ones."""
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in SHIMS]
    if unknown:
        raise ValueError(f"{ENV}: unknown shim(s) {unknown}; known: {sorted(SHIMS)}")
    return names


def activate(names: Iterable[str] | None = None) -> tuple[str, ...]:
    """Apply the named shims (default: those in ``$KVHANDOFF_SGLANG_SHIMS``) and return
    their names. Call once per process, before SGLang or torch is imported."""
    chosen = parse(os.environ.get(ENV, "")) if names is None else parse(",".join(names))
    for name in chosen:
        SHIMS[name].apply()
    return chosen
