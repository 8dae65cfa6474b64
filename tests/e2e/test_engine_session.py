"""The engine over the real session layer: Sender / Receiver, bootstrap server, tcp.

Same checks as the in-process handoff (tokens, byte-exact state, no leaks), and the
bytes counted on decode equal what the in-process planner moved."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvhandoff.engine import run_disaggregated, sample_prompts  # noqa: E402
from kvhandoff.engine.pools import RankPools  # noqa: E402
from kvhandoff.engine.session_link import SessionLink  # noqa: E402
from kvhandoff.session.bootstrap import BootstrapServer  # noqa: E402

torch.set_num_threads(1)

CASES = [("llama", (2, 4), False), ("qwen3_next", (1, 2), True), ("gpt_oss", (2, 1), True),
         ("deepseek_v32", (2, 4), False), ("deepseek_v4", (1, 2), False)]


@pytest.mark.parametrize(("arch", "pair", "hit"), CASES, ids=[c[0] for c in CASES])
def test_engine_over_sessions_and_tcp(arch: str, pair: tuple[int, int], hit: bool) -> None:
    lengths, chunk = ([130, 300], 64) if arch == "deepseek_v4" else ([5, 16, 23, 37], 6)
    prompts = sample_prompts(lengths, seed=9)
    links: list[SessionLink] = []
    with BootstrapServer() as srv:
        def factory(p: Sequence[RankPools], d: Sequence[RankPools]) -> SessionLink:
            links.append(SessionLink(p, d, srv.url, timeout=30.0))
            return links[-1]
        try:
            result = run_disaggregated(arch, prompts, prefill_tp=pair[0], decode_tp=pair[1],
                                       chunk=chunk, prefix_hit=hit, transfer=factory)
        finally:
            for link in links:
                link.close()
    assert result.ok, [r.state_diff for r in result.requests]
    assert not any(result.leaks.values()), result.leaks
    local = run_disaggregated(arch, prompts, prefill_tp=pair[0], decode_tp=pair[1],
                              chunk=chunk, prefix_hit=hit)
    for a, b in zip(result.requests, local.requests, strict=True):
        assert a.disaggregated == b.disaggregated
        assert a.bytes_by_component == b.bytes_by_component
