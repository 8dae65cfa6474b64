"""How a request's blocks move between vLLM's tensors and their host mirrors
(:mod:`.host_staging`): three interchangeable paths behind one contract. Torch, no vLLM.

* :attr:`StagingPath.BLOCKS`: one ``copy_`` per run of consecutive block ids, per layer
  view. Measured on an H100 at 4–7.6× one contiguous copy of the same bytes: the time
  goes to one copy call (and one DMA set-up) per run.
* :attr:`StagingPath.PACKED`: per layer view, one device ``index_select`` packs the
  request's blocks into a contiguous device buffer, one ``copy_`` moves that buffer to
  contiguous pinned host memory, and one numpy assignment places it in the mirror;
  decode does the reverse (host ``index_select`` straight into pinned memory, one copy
  up, one device ``index_copy_``). Three calls per view whatever the number of blocks,
  but one more host copy of the bytes.
* :attr:`StagingPath.MAPPED`: per layer view, one gather and one scatter kernel on the
  device, which reads and writes the page-locked mirror itself through its device
  mapping (CUDA maps page-locked host memory into the device's address space): the
  blocks cross PCIe once, in the kernel's own accesses, and no host copy happens.

Every path copies *through the views*, so a block moves exactly the bytes its view
covers (the K and V halves of an attention block, the useful part of a padded Mamba
page) and nothing else, and leaves the mirror laid out as the device tensors are, so the
layout the transport registers (base pointer, item stride, page padding) does not
depend on the path. Why the mirror stays what the transport reads: a packed area
registered instead would change the item addressing the peer plans against (and with
it the handshake's layout signature), so a staged side could no longer pair with a side
registering its tensors in place.

Overlap (packed): prefill queues every view's pack and device → host copy on the current
stream first, each followed by an event, then places each view on the host as soon as
its event fires, while the later views are still crossing; decode gathers view *i + 1*
on the host while view *i* crosses. One synchronisation ends each call.

``packed`` and ``mapped`` copy the views as integers, as wide as their layout allows
(:func:`words`): bit-exact, and the index kernels move one element per step. Block ids
must already be checked (distinct, in range): ``HostStaging`` does so.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvhandoff.integrations import coalesce_runs


class StagingPath(enum.StrEnum):
    """Which copy path a :class:`~.host_staging.HostStaging` takes."""

    BLOCKS = "blocks"  # one copy per run of consecutive blocks (the measured default)
    PACKED = "packed"  # gather on the device, one contiguous copy, place on the host
    MAPPED = "mapped"  # the device reads and writes the page-locked mirror itself


@dataclass(frozen=True, slots=True)
class StagedTensor:
    """One layer tensor and its host mirror view (same shape, strides, storage offset)."""

    name: str
    device: torch.Tensor
    host: torch.Tensor
    dim: int  # the block dimension
    mapped: torch.Tensor | None = None  # ``host`` as the device addresses it (``mapped``)

    @property
    def num_blocks(self) -> int:
        return int(self.device.shape[self.dim])


Batch = Sequence[tuple[Sequence[StagedTensor], np.ndarray]]
"""What one call moves: per group, its staged views and its checked block ids."""

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ALIGN = 64  # bytes: where each view's slice of the packing buffer starts


def words(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` viewed as integers (same bytes, same blocks along ``dim``), as wide as its
    layout allows up to 8 bytes. Integer copies keep every bit (bf16 and fp8 from random
    bytes hold NaNs); wide ones matter because the index kernels, on the host and on the
    device, move one element per step (a host ``index_copy_`` of bytes runs ~12x slower
    than ``memcpy``, of 8-byte words ~2x)."""
    size = t.element_size()
    if t.dim() and dim != t.dim() - 1 and t.stride(-1) == 1:
        row, offset = t.shape[-1] * size, t.storage_offset() * size
        for width in (8, 4, 2):
            if width > size and row % width == 0 and offset % width == 0 and all(
                    stride * size % width == 0 for stride in t.stride()[:-1]):
                return t.view(_WORDS[width])
    dtype = _WORDS.get(size)
    return t if dtype is None or t.dtype == dtype else t.view(dtype)


def runs(blocks: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """Distinct block ids as ``(first, count)`` runs of consecutive ids, ascending."""
    ids = np.unique(np.asarray(blocks, dtype=np.int64))
    first, count = coalesce_runs(ids)
    return list(zip(ids[first].tolist(), count.tolist(), strict=True))


def copy_runs(batch: Batch, *, to_host: bool) -> None:
    """The ``blocks`` path: one non-blocking copy per run per view, queued on the
    current stream (the caller synchronises)."""
    for views, ids in batch:
        spans = runs(ids)
        for s in views:
            src, dst = (s.device, s.host) if to_host else (s.host, s.device)
            for first, count in spans:
                dst.narrow(s.dim, first, count).copy_(src.narrow(s.dim, first, count),
                                                      non_blocking=True)


def copy_mapped(batch: Batch, *, to_host: bool) -> None:
    """The ``mapped`` path: per view, one gather and one scatter kernel, the device
    reading or writing the mirror through its mapping (:func:`device_alias`), queued on
    the current stream (the caller synchronises; after that, the host sees every write).
    No host copy at all: the mirror is written in place."""
    for views, ids in batch:
        on_device: dict[torch.device, torch.Tensor] = {}
        for s in views:
            assert s.mapped is not None, "HostStaging maps each mirror on this path"
            dev = s.device.device
            idx = on_device.setdefault(dev, torch.from_numpy(ids).to(dev))
            src, dst = (s.device, s.mapped) if to_host else (s.mapped, s.device)
            words(dst, s.dim).index_copy_(s.dim, idx, words(src, s.dim).index_select(s.dim, idx))


class _HostArray:
    """``nbytes`` of page-locked host memory at ``ptr``, offered to torch as device
    memory (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3}


def device_alias(storage: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
    """``storage`` (host memory) as ``device`` addresses it: itself off CUDA; on CUDA, a
    CUDA storage over the same bytes, which needs memory torch page-locked (with unified
    addressing, CUDA maps such memory into every device's address space at the same
    address). Raises ``ValueError`` where torch would not alias it (a copy would
    silently break the path)."""
    if device.type != "cuda":
        return storage
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    alias = torch.as_tensor(_HostArray(ptr, nbytes), device=device).untyped_storage()
    if alias.data_ptr() != ptr or alias.device != device:
        raise ValueError(f"the {nbytes} B mirror at {ptr:#x} cannot be mapped into {device}'s "
                         f"address space (torch gave {alias.device} memory at "
                         f"{alias.data_ptr():#x})")
    return alias


def _when_copied(device: torch.device) -> Callable[[], None]:
    """Something to call that returns once the work queued so far on ``device``'s current
    stream is done (at once off CUDA, where copies are synchronous)."""
    if device.type != "cuda":
        return lambda: None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event.synchronize


class Packer:
    """The ``packed`` path's state: a reusable pinned (when ``pin``) host buffer, grown
    to the largest request seen (doubling, since pinning costs a driver call). Not
    thread-safe: one worker's step thread drives its staging, and each call returns
    only once the buffer is free again."""

    def __init__(self, *, pin: bool) -> None:
        self._pin = pin
        self._arena = torch.empty(0, dtype=torch.uint8)

    @property
    def nbytes(self) -> int:
        """Host bytes the packing buffer holds now."""
        return self._arena.nbytes

    def _chunks(self, batch: Batch) -> list[torch.Tensor]:
        """One contiguous slice of the buffer per view of ``batch``, in order, each shaped
        and typed as that view's packed blocks (in :func:`words`)."""
        shapes = []
        for views, ids in batch:
            for s in views:
                w = words(s.host, s.dim)
                shapes.append((w.dtype, (*w.shape[:s.dim], len(ids), *w.shape[s.dim + 1:])))
        sizes = [int(np.prod(shape, dtype=np.int64)) * dt.itemsize for dt, shape in shapes]
        # each slice starts on a 64-byte boundary: a word view needs its offset aligned
        starts = np.concatenate(([0], np.cumsum(-(-np.array(sizes, np.int64) // _ALIGN))))
        starts *= _ALIGN
        if starts[-1] > self._arena.nbytes:
            grown = max(int(starts[-1]), 2 * self._arena.nbytes)
            self._arena = torch.empty(grown, dtype=torch.uint8, pin_memory=self._pin)
        return [self._arena[int(off):int(off) + size].view(dt).view(shape)
                for (dt, shape), size, off in zip(shapes, sizes, starts[:-1], strict=True)]

    def _views(self, batch: Batch) -> Iterator[tuple[StagedTensor, np.ndarray, torch.Tensor,
                                                     torch.Tensor]]:
        """Per view of ``batch``: the view, its group's ids, the same on the view's device
        (one index copy per group and device), and its slice of the buffer."""
        chunks = iter(self._chunks(batch))
        for views, ids in batch:
            host_idx = torch.from_numpy(ids)
            on_device: dict[torch.device, torch.Tensor] = {}
            for s in views:
                dev = s.device.device
                yield s, ids, on_device.setdefault(dev, host_idx.to(dev)), next(chunks)

    def to_host(self, batch: Batch) -> None:
        """Pack each view's blocks on its device, copy them into the pinned buffer, and
        place each view in its mirror as soon as its copy landed (numpy's fancy
        assignment: at ``memcpy`` speed, where torch's host ``index_copy_`` is not).
        Returns with every byte in the mirrors."""
        queued = []
        for s, ids, idx, chunk in self._views(batch):
            chunk.copy_(words(s.device, s.dim).index_select(s.dim, idx), non_blocking=True)
            queued.append((_when_copied(s.device.device), s, ids, chunk))
        for ready, s, ids, chunk in queued:
            ready()
            words(s.host, s.dim).numpy()[(slice(None),) * s.dim + (ids,)] = chunk.numpy()

    def to_device(self, batch: Batch) -> None:
        """Gather each view's blocks from its mirror into the pinned buffer, copy them to
        the device and scatter them into the view there. Queues the device work on the
        current stream (the caller synchronises)."""
        for s, ids, idx, chunk in self._views(batch):
            torch.index_select(words(s.host, s.dim), s.dim, torch.from_numpy(ids), out=chunk)
            words(s.device, s.dim).index_copy_(s.dim, idx,
                                               chunk.to(s.device.device, non_blocking=True))
