"""Pinned host staging (``kvhandoff.integrations.vllm.host_staging``): the mirror path
the connector takes for a GPU KV cache over tcp/shm. Each copy test runs on both copy
paths (``blocks``, ``packed``), on CPU tensors (forced with ``host_staging``, so the same
index and copy code runs without a GPU) and, where CUDA is available, on GPU tensors with
pinned mirrors (``make gpu-check``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from kvhandoff.integrations.vllm import host_staging
from kvhandoff.integrations.vllm.block_copy import StagingPath, runs, words
from kvhandoff.integrations.vllm.host_staging import (
    HostStaging,
    StagingError,
    flag,
    kv_memory,
    staging_path_option,
    tensor_info,
)
from kvhandoff.integrations.vllm.layout import GroupInfo, build_layout
from kvhandoff.session.config import SessionConfig

NB, H, N, C = 8, 2, 4, 16  # blocks, heads, tokens per block, head size (bf16)
PAGE = 2 * H * N * C * 2  # one block of K and V, bytes
USEFUL, OFFSET = 96, 64  # a padded raw page view: its bytes, where it starts in the page


CUDA = torch.cuda.is_available()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not CUDA, reason="no CUDA device here (make gpu-check runs these on a GPU)"))])
def device(request: pytest.FixtureRequest) -> str:
    """Where the "vLLM" tensors live: the staged copies run device ↔ host."""
    return str(request.param)


@pytest.fixture(params=list(StagingPath))
def path(request: pytest.FixtureRequest) -> StagingPath:
    """How the staged copies run: per run of blocks, or packed on the device first."""
    return StagingPath(request.param)


def _pool(fill: bool, seed: int = 1, device: str = "cpu") -> torch.Tensor:
    pool = torch.zeros(NB * PAGE, dtype=torch.uint8)
    if fill:
        pool[:] = torch.randint(0, 256, (NB * PAGE,), generator=torch.Generator().manual_seed(seed),
                                dtype=torch.uint8)
    return pool.to(device)


def _views(pool: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two aliasing views of one storage, as vLLM hands a hybrid model's layers over: an
    attention-like ``[2, num_blocks, H, N, C]`` bf16 view (block dimension 1) and a raw
    int8 ``[num_blocks, 1, USEFUL]`` page view that starts ``OFFSET`` bytes into each
    page and ends before the page does (padding)."""
    attn = pool.view(torch.bfloat16).view(2, NB, H, N, C)
    raw = torch.empty(0, dtype=torch.int8, device=pool.device).set_(
        pool.untyped_storage(), OFFSET, (NB, 1, USEFUL), (PAGE, USEFUL, 1))
    return {"attn": attn, "raw": raw}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of ``t``'s storage, on the host."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).cpu()


GROUPS = (("raw",), ("attn",))
DIMS = {"attn": 1}


def _expected(src: dict[str, torch.Tensor], raw_ids: list[int], attn_ids: list[int]
              ) -> torch.Tensor:
    """A zero storage with the chosen blocks of each view copied from ``src`` (by plain
    indexing, not the staging code's runs)."""
    out = _views(_pool(False))
    out["raw"][raw_ids] = src["raw"][raw_ids].cpu()
    out["attn"][:, attn_ids] = src["attn"][:, attn_ids].cpu()
    return _bytes(out["raw"])


def test_runs_are_distinct_consecutive_ids() -> None:
    assert runs([5, 1, 2, 3, 9, 2, 6]) == [(1, 3), (5, 2), (9, 1)]
    assert runs([]) == []


def test_one_mirror_per_storage_with_the_same_offsets_and_strides(
        device: str, path: StagingPath) -> None:
    dev = _views(_pool(True, device=device))
    other = torch.zeros(3, NB, 5, dtype=torch.float32, device=device)  # its own storage
    st = HostStaging({**dev, "other": other}, (("raw",), ("attn", "other")), block_dims=DIMS,
                     path=path)
    assert st.nbytes == NB * PAGE + other.nbytes  # the shared pool once, not per view
    m = st.mirrors
    assert m["raw"].untyped_storage().data_ptr() == m["attn"].untyped_storage().data_ptr()
    for name, t in {**dev, "other": other}.items():
        h = m[name]
        assert (h.shape, h.stride(), h.storage_offset(), h.dtype) == (
            t.shape, t.stride(), t.storage_offset(), t.dtype)
        assert h.device.type == "cpu" and h.data_ptr() != t.data_ptr()
        assert h.untyped_storage().nbytes() == t.untyped_storage().nbytes()
        assert h.is_pinned() == CUDA  # page-locked wherever CUDA is, for DMA copies
    assert st.pinned == CUDA
    assert not _bytes(m["raw"]).any()  # zeroed


def test_to_host_copies_exactly_the_chosen_blocks_of_each_view(
        device: str, path: StagingPath) -> None:
    dev = _views(_pool(True, device=device))
    st = HostStaging(dev, GROUPS, block_dims=DIMS, path=path)
    st.to_host([[1, 6], [0, 4, 5, 7]])
    assert torch.equal(_bytes(st.mirrors["raw"]), _expected(dev, [1, 6], [0, 4, 5, 7]))
    st.to_host([[], []])  # nothing moves: nothing changes
    assert torch.equal(_bytes(st.mirrors["raw"]), _expected(dev, [1, 6], [0, 4, 5, 7]))


def test_to_device_copies_exactly_the_chosen_blocks_back(
        device: str, path: StagingPath) -> None:
    dev = _views(_pool(False, device=device))
    st = HostStaging(dev, GROUPS, block_dims=DIMS, path=path)
    _bytes(st.mirrors["raw"])[:] = _pool(True, seed=2)  # what a transport wrote
    st.to_device([[3], [2, 3, 6]])
    assert torch.equal(_bytes(dev["raw"]), _expected(st.mirrors, [3], [2, 3, 6]))
    assert _bytes(dev["raw"]).any()


def test_a_round_trip_lands_byte_exact_in_another_devices_tensors(
        device: str, path: StagingPath) -> None:
    """Prefill's device → its mirror → (the transport: a plain copy here) → decode's
    mirror → decode's device, with different block ids on the two sides."""
    p_dev = _views(_pool(True, seed=3, device=device))
    d_dev = _views(_pool(False, device=device))
    p = HostStaging(p_dev, GROUPS, block_dims=DIMS, path=path)
    d = HostStaging(d_dev, GROUPS, block_dims=DIMS, path=path)
    p.to_host([[2], [1, 3]])
    d.mirrors["raw"][5] = p.mirrors["raw"][2]
    d.mirrors["attn"][:, [6, 7]] = p.mirrors["attn"][:, [1, 3]]
    d.to_device([[5], [6, 7]])
    assert torch.equal(d_dev["raw"][5], p_dev["raw"][2])
    # bf16 from random bytes holds NaNs: compare the bits
    assert torch.equal(d_dev["attn"][:, [6, 7]].view(torch.int16),
                       p_dev["attn"][:, [1, 3]].view(torch.int16))
    want = _views(_pool(False))
    want["raw"][5] = p_dev["raw"][2].cpu()
    want["attn"][:, [6, 7]] = p_dev["attn"][:, [1, 3]].cpu()
    assert torch.equal(_bytes(d_dev["raw"]), _bytes(want["raw"]))  # nothing else touched


@pytest.mark.parametrize("bad", [[NB], [-1], [0, NB + 3]])
@pytest.mark.parametrize("way", ["to_host", "to_device"])
def test_out_of_range_block_ids_are_refused_before_any_copy(bad: list[int], way: str,
                                                            device: str, path: StagingPath
                                                            ) -> None:
    dev = _views(_pool(True, device=device))
    before = _bytes(dev["raw"]).clone()
    st = HostStaging(dev, GROUPS, block_dims=DIMS, path=path)
    copy: Callable[[list[list[int]]], None] = getattr(st, way)
    with pytest.raises(StagingError, match=r"group 1 layer 'attn': block ids .* outside its 8 "
                                           r"blocks; nothing was copied"):
        copy([[1], bad])  # group 0's block is valid: still not copied
    assert not _bytes(st.mirrors["raw"]).any()
    assert torch.equal(_bytes(dev["raw"]), before)
    with pytest.raises(StagingError, match="1 block lists for 2 staged groups"):
        copy([[1]])


def _hybrid(pool: torch.Tensor) -> dict[str, torch.Tensor]:
    """:func:`_views` plus a block-major ``[num_blocks, 2, H, N, C]`` bf16 view of the same
    storage, given to two layers (vLLM may give several layers one buffer), and a bf16
    ``[num_blocks, 5]`` view 6 bytes into each page (10-byte rows: no wider word fits)."""
    paged = pool.view(torch.bfloat16).view(NB, 2, H, N, C)
    tail = torch.empty(0, dtype=torch.bfloat16, device=pool.device).set_(
        pool.untyped_storage(), 3, (NB, 5), (PAGE // 2, 1))
    return {**_views(pool), "tail": tail, "paged": paged, "shared": paged}


HYBRID = (("raw",), ("attn",), ("tail", "paged", "shared"))


def _oracle(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor],
            blocks: list[list[int]]) -> None:
    """The naive reference: each block of each view of each group, one at a time."""
    for names, ids in zip(HYBRID, blocks, strict=True):
        for name in names:
            dim = DIMS.get(name, 0)
            for b in ids:
                dst[name].select(dim, b).view(torch.int16 if dst[name].element_size() == 2
                                              else torch.int8).copy_(
                    src[name].select(dim, b).view(torch.int16 if src[name].element_size() == 2
                                                  else torch.int8).cpu())


ids_lists = hst.lists(hst.lists(hst.integers(-2, NB + 1), max_size=NB + 2), min_size=3,
                      max_size=3)


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blocks=ids_lists, seed=hst.integers(0, 2**16))
@pytest.mark.parametrize("to_host", [True, False])
def test_random_block_lists_move_byte_exact_or_are_refused(
        blocks: list[list[int]], seed: int, to_host: bool, device: str, path: StagingPath
        ) -> None:
    """Hybrid overlaid views (attention K/V halves, padded raw pages, block-major pages
    shared by two layers) and random block lists in random order: a valid list moves
    exactly what the naive per-block oracle moves; a list with an id outside the views
    or an id twice is refused, naming the group, layer and ids, and nothing moves."""
    dev = _hybrid(_pool(to_host, seed=seed, device=device))
    st = HostStaging(dev, HYBRID, block_dims=DIMS, path=path)
    if not to_host:
        _bytes(st.mirrors["raw"])[:] = _pool(True, seed=seed)  # what a transport wrote
    src, dst = (dev, st.mirrors) if to_host else (st.mirrors, dev)
    before = _bytes(dst["raw"]).clone()
    want = _hybrid(before.clone())
    bad = [(g, sorted({b for b in ids if not 0 <= b < NB}), sorted({b for b in ids
                                                                    if ids.count(b) > 1}))
           for g, ids in enumerate(blocks)]
    move = st.to_host if to_host else st.to_device
    first = next(((g, out, dup) for g, out, dup in bad if out or dup), None)
    if first is None:
        move(blocks)
        _oracle(src, want, blocks)
        assert torch.equal(_bytes(dst["raw"]), _bytes(want["raw"]))
        return
    g, out, dup = first
    layer = HYBRID[g][0]
    why = f"outside its {NB} blocks" if out else "listed more than once"
    with pytest.raises(StagingError, match=rf"group {g} layer '{layer}': block ids "
                                           rf"\[.*\] {why}; nothing was copied") as e:
        move(blocks)
    assert str(out or dup)[1:-1] in str(e.value)
    assert torch.equal(_bytes(dst["raw"]), before)


def test_views_are_copied_as_the_widest_words_their_layout_allows() -> None:
    """Same bytes, same blocks; 8-byte words where the rows, offset and strides allow,
    else the element width (never across the block dimension)."""
    pool = _pool(True)
    for name, t in _hybrid(pool).items():
        w = words(t, DIMS.get(name, 0))
        assert w.data_ptr() == t.data_ptr() and w.shape[:-1] == t.shape[:-1], name
        # the tail view's 10-byte rows at byte 6 of each page: no wider word fits
        assert w.dtype == (torch.int16 if name == "tail" else torch.int64), name
    last = pool.view(torch.float32).view(-1, NB)
    assert words(last, 1).dtype == torch.int32  # the block dimension is the last one
    assert words(last, 1).shape == last.shape


def test_the_packing_buffer_grows_to_the_largest_request_and_is_reused() -> None:
    st = HostStaging(_views(_pool(True)), GROUPS, block_dims=DIMS, path=StagingPath.PACKED)
    mirrors = NB * PAGE
    assert st.nbytes == mirrors
    st.to_host([[1, 2], [0, 3, 4]])
    grown = st.nbytes - mirrors
    assert grown == 2 * USEFUL + 3 * PAGE  # two raw pages, three K+V attention blocks
    st.to_host([[5], [6]])
    assert st.nbytes - mirrors == grown


@pytest.mark.skipif(not CUDA, reason="no CUDA device here (make gpu-check runs these on a GPU)")
def test_the_mapped_path_maps_a_mirror_torch_pinned_and_refuses_others() -> None:
    """The device addresses the mirror itself (same bytes, same address); a mirror in a
    transport's memory or a pageable one is refused at start-up, naming the layer."""
    dev = _views(_pool(True, device="cuda"))
    st = HostStaging(dev, GROUPS, block_dims=DIMS, path=StagingPath.MAPPED)
    for s in st._layers.values():
        assert s.mapped is not None and s.mapped.is_cuda
        assert s.mapped.data_ptr() == s.host.data_ptr()
    with pytest.raises(StagingError, match=r"layer 'raw': staging path 'mapped' needs a mirror "
                                           r"torch page-locks .* is pageable"):
        HostStaging(dev, GROUPS, block_dims=DIMS, pin=False, path=StagingPath.MAPPED)
    with pytest.raises(StagingError, match="is in the transport's memory"):
        HostStaging(dev, GROUPS, block_dims=DIMS, path=StagingPath.MAPPED,
                    allocate=_from([np.zeros(NB * PAGE, np.uint8)]))


def test_the_staging_path_option_names_one_path() -> None:
    assert staging_path_option({}) is StagingPath.BLOCKS
    assert staging_path_option({"staging_path": "packed"}) is StagingPath.PACKED
    with pytest.raises(StagingError, match=r"staging_path must be one of "
                                           r"\['blocks', 'packed', 'mapped'\], got 'fast'"):
        staging_path_option({"staging_path": "fast"})
    with pytest.raises(StagingError, match=r"staging_path must be one of .*, got 1"):
        staging_path_option({"staging_path": 1})
    with pytest.raises(StagingError, match=r"staging path must be one of .*, got 'gather'"):
        HostStaging(_views(_pool(False)), GROUPS, block_dims=DIMS, path="gather")
    mem = kv_memory(_views(_pool(False)), GROUPS, SessionConfig(transport="tcp"),
                    producer=True, host_staging=True, staging_path="packed")
    assert mem.staging is not None and mem.staging.path is StagingPath.PACKED


def test_a_missing_layer_or_block_dimension_is_refused() -> None:
    dev = _views(_pool(False))
    with pytest.raises(StagingError, match="'gone' has no registered tensor"):
        HostStaging(dev, (("gone",),))
    with pytest.raises(StagingError, match="block dimension 5 outside"):
        HostStaging(dev, (("attn",),), block_dims={"attn": 5})


def test_the_layout_of_the_mirror_is_the_devices_shifted() -> None:
    """build_layout reads the mirrors' base pointer, item stride and padding exactly as
    it reads the device tensors'."""
    pool = _pool(False)
    tensors = {"model.layers.0.mixer": torch.empty(0, dtype=torch.int8).set_(
                   pool.untyped_storage(), OFFSET, (NB, 1, 1, USEFUL), (PAGE, USEFUL, USEFUL, 1)),
               "model.layers.1.self_attn.attn": pool.view(torch.bfloat16).view(NB, H, N, 2 * C)}
    groups = [GroupInfo(0, "mamba", "MambaSpec", N, ("model.layers.0.mixer",)),
              GroupInfo(1, "full", "FullAttentionSpec", N, ("model.layers.1.self_attn.attn",),
                        total_heads=H)]
    st = HostStaging(tensors, [g.layer_names for g in groups])

    def layout(ts: dict[str, torch.Tensor]) -> list[tuple[object, ...]]:
        lay = build_layout(groups, {n: tensor_info(t) for n, t in ts.items()}, tp_rank=0,
                           tp_size=1)
        (region,) = lay.regions
        return [(region.nbytes,)] + [
            (t.name, t.ptr - region.ptr, t.nbytes, t.item_bytes, t.stride, t.dtype)
            for c in lay.components for t in c.tensors]

    assert layout(st.mirrors) == layout(tensors)


class FakeCudart:
    """CUDA's host registrations as a set of addresses, as the runtime answers: an
    address registered twice is error 712, an unknown one unregistered is 713."""

    def __init__(self, *registered: int) -> None:
        self.registered = set(registered)
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        if ptr in self.registered:
            return 712
        self.registered.add(ptr)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        if ptr not in self.registered:
            return 713
        self.registered.remove(ptr)
        return 0


def _from(buffers: list[np.ndarray]) -> Callable[[int], np.ndarray]:
    """A transport's ``allocate`` that hands out these buffers in turn."""
    return lambda nbytes: buffers.pop(0)[:nbytes]


def test_close_unregisters_each_mirror_it_registered_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mirrors in a transport's memory (shm) are registered with CUDA by hand; left
    registered when that memory is unmapped, the address stays CUDA's and the next
    mirror mapped there cannot be pinned (what a GPU run showed: error 712)."""
    cuda = FakeCudart()
    monkeypatch.setattr(host_staging, "_cudart", lambda: cuda)
    other = torch.zeros(3, NB, 5, dtype=torch.float32)
    bufs = [np.zeros(NB * PAGE, np.uint8), np.zeros(other.nbytes, np.uint8)]
    ptrs = {int(b.ctypes.data) for b in bufs}
    st = HostStaging({**_views(_pool(True)), "other": other}, (("raw",), ("attn", "other")),
                     block_dims=DIMS, pin=True, allocate=_from(bufs))
    assert cuda.registered == ptrs  # one per storage, not per view
    st.close()
    assert cuda.registered == set() and sorted(cuda.unregistered) == sorted(ptrs)
    st.close()  # idempotent
    assert len(cuda.unregistered) == 2


def test_memory_it_could_not_register_is_not_unregistered(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    buf = np.zeros(NB * PAGE, np.uint8)
    cuda = FakeCudart(int(buf.ctypes.data))  # someone else's registration
    monkeypatch.setattr(host_staging, "_cudart", lambda: cuda)
    st = HostStaging(_views(_pool(True)), GROUPS, block_dims=DIMS, pin=True,
                     allocate=_from([buf]))
    assert "cannot page-lock the 4096 B staging mirror (CUDA error 712)" in caplog.text
    st.close()
    assert cuda.unregistered == [] and cuda.registered == {int(buf.ctypes.data)}
    torchs = HostStaging(_views(_pool(True)), GROUPS, block_dims=DIMS)
    torchs.close()  # torch allocated (and, with CUDA, pinned) the mirror: torch unpins it
    assert cuda.unregistered == []


def test_kv_memory_mirrors_only_when_asked_or_needed() -> None:
    dev = _views(_pool(True))
    groups = (("raw",), ("attn",))
    plain = kv_memory(dev, groups, SessionConfig(transport="tcp"), producer=False)
    assert plain.staging is None and plain.transport is None and plain.tensors is dev
    assert "cuda" not in plain.config.transport_options
    forced = kv_memory(dev, groups, SessionConfig(transport="tcp"), producer=True,
                       host_staging=True)
    assert forced.staging is not None and forced.transport is None
    assert forced.tensors["attn"].data_ptr() != dev["attn"].data_ptr()
    assert forced.allocate(16).nbytes == 16
    # shm writes only into its own allocations: decode's mirror comes from there, always
    shm = kv_memory({"raw": dev["raw"]}, (("raw",),), SessionConfig(transport="shm"),
                    producer=False)
    try:
        assert shm.staging is not None and shm.transport is not None
        assert shm.transport.name == "shm"
        assert shm.allocate(32).nbytes == 32
    finally:
        shm.close()
    assert kv_memory(dev, groups, SessionConfig(transport="shm"), producer=True).staging is None
    with pytest.raises(ValueError, match="gpu_direct: transport 'tcp' moves host memory only"):
        kv_memory(dev, groups, SessionConfig(transport="tcp"), producer=True, gpu_direct=True)


def test_the_host_staging_option_is_a_boolean() -> None:
    assert flag({}, "host_staging") is False
    assert flag({"host_staging": True}, "host_staging") is True
    assert flag({"host_staging": "false"}, "host_staging") is False
    with pytest.raises(ValueError, match="host_staging must be true or false, got 2"):
        flag({"host_staging": 2}, "host_staging")
