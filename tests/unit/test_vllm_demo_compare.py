"""The demo's verdict on a handoff's tokens: exact, a near-tie of the local run, or wrong."""

from __future__ import annotations

from kvhandoff.lab.vllm.demo import Completion, compare


def _c(tokens: list[int], gap: float = 1.0) -> Completion:
    """Greedy ``tokens`` whose runner-up (token + 100) trails by ``gap`` nats each."""
    return Completion(tokens, [{t: -0.1, t + 100: -0.1 - gap} for t in tokens])


def test_identical_tokens_pass() -> None:
    assert compare(_c([1, 2, 3]), _c([1, 2, 3])).mark == "✓"


def test_a_split_at_an_exact_tie_of_the_local_run_is_a_near_tie() -> None:
    ref = _c([1, 2, 3], gap=0.0)
    got = Completion([1, 102, 7], ref.top)
    m = compare(got, ref)
    assert m.mark == "≈" and "token 2 is 102, local 2" in m.detail


def test_a_split_where_the_local_run_was_sure_fails() -> None:
    ref = _c([1, 2, 3], gap=2.0)
    assert compare(Completion([1, 102, 3], ref.top), ref).mark == "✗"
    assert compare(Completion([1, 55, 3], ref.top), ref).mark == "✗"  # not even in its top


def test_missing_or_empty_output_fails() -> None:
    assert compare(_c([]), _c([])).mark == "✗"
    assert compare(_c([1, 2]), _c([1, 2, 3])).mark == "✗"
