"""Pinned host staging: vLLM's KV cache in GPU memory over transports that move host
memory only (tcp, shm). Torch, no vLLM.

:class:`HostStaging` keeps a host mirror of the tensors vLLM registered — pinned where
CUDA is, so the copies run at full PCIe speed — and kvhandoff registers the *mirror*.
Only the blocks a request moves are copied:

* prefill: device → host for the request's block ids of each group, before its send
  starts; the copy is synchronised, so the transport never reads a half-copied block;
* decode: host → device for the received block ids, once the receive succeeded and
  before vLLM hears the request finished.

vLLM's layer tensors are views into shared allocations: a hybrid model overlays its
attention pages and its Mamba/GDN raw pages on one pool, and vLLM may give several
layers one buffer. The mirror copies each *storage* once (same bytes) and derives each
layer's mirror view with the very offset, shape and strides of the device view, so the
layout built from the mirrors (base pointer, item stride, page padding) is the device
layout shifted to host memory. Copies go through those views along the block dimension,
so a block moves exactly the bytes its view covers in that group (K and V halves, the
useful part of a padded Mamba page), and no other block is touched.

:func:`kv_memory` decides, per worker, what kvhandoff registers: vLLM's tensors, the
same as device memory (nixl, mooncake), or a mirror. A decode worker on a transport
whose destinations must come from its own ``allocate`` (shm) always uses a mirror
allocated there, since vLLM's tensors never are.

The CUDA path (pinning, the device copies, the stream synchronisation) runs on a GPU in
``make gpu-check`` (tested on an H100: staged tcp, shm and nixl handoffs byte-exact in
decode's GPU memory); ``host_staging`` runs the same code on CPU tensors everywhere else.
A GPU cache takes the mirror over every transport unless ``gpu_direct`` asks nixl or
mooncake to register device memory themselves. The mirror is page-locked by torch (tcp)
or with ``cudaHostRegister`` (shm's arenas); for nixl and mooncake it is left to the
engine, whose CUDA-aware registration page-locks it and would fail on memory torch had
locked already ("part or all of the requested memory range is already mapped").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvhandoff.integrations.vllm.layout import TensorInfo
from kvhandoff.layout import MemoryKind
from kvhandoff.plan.runs import runs as coalesce
from kvhandoff.session.config import SessionConfig
from kvhandoff.transport.base import Transport
from kvhandoff.transport.registry import (
    CUDA_STAGED_ONLY,
    CUDA_TESTED,
    create_transport,
    transport_class,
)

log = logging.getLogger("kvhandoff.integrations.vllm")

Allocate = Callable[[int], np.ndarray]
"""Host memory of ``nbytes`` from a transport (``Transport.allocate``), as uint8."""


class StagingError(ValueError):
    """A block id a tensor does not have; raised before anything is copied."""


@dataclass(frozen=True, slots=True)
class StagedTensor:
    """One layer tensor and its host mirror view (same shape, strides, storage offset)."""

    name: str
    device: torch.Tensor
    host: torch.Tensor
    dim: int  # the block dimension

    @property
    def num_blocks(self) -> int:
        return int(self.device.shape[self.dim])


def flag(extra: Mapping[str, object], key: str) -> bool:
    """A boolean of ``kv_connector_extra_config`` (JSON true/false, or its spelling as a
    string), false when absent."""
    value = extra.get(key, False)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
        return value.lower() in ("1", "true", "yes")
    raise ValueError(f"kv_connector_extra_config.{key} must be true or false, got {value!r}")


def storage_key(t: torch.Tensor) -> tuple[str, int, int]:
    """What identifies ``t``'s backing allocation: views of one storage share it."""
    return t.device.type, t.device.index or 0, t.untyped_storage().data_ptr()


def _cudart() -> Any:
    """The CUDA runtime's Python bindings (torch's)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def host_storage(nbytes: int, *, pin: bool, allocate: Allocate | None = None
                 ) -> tuple[torch.UntypedStorage, bool]:
    """``nbytes`` of zeroed host memory (from ``allocate`` when given), page-locked when
    ``pin``: torch pins its own allocations; others are registered with CUDA. Also says
    whether it registered the memory (then ``cudaHostUnregister`` is the caller's)."""
    if allocate is None:
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin).untyped_storage(), False
    st = torch.from_numpy(allocate(nbytes)).untyped_storage()
    if not (pin and nbytes):
        return st, False
    rc = int(_cudart().cudaHostRegister(st.data_ptr(), nbytes, 0))
    if rc:
        log.warning("kvhandoff: cannot page-lock the %d B staging mirror (CUDA error %d); "
                    "its copies run from pageable memory", nbytes, rc)
    return st, not rc


def tensor_info(t: torch.Tensor) -> TensorInfo:
    """What the layout needs of one layer tensor: pointer, shape and strides, and its
    backing allocation (the untyped storage several views may share)."""
    st = t.untyped_storage()
    cuda = t.device.type == "cuda"
    return TensorInfo(ptr=t.data_ptr(), shape=tuple(t.shape), strides=tuple(t.stride()),
                      itemsize=t.element_size(), dtype=str(t.dtype).removeprefix("torch."),
                      base_ptr=st.data_ptr(), base_nbytes=st.nbytes(),
                      memory=MemoryKind.CUDA if cuda else MemoryKind.HOST,
                      device=t.device.index or 0 if cuda else 0)


def mirror_view(t: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    """``t``'s view (dtype, storage offset, shape, strides) over ``storage`` instead."""
    return torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.shape, t.stride())


def runs(blocks: Sequence[int]) -> list[tuple[int, int]]:
    """Distinct block ids as ``(first, count)`` runs of consecutive ids, ascending."""
    ids = np.unique(np.asarray(blocks, dtype=np.int64))
    first, count = coalesce(ids)
    return list(zip(ids[first].tolist(), count.tolist(), strict=True))


class HostStaging:
    """A host mirror of the layer tensors of ``groups`` (layer names per transferable
    KV-cache group, in the order of the block lists the copies take), one allocation
    per distinct storage. ``block_dims`` names a layer's block dimension where it is not
    0; ``pin`` defaults to whether CUDA is available (pinning needs it); ``allocate``
    supplies the host memory (a transport's), else torch does."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], groups: Sequence[Sequence[str]],
                 *, block_dims: Mapping[str, int] | None = None, pin: bool | None = None,
                 allocate: Allocate | None = None) -> None:
        pin = torch.cuda.is_available() if pin is None else pin
        self._allocate = allocate
        self.pinned = pin
        dims = dict(block_dims or {})
        self._storages: dict[tuple[str, int, int], torch.UntypedStorage] = {}
        self._registered: list[int] = []  # what close() unregisters, each address once
        self._layers: dict[str, StagedTensor] = {}
        for names in groups:
            for name in names:
                if name not in self._layers:
                    self._layers[name] = self._stage(name, tensors, dims.get(name, 0), pin)
        self.groups = tuple(tuple(names) for names in groups)
        self.devices = tuple(sorted({s.device.device for s in self._layers.values()
                                     if s.device.device.type == "cuda"}, key=str))

    def _stage(self, name: str, tensors: Mapping[str, torch.Tensor], dim: int,
               pin: bool) -> StagedTensor:
        t = tensors.get(name)
        if t is None:
            raise StagingError(f"layer {name!r} has no registered tensor to stage")
        if not 0 <= dim < t.dim():
            raise StagingError(f"layer {name!r}: block dimension {dim} outside its shape "
                               f"{tuple(t.shape)}")
        key = storage_key(t)
        st = self._storages.get(key)
        if st is None:
            st, registered = host_storage(t.untyped_storage().nbytes(), pin=pin,
                                          allocate=self._allocate)
            self._storages[key] = st
            if registered:
                self._registered.append(st.data_ptr())
        return StagedTensor(name, t, mirror_view(t, st), dim)

    @property
    def mirrors(self) -> dict[str, torch.Tensor]:
        """Each staged layer's host view: what kvhandoff registers instead."""
        return {name: s.host for name, s in self._layers.items()}

    @property
    def nbytes(self) -> int:
        """Host bytes held (one mirror per distinct storage)."""
        return sum(st.nbytes() for st in self._storages.values())

    def close(self) -> None:
        """Unregister the mirrors CUDA page-locked for us (torch unpins its own), each
        once, and only those: left registered, an address the mirror's mapping frees
        keeps CUDA's registration, and whatever is mapped there next cannot be pinned.
        Idempotent; the mirrors stay readable."""
        while self._registered:
            _cudart().cudaHostUnregister(self._registered.pop())

    def to_host(self, blocks: Sequence[Sequence[int]]) -> None:
        """Prefill: copy these blocks (one list per group) device → host, and wait."""
        self._copy(blocks, to_host=True)

    def to_device(self, blocks: Sequence[Sequence[int]]) -> None:
        """Decode: copy these blocks (one list per group) host → device, and wait."""
        self._copy(blocks, to_host=False)

    def _check(self, blocks: Sequence[Sequence[int]]) -> None:
        if len(blocks) != len(self.groups):
            raise StagingError(f"{len(blocks)} block lists for {len(self.groups)} staged "
                               f"groups")
        for g, (names, ids) in enumerate(zip(self.groups, blocks, strict=True)):
            for name in names:
                n = self._layers[name].num_blocks
                bad = [b for b in ids if not 0 <= b < n]
                if bad:
                    raise StagingError(f"group {g} layer {name!r}: block ids {bad} outside "
                                       f"its {n} blocks; nothing was copied")

    def _copy(self, blocks: Sequence[Sequence[int]], *, to_host: bool) -> None:
        self._check(blocks)
        for names, ids in zip(self.groups, blocks, strict=True):
            spans = runs(ids)
            for name in names:
                s = self._layers[name]
                src, dst = (s.device, s.host) if to_host else (s.host, s.device)
                for first, count in spans:
                    dst.narrow(s.dim, first, count).copy_(src.narrow(s.dim, first, count),
                                                          non_blocking=True)
        self._sync()

    def _sync(self) -> None:
        """Wait for the copies queued on each device's current stream (after the model's
        own work there, which wrote the blocks)."""
        for dev in self.devices:
            torch.cuda.current_stream(dev).synchronize()


@dataclass(slots=True)
class KvMemory:
    """What a worker registers: ``tensors`` (vLLM's own, or the mirrors of ``staging``)
    under ``config``, and the ``transport`` already made for them (the one whose
    ``allocate`` holds the mirrors), if any."""

    config: SessionConfig
    tensors: Mapping[str, torch.Tensor]
    staging: HostStaging | None = None
    transport: Transport | None = None

    def allocate(self, nbytes: int) -> np.ndarray:
        """Host memory peers may write into (the aux rows): the transport's when it
        insists, else plain."""
        if self.transport is not None:
            return self.transport.allocate(nbytes)
        return np.zeros(nbytes, np.uint8)

    def close(self) -> None:
        """Undo what :func:`kv_memory` set up (when the worker never took it over)."""
        if self.staging is not None:
            self.staging.close()
        if self.transport is not None:
            self.transport.close()


def kv_memory(tensors: Mapping[str, torch.Tensor], groups: Sequence[Sequence[str]],
              config: SessionConfig, *, producer: bool, host_staging: bool = False,
              gpu_direct: bool = False) -> KvMemory:
    """How a worker reaches vLLM's KV cache (``groups``: layer names per transferable
    group). A host mirror when ``host_staging`` is set, when the cache is in GPU memory
    (unless ``gpu_direct``), or on decode when the transport writes only into its own
    ``allocate``d memory (shm); GPU memory itself over nixl and mooncake with
    ``gpu_direct`` (their ``cuda`` option); else vLLM's tensors as they are."""
    name = config.transport
    cuda = any(t.device.type == "cuda" for t in tensors.values())
    if cuda and name not in CUDA_TESTED:
        raise ValueError(f"vLLM's KV cache is in GPU memory, which transport {name!r} cannot "
                         f"move; use one of {sorted(CUDA_TESTED)} "
                         f"(kv_connector_extra_config.transport)")
    if gpu_direct and name in CUDA_STAGED_ONLY:
        raise ValueError(f"gpu_direct: transport {name!r} moves host memory only; "
                         f"nixl and mooncake can register GPU memory")
    own = not producer and transport_class(name).capabilities.needs_allocate
    if not (host_staging or own or (cuda and not gpu_direct)):
        if cuda:
            config = config.replace(transport_options={**config.transport_options, "cuda": True})
        return KvMemory(config, tensors)
    transport = create_transport(  # keyed as the agent keys its own (session.agent)
        name, **{"data_secret": config.data_key(), **config.transport_options}
    ) if own else None
    try:
        staging = HostStaging(tensors, groups,
                              pin=None if name in CUDA_STAGED_ONLY else False,
                              allocate=transport.allocate if transport is not None else None)
    except BaseException:
        if transport is not None:
            transport.close()
        raise
    return KvMemory(config, staging.mirrors, staging, transport)
