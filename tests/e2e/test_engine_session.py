"""The engine over the real session layer: Sender / Receiver, a bootstrap server and a
real transport — every core architecture × TP pair over tcp, the other transports in a
smaller matrix.

Each case checks what the in-process handoff checks (greedy tokens equal colocated
decoding for 16 new tokens, decode's rebuilt cache equals prefill's byte for byte, every
pool empty afterwards), and that the bytes decode counted per component equal what the
in-process planner moves for the same requests (planned beside the real transfer).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvhandoff.bootstrap.server import BootstrapServer  # noqa: E402
from kvhandoff.integrations import SessionConfig, open_transport  # noqa: E402
from kvhandoff.lab.engine import (  # noqa: E402
    CORE,
    Chunk,
    ItemList,
    LocalTransfer,
    RunResult,
    TransferReport,
    run_disaggregated,
    sample_prompts,
)
from kvhandoff.lab.engine.pools import PoolConfig, RankPools, rank_layout  # noqa: E402
from kvhandoff.lab.engine.run import prepare  # noqa: E402
from kvhandoff.lab.engine.session_link import DecodeLink, LinkError, SessionLink  # noqa: E402
from kvhandoff.secret import write_secret_file  # noqa: E402
from kvhandoff.transport import ConnectError  # noqa: E402
from kvhandoff.transport.registry import available_transports, create_transport  # noqa: E402

torch.set_num_threads(1)

PAIRS = [(1, 1), (2, 1), (1, 2), (2, 4)]
NEW_TOKENS = 16
# (prompt lengths, chunk): shorter than a page, page-aligned, unaligned, past the window,
# several chunks. DeepSeek-V4 pages hold 128 tokens (whole C4 and C128 rows).
SETUP = {name: ([5, 16, 23, 37], 6) for name in CORE}
SETUP["deepseek_v4"] = ([130, 256], 64)
SETUP["mistral"] = ([5, 16, 23, 37], 6)  # every layer sliding-window (8): no KV component
SETUP["mamba2"] = ([5, 16, 23, 37], 6)  # attention-free: no KV component either
# the other transports: one or two architectures each, different state types
OTHERS = [("shm", "qwen3_next", (2, 1)), ("shm", "deepseek_v4", (1, 2)),
          ("cma", "qwen3_next", (2, 1)), ("cma", "deepseek_v4", (1, 2)),
          ("auto", "nemotron_h", (2, 1)),
          ("mooncake", "nemotron_h", (1, 2)), ("mooncake", "gpt_oss", (2, 4)),
          ("nixl", "deepseek_v32", (2, 1)), ("nixl", "deepseek_v4", (2, 1))]


class Planned:
    """A transfer that drives ``real`` and, beside it, the in-process planner without
    moving anything: ``planned[rid]`` is what the planner says each request moves."""

    def __init__(self, real: SessionLink, planner: LocalTransfer) -> None:
        self.real, self.planner = real, planner
        self.planned: dict[int, dict[str, int]] = {}

    def open(self, rid: int, decode_rank: int, lists: Mapping[str, ItemList],
             prefix_len: int) -> None:
        self.planner.open(rid, decode_rank, lists, prefix_len)
        self.real.open(rid, decode_rank, lists, prefix_len)

    def start(self, rid: int, prefill_rank: int, num_pages: int, aux_row: int) -> int:
        expect = self.planner.start(rid, prefill_rank, num_pages, aux_row)
        prefix = self.real.start(rid, prefill_rank, num_pages, aux_row)
        assert prefix == expect, f"request {rid}: session prefix {prefix}, decode's {expect}"
        return prefix

    def send(self, rid: int, prefill_rank: int, chunk: Chunk) -> None:
        self.planner.send(rid, prefill_rank, chunk)
        self.real.send(rid, prefill_rank, chunk)

    def settle(self, rid: int, prefill_rank: int) -> None:
        self.real.settle(rid, prefill_rank)

    def wait(self, rid: int) -> TransferReport:
        self.planned[rid] = self.planner.wait(rid).bytes_by_component
        return self.real.wait(rid)


@pytest.fixture(scope="module")
def bootstrap_url() -> Iterator[str]:
    """One bootstrap server for the module: each case's agents deregister on close."""
    with BootstrapServer() as srv:
        yield srv.url


def handoff(url: str, arch: str, pair: tuple[int, int], *, transport: str = "tcp",
            hit: bool = False, corrupt: str | None = None
            ) -> tuple[RunResult, dict[int, dict[str, int]]]:
    """Run ``arch``'s prompts from prefill TP ``pair[0]`` to decode TP ``pair[1]`` over the
    session layer and ``transport``; the result and the planner's bytes per request."""
    lengths, chunk = SETUP[arch]
    links: list[Planned] = []

    def factory(p: Sequence[RankPools], d: Sequence[RankPools]) -> Planned:
        real = SessionLink(p, d, url, transport=transport, timeout=30.0)
        links.append(Planned(real, LocalTransfer(p, d, plan_only=True)))
        return links[-1]

    try:
        result = run_disaggregated(arch, sample_prompts(lengths, seed=9), prefill_tp=pair[0],
                                   decode_tp=pair[1], chunk=chunk, prefix_hit=hit,
                                   max_new_tokens=NEW_TOKENS, corrupt=corrupt,
                                   transfer=factory)
    finally:
        for link in links:
            link.real.close()
    (link,) = links
    return result, link.planned


def check(result: RunResult, planned: dict[int, dict[str, int]],
          moved: frozenset[str] = frozenset({"kv", "aux"})) -> None:
    bad = [f"rid {r.rid} len {r.prompt_len}: tokens {r.disaggregated} vs {r.colocated}; "
           f"state: {r.state_diff or 'equal'}" for r in result.requests if not r.ok]
    assert result.ok, "\n".join([*bad, f"leaks: {result.leaks}"])
    assert not any(result.leaks.values()), result.leaks
    for r in result.requests:
        assert len(r.disaggregated) == NEW_TOKENS
        assert moved <= set(r.bytes_by_component)
        assert r.bytes_by_component == planned[r.rid], f"rid {r.rid}"


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"tp{p[0]}to{p[1]}")
@pytest.mark.parametrize("arch", CORE)
def test_engine_over_sessions_and_tcp(bootstrap_url: str, arch: str, pair: tuple[int, int]
                                      ) -> None:
    # 1 -> 2 also hands off a donor first, so decode's prefix cache holds the first pages
    result, planned = handoff(bootstrap_url, arch, pair, hit=pair == (1, 2))
    check(result, planned)
    if pair == (1, 2):
        assert any(r.prefix_len for r in result.requests), "no request hit the prefix cache"


@pytest.mark.parametrize("pair", [(2, 1), (1, 2)], ids=lambda p: f"tp{p[0]}to{p[1]}")
def test_all_sliding_window_attention_over_tcp(bootstrap_url: str, pair: tuple[int, int]
                                               ) -> None:
    """Every attention layer sliding-window (Mistral-7B-v0.1's config): the layout has
    no KV component, so prefill announces no KV pages and the window pages move with the
    last chunk (this failed at the first request: "init announced 2 KV pages but the
    layout has no KV"). 1 -> 2 also hits decode's prefix cache below the window."""
    result, planned = handoff(bootstrap_url, "mistral", pair, hit=pair == (1, 2))
    check(result, planned, frozenset({"swa", "aux"}))
    assert all("kv" not in r.bytes_by_component for r in result.requests)
    if pair == (1, 2):
        assert any(r.prefix_len for r in result.requests), "no request hit the prefix cache"


def test_attention_free_ssm_over_tcp(bootstrap_url: str) -> None:
    """Mamba2 (cache_params, no attention): only the state slot and aux move, over a real
    session; prefill announces no KV pages."""
    result, planned = handoff(bootstrap_url, "mamba2", (2, 1))
    check(result, planned, frozenset({"mamba", "aux"}))
    assert all(set(r.bytes_by_component) == {"mamba", "aux"} for r in result.requests)


@pytest.mark.parametrize(("transport", "arch", "pair"), OTHERS,
                         ids=[f"{t}-{a}-tp{p[0]}to{p[1]}" for t, a, p in OTHERS])
def test_engine_over_other_transports(bootstrap_url: str, transport: str, arch: str,
                                      pair: tuple[int, int]) -> None:
    ok, reason = available_transports()[transport]
    if not ok:
        pytest.skip(f"transport {transport!r} is not usable here: {reason}")
    result, planned = handoff(bootstrap_url, arch, pair, transport=transport,
                              hit=arch == "qwen3_next")
    check(result, planned)


def test_corrupted_byte_over_tcp_fails_the_check(bootstrap_url: str) -> None:
    """The check can fail: one flipped byte of received GDN conv state on decode."""
    result, _ = handoff(bootstrap_url, "qwen3_next", (2, 1), corrupt="mamba/conv")
    assert not result.ok and not any(r.ok for r in result.requests)
    assert all("mamba" in r.state_diff for r in result.requests), \
        [r.state_diff for r in result.requests]
    assert not any(result.leaks.values()), result.leaks


def test_shm_refuses_decode_memory_that_cannot_move(bootstrap_url: str) -> None:
    """shm writes only into its own allocate()d memory: a decode endpoint that cannot
    move its buffers there is refused up front, naming the transport."""
    shape = prepare("llama").arch.shape
    pools = RankPools(rank_layout(shape, PoolConfig(page_size=4, num_pages=8, num_slots=2),
                                  tp_rank=0, tp_size=1))

    class Fixed:  # an Endpoint without relocate()
        layout, memory = pools.layout, pools.memory

    with pytest.raises(LinkError, match="transport 'shm' writes only into memory from its "
                                        r"allocate\(\)"):
        SessionLink([pools], [Fixed()], bootstrap_url, transport="shm")


def test_the_reference_engine_keys_its_data_plane(bootstrap_url: str, tmp_path: Path) -> None:
    """The engine's ranks open their transports as every engine's (the kit's
    ``open_rank``): keyed by the deployment secret. A peer that holds the endpoint (its
    token) but not the secret — what every engine rank was before — is refused at the
    data-plane handshake; a peer with the secret gets in."""
    cfg = SessionConfig(secret_file=write_secret_file(tmp_path / "secret"))
    shape = prepare("llama").arch.shape
    pools = RankPools(rank_layout(shape, PoolConfig(page_size=4, num_pages=8, num_slots=2),
                                  tp_rank=0, tp_size=1))
    link = DecodeLink([pools], bootstrap_url, transport="tcp", config=cfg)
    try:
        endpoint = link.agents[0].transport.endpoint()
        with create_transport("tcp") as stranger, \
                pytest.raises(ConnectError, match="data-plane handshake failed"):
            stranger.connect(endpoint)
        with open_transport(cfg.replace(transport="tcp")) as keyed:
            keyed.connect(endpoint)
    finally:
        link.close()
