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
useful part of a padded Mamba page), and no other block is touched. How they run is the
staging path (:mod:`.block_copy`): ``blocks`` (one copy per run of blocks, the default
and the path measured on an H100), ``packed`` (gathered on the device, one contiguous
copy, placed on the host) or ``mapped`` (the device reads and writes the pinned mirror
itself); the last two have not yet run on a GPU. Block lists are checked first: an id
outside a layer's blocks or an id listed twice is refused before anything moves.

:func:`kv_memory` decides, per worker, what kvhandoff registers: vLLM's tensors, the
same as device memory (nixl, mooncake), or a mirror. A decode worker on a transport
whose destinations must come from its own ``allocate`` (shm) always uses a mirror
allocated there, since vLLM's tensors never are.

The CUDA path (pinning, the device copies, the stream synchronisation) runs on a GPU in
``make gpu-check`` (tested on an H100: staged tcp, shm and nixl handoffs byte-exact in
decode's GPU memory); ``host_staging`` runs the same code on CPU tensors everywhere else.
A GPU cache takes the mirror over every transport unless ``gpu_direct`` asks nixl or
mooncake to register device memory themselves. That stays opt-in (docs/gpu.md says
why: torch's device copies failed in a process whose NIXL agent loaded UCX's CUDA
modules, and host → GPU over NIXL made no progress as kvhandoff drives it). The mirror
is page-locked by torch (tcp) or with ``cudaHostRegister`` (shm's arenas); for nixl and
mooncake it is left to the engine, whose CUDA-aware registration page-locks it and would
fail on memory torch had locked already ("part or all of the requested memory range is
already mapped").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvhandoff.integrations import (
    CUDA_STAGED_ONLY,
    How,
    SessionConfig,
    Transport,
    open_transport,
    placement,
)
from kvhandoff.integrations.vllm.block_copy import (
    Packer,
    StagedTensor,
    StagingPath,
    copy_mapped,
    copy_runs,
    device_alias,
)
from kvhandoff.integrations.vllm.layout import TensorInfo
from kvhandoff.layout import MemoryKind

log = logging.getLogger("kvhandoff.integrations.vllm")

Allocate = Callable[[int], np.ndarray]
"""Host memory of ``nbytes`` from a transport (``Transport.allocate``), as uint8."""


class StagingError(ValueError):
    """A block list a staged tensor cannot take (an id outside it, an id twice, a list
    per group missing); raised before anything is copied."""


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


def staging_path_option(extra: Mapping[str, object]) -> StagingPath:
    """``kv_connector_extra_config.staging_path`` (``blocks`` when absent)."""
    return _path(extra.get("staging_path", StagingPath.BLOCKS),
                 "kv_connector_extra_config.staging_path")


def _path(value: object, what: str = "staging path") -> StagingPath:
    """``value`` as a :class:`StagingPath`, or a :class:`StagingError` naming ``what`` and
    the choices."""
    if isinstance(value, str) and value in {p.value for p in StagingPath}:
        return StagingPath(value)
    raise StagingError(f"{what} must be one of {[p.value for p in StagingPath]}, "
                       f"got {value!r}")


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
    return torch.empty(0, dtype=t.dtype, device=storage.device).set_(
        storage, t.storage_offset(), t.shape, t.stride())


class HostStaging:
    """A host mirror of the layer tensors of ``groups`` (layer names per transferable
    KV-cache group, in the order of the block lists the copies take), one allocation
    per distinct storage. ``block_dims`` names a layer's block dimension where it is not
    0; ``pin`` defaults to whether CUDA is available (pinning needs it); ``allocate``
    supplies the host memory (a transport's), else torch does; ``path`` picks how blocks
    cross (:class:`~.block_copy.StagingPath`: per run of blocks, the default; packed on
    the device first; or mapped, the device writing the mirror itself, which needs a
    mirror torch pinned). The mirror's layout is the same on every path."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], groups: Sequence[Sequence[str]],
                 *, block_dims: Mapping[str, int] | None = None, pin: bool | None = None,
                 allocate: Allocate | None = None,
                 path: StagingPath | str = StagingPath.BLOCKS) -> None:
        pin = torch.cuda.is_available() if pin is None else pin
        self._allocate = allocate
        self.pinned = pin
        self.path = _path(path)
        self._packer = Packer(pin=pin) if self.path is StagingPath.PACKED else None
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
        mapped = None
        if self.path is StagingPath.MAPPED:
            mapped = mirror_view(t, self._mapped(name, t, st))
        return StagedTensor(name, t, mirror_view(t, st), dim, mapped)

    def _mapped(self, name: str, t: torch.Tensor, st: torch.UntypedStorage
                ) -> torch.UntypedStorage:
        """``st`` as ``t``'s device addresses it, for the ``mapped`` path: on CUDA only
        a mirror torch page-locked (not one in a transport's memory, nor a pageable one)."""
        if t.device.type == "cuda" and (self._allocate is not None or not self.pinned):
            where = "in the transport's memory" if self._allocate else "pageable"
            raise StagingError(f"layer {name!r}: staging path 'mapped' needs a mirror torch "
                               f"page-locks (transports tcp, cma), and this one is {where}; "
                               f"use 'packed' or 'blocks'")
        try:
            return device_alias(st, t.device)
        except ValueError as e:
            raise StagingError(f"layer {name!r}: staging path 'mapped': {e}") from None

    @property
    def mirrors(self) -> dict[str, torch.Tensor]:
        """Each staged layer's host view: what kvhandoff registers instead."""
        return {name: s.host for name, s in self._layers.items()}

    @property
    def nbytes(self) -> int:
        """Host bytes held: one mirror per distinct storage, and the packing buffer."""
        packing = self._packer.nbytes if self._packer is not None else 0
        return sum(st.nbytes() for st in self._storages.values()) + packing

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

    def _check(self, blocks: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Each group's block ids as int64, after checking every list against every view
        of its group: in range and distinct (vLLM never hands a block twice; a repeat
        would be a bug upstream, and the device scatters a repeat in no set order)."""
        if len(blocks) != len(self.groups):
            raise StagingError(f"{len(blocks)} block lists for {len(self.groups)} staged "
                               f"groups")
        out = []
        for g, (names, ids) in enumerate(zip(self.groups, blocks, strict=True)):
            arr = np.asarray(ids, dtype=np.int64).reshape(-1)
            for name in names:
                n = self._layers[name].num_blocks
                bad = np.unique(arr[(arr < 0) | (arr >= n)])
                if bad.size:
                    raise StagingError(f"group {g} layer {name!r}: block ids {bad.tolist()} "
                                       f"outside its {n} blocks; nothing was copied")
            uniq, counts = np.unique(arr, return_counts=True)
            if (counts > 1).any():
                raise StagingError(f"group {g} layer {names[0]!r}: block ids "
                                   f"{uniq[counts > 1].tolist()} listed more than once; "
                                   f"nothing was copied")
            out.append(arr)
        return out

    def _copy(self, blocks: Sequence[Sequence[int]], *, to_host: bool) -> None:
        ids = self._check(blocks)
        batch = [([self._layers[name] for name in names], arr)
                 for names, arr in zip(self.groups, ids, strict=True) if arr.size]
        if self.path is StagingPath.MAPPED:
            copy_mapped(batch, to_host=to_host)
        elif self._packer is None:
            copy_runs(batch, to_host=to_host)
        elif to_host:
            self._packer.to_host(batch)
        else:
            self._packer.to_device(batch)
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
              gpu_direct: bool = False,
              staging_path: StagingPath | str = StagingPath.BLOCKS) -> KvMemory:
    """How a worker reaches vLLM's KV cache (``groups``: layer names per transferable
    group), as the kit decides it (:func:`kvhandoff.integrations.placement`): vLLM's
    tensors in place (GPU memory registered by nixl or mooncake with ``gpu_direct``), or
    a host mirror — when ``host_staging`` is set, when the cache is in GPU memory, and on
    decode when the transport writes only into its own ``allocate``d memory (shm), the
    mirror then allocated there. ``staging_path`` is how a mirror's copies run
    (:class:`~.block_copy.StagingPath`), checked even when no mirror is needed."""
    path = _path(staging_path)
    name = config.transport
    cuda = any(t.device.type == "cuda" for t in tensors.values())
    where = placement(name, producer=producer, cuda=cuda, mirror=True,
                      force_mirror=host_staging, gpu_direct=gpu_direct, engine="vLLM")
    if where.how is How.IN_PLACE:
        options = where.transport_options()
        if options:
            config = config.replace(transport_options={**config.transport_options, **options})
        return KvMemory(config, tensors)
    transport = open_transport(config) if where.own_memory else None
    try:
        staging = HostStaging(tensors, groups,
                              pin=None if name in CUDA_STAGED_ONLY else False,
                              allocate=transport.allocate if transport is not None else None,
                              path=path)
    except BaseException:
        if transport is not None:
            transport.close()
        raise
    return KvMemory(config, staging.mirrors, staging, transport)
