"""The engine's memory: free lists, page tables, SWA mapping, prefix cache, TP shards.

Model-free where possible: thousands of random request lifecycles must leave every pool
empty; shards must be exactly what a TP rank holds (checked against hand-written
channel / head ranges, not the engine's own sharding code)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvhandoff.indices import swa_window_pages, swa_window_start  # noqa: E402
from kvhandoff.lab.engine import run_disaggregated, sample_prompts  # noqa: E402
from kvhandoff.lab.engine.alloc import AllocatorError, FreeList  # noqa: E402
from kvhandoff.lab.engine.pools import PoolConfig  # noqa: E402
from kvhandoff.lab.engine.prefill import PrefillInstance  # noqa: E402
from kvhandoff.lab.engine.prefix_cache import PrefixCache  # noqa: E402
from kvhandoff.lab.engine.run import prepare  # noqa: E402
from kvhandoff.lab.engine.sharding import join, split  # noqa: E402
from kvhandoff.lab.engine.tables import Tables  # noqa: E402
from kvhandoff.layout import ShardSpec  # noqa: E402

torch.set_num_threads(1)


def test_free_list_hands_out_scattered_ids_and_refuses_double_free() -> None:
    fl = FreeList("pages", 64, seed=1)
    a = fl.alloc(10)
    assert 0 not in a and len(set(a.tolist())) == 10
    assert not np.array_equal(np.sort(a), np.arange(a.min(), a.min() + 10))  # scattered
    fl.free(a[:5])
    with pytest.raises(AllocatorError):
        fl.free(a[:1])
    with pytest.raises(AllocatorError):
        fl.alloc(64)
    fl.free(a[5:])
    assert fl.num_free == 63 and fl.num_used == 0


def test_swa_mapping_follows_the_window_and_evicts() -> None:
    tb = Tables(page_size=4, num_pages=32, num_slots=4, swa_page_size=4, num_swa_pages=32)
    req = tb.new_request()
    tb.extend(req, 37)
    tb.map_swa(req, 0, 37)
    tb.evict_swa(req, 37 - 8)  # positions below 29 left the window of 8
    row = tb.row_slots(req)
    pages = swa_window_pages(row, 37, 8, 4, 0, tb.full_to_swa)
    assert len(pages) == len(range(swa_window_start(37, 8, 4), 37, 4)) == 3
    assert tb.swa is not None and tb.swa.num_used == 3
    tb.release(req)
    assert not any(tb.leaks().values()) and (tb.full_to_swa == -1).all()


def test_thousands_of_requests_leave_every_pool_empty() -> None:
    """Random prompts sharing prefixes through a decode-style lifecycle: prefix-cache
    hits, SWA window mapping and eviction, pressure evictions, releases."""
    rng = np.random.default_rng(0)
    ps, window = 4, 8
    tb = Tables(page_size=ps, num_pages=96, num_slots=6, swa_page_size=ps, num_swa_pages=96)
    cache = PrefixCache(ps, tb.pages.free)
    bases = [rng.integers(0, 50, 64) for _ in range(6)]
    live: list = []
    for i in range(4000):
        n = int(rng.integers(1, 60))
        toks = np.concatenate([bases[i % 6][:int(rng.integers(0, n + 1))],
                               rng.integers(0, 50, n)])[:n]
        cap = min(n // ps, max(0, n - window) // ps)
        hit = cache.match(toks, cap)
        req = tb.new_request(prefix_pages=hit)
        try:
            tb.extend(req, n)
        except AllocatorError:
            cache.evict_all()
            tb.extend(req, n)
        tb.map_swa(req, swa_window_start(n, window, ps, len(hit) * ps), n)
        live.append((toks, req, hit))
        owned = np.concatenate([r.pages[r.borrowed:] for _, r, _ in live])
        assert len(np.unique(owned)) == len(owned)  # no page handed out twice
        if len(live) > 3 or i == 3999:
            while live:
                t, r, h = live.pop()
                keep = cache.insert(t, r.pages[:len(t) // ps])
                cache.unlock(h)
                tb.release(r, keep=keep)
    cache.evict_all()
    assert len(cache) == 0
    assert not any(tb.leaks().values()), tb.leaks()


def test_run_with_a_small_pool_evicts_and_leaks_nothing() -> None:
    """~100 requests through the real engine (SWA + full KV + prefix cache) in a pool
    too small to cache them all: decode evicts under pressure, nothing leaks."""
    prompts = sample_prompts([int(x) for x in np.random.default_rng(1).integers(9, 30, 50)])
    result = run_disaggregated("gpt_oss", prompts, chunk=6, max_new_tokens=2,
                               prefix_hit=True, num_pages=24)
    assert result.ok, [r.state_diff for r in result.requests if not r.ok]
    assert sum(r.prompt_len // 4 for r in result.requests) > 3 * 24  # cache outgrew the pool
    reqs = result.requests
    served = [reqs[i + 1] for i, r in enumerate(reqs) if r.donor]
    assert len(served) >= 15 and all(r.prefix_len > 0 for r in served)
    assert not any(result.leaks.values()), result.leaks


@pytest.mark.parametrize("m", [5, 0])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_join_round_trip(tp: int, m: int) -> None:
    """Every rank's share reassembles to the global rows, also for zero rows (a layer
    that keeps no token, asked for by an empty id list)."""
    rng = np.random.default_rng(tp)
    gdn = ShardSpec.axis(axis=16 + 16 + 32, groups=(16, 16, 32), inner_bytes=12)
    gqa = ShardSpec.axis(outer=1, axis=2, inner_bytes=64)  # 2 KV heads: replicated at TP 4
    for shard in (gdn, gqa, None):
        width = 64 * 12 if shard is gdn else 128 if shard is gqa else 40
        rows = rng.integers(0, 256, (m, width), dtype=np.uint8)
        parts = [split(rows, shard, 1, r, tp) for r in range(tp)]
        back, agree = join(parts, shard, 1)
        assert agree and back.shape == rows.shape and np.array_equal(back, rows)
        if m and tp > 1 and (shard is None or (shard is gqa and tp == 4)):
            parts[1] = parts[1].copy()
            parts[1][0, 0] ^= 1
            assert not join(parts, shard, 1)[1]  # a disagreeing replica is reported


class _Recorder:
    """A transfer that only records chunks (decode holds no prefix)."""

    def __init__(self) -> None:
        self.chunks: list = []

    def start(self, rid: int, rank: int, num_pages: int, aux_row: int) -> int:
        return 0

    def send(self, rid: int, rank: int, chunk) -> None:
        self.chunks.append((rank, chunk))

    def settle(self, rid: int, rank: int) -> None:
        pass


@pytest.mark.parametrize("tp", [2, 4])
def test_prefill_ranks_hold_exactly_their_shard(tp: int) -> None:
    """Qwen3-Next at TP 2 / 4: rank r's conv slot holds its slice of each of q, k and v
    (4 key heads x 8, 8 value heads x 8: q|k|v = 32|32|64 channels), its SSM heads, and
    its KV head of the page (2 KV heads: replicated past TP 2)."""
    prep = prepare("qwen3_next")
    pools = PoolConfig(page_size=4, num_pages=32, num_slots=4)
    pre = PrefillInstance(prep.model, prep.arch, tp=tp, pools=pools, chunk=6)
    rec = _Recorder()
    out = pre.run(0, sample_prompts([14])[0], rec)
    last = next(c for _, c in rec.chunks if c.last)
    slot = int(last.state["mamba"].items[0])
    conv = out.snapshot[("mamba", "conv", 0)][1].view(np.float32).reshape(128, 3)
    ssm = out.snapshot[("mamba", "ssm", 0)][1].view(np.float32).reshape(8, 64)
    for r in range(tp):
        q, k, v = (np.arange(32 // tp) + r * 32 // tp, 32 + np.arange(32 // tp) + r * 32 // tp,
                   64 + np.arange(64 // tp) + r * 64 // tp)
        mine = pre.ranks[r].units(("mamba", "conv", 0))[slot].view(np.float32)
        assert np.array_equal(mine.reshape(-1, 3), conv[np.concatenate([q, k, v])])
        heads = np.arange(8 // tp) + r * 8 // tp
        mine = pre.ranks[r].units(("mamba", "ssm", 0))[slot].view(np.float32)
        assert np.array_equal(mine.reshape(-1, 64), ssm[heads])
    keys = out.snapshot[("kv", "k", 1)][1].view(np.float32).reshape(14, 2, 16)
    pages = np.concatenate([c.pages for rank, c in rec.chunks if rank == 0])
    for r in range(tp):
        head = r * 2 // tp if tp <= 2 else r // (tp // 2)
        units = pre.ranks[r].units(("kv", "k", 1))
        got = units[(pages[:, None] * 4 + np.arange(4)).ravel()[:14]].view(np.float32)
        assert np.array_equal(got.reshape(14, -1), keys[:, head])


def test_local_transfer_refuses_incomplete_requests() -> None:
    """Prefill cannot start before every decode rank opened the request, and decode's
    wait fails while a prefill rank's last chunk is missing."""
    from kvhandoff.errors import PlanError
    from kvhandoff.lab.engine import LocalTransfer
    from kvhandoff.lab.engine.transfer import Chunk, ItemList

    prep = prepare("llama")
    pools = PoolConfig(page_size=4, num_pages=16, num_slots=4)
    pre = PrefillInstance(prep.model, prep.arch, tp=2, pools=pools, chunk=6)
    link = LocalTransfer(pre.ranks, pre.ranks[:1])
    with pytest.raises(KeyError):
        link.start(7, 0, 1, 1)
    lists = {"kv": ItemList(items=np.array([3])), "aux": ItemList(items=np.array([1]))}
    link.open(7, 0, lists, 0)
    assert link.start(7, 0, 1, 1) == 0 and link.start(7, 1, 1, 1) == 0
    state = {"aux": ItemList(items=np.array([2]))}
    link.send(7, 0, Chunk(pages=np.array([5]), last=True, state=state))
    with pytest.raises(PlanError, match=r"prefill ranks \[1\] never sent a last chunk"):
        link.wait(7)


def test_relocate_moves_every_tensor_and_keeps_its_bytes() -> None:
    """What shm's decode side needs: the pools move into memory from another allocator
    (one block, 64-byte aligned tensors); the layout's addresses follow, contents stay."""
    prep = prepare("qwen3_next")
    pools = PoolConfig(page_size=4, num_pages=8, num_slots=2)
    rank = PrefillInstance(prep.model, prep.arch, tp=2, pools=pools, chunk=6).ranks[1]
    keys = [(c.name, t.name, t.layer_id) for c in rank.layout.components for t in c.tensors]
    rng = np.random.default_rng(0)
    for k in keys:
        u = rank.units(k)
        u[...] = rng.integers(0, 256, u.shape, dtype=np.uint8)
    before = {k: rank.units(k).copy() for k in keys}
    blocks: list[np.ndarray] = []

    def allocate(nbytes: int) -> np.ndarray:
        blocks.append(np.zeros(nbytes + 64, dtype=np.uint8)[64:])
        return blocks[-1]

    rank.relocate(allocate)
    (block,) = blocks
    lo, hi = block.ctypes.data, block.ctypes.data + len(block)
    for c in rank.layout.components:
        for t in c.tensors:
            key = (c.name, t.name, t.layer_id)
            assert np.array_equal(rank.units(key), before[key]), key
            if not t.nbytes:
                continue
            assert lo <= t.ptr and t.ptr + t.nbytes <= hi and t.ptr % 64 == lo % 64, key
            assert np.shares_memory(rank.units(key), block)
            assert np.array_equal(rank.memory.view(t.ptr)[:t.nbytes],
                                  rank.units(key).reshape(-1)), key
    with pytest.raises(ValueError, match="not a contiguous uint8 buffer"):
        rank.relocate(lambda n: np.zeros(n // 2, dtype=np.uint8))
