"""server/pass_cost.py: the model of an extraction pass's cost that the fairness clock charges."""

from __future__ import annotations

import pytest

from eagle3.server.pass_cost import PassCost

MAX = 1024
FIXED_S, TOKEN_S = 0.02, 5e-5  # a pass of 1,024 tokens: 71 ms; of 128: 26 ms (a third of it)


def seconds(n: int) -> float:
    return FIXED_S + TOKEN_S * n


def test_until_both_kinds_of_pass_are_seen_an_extraction_costs_its_tokens() -> None:
    cost = PassCost(MAX)
    assert cost.extraction(128) == 128.0
    cost.observe(MAX, seconds(MAX))
    assert cost.extraction(128) == 128.0  # no small pass yet: the fixed time is unknown
    assert cost.token_rate_s == pytest.approx(MAX / seconds(MAX))


def test_the_fit_finds_the_fixed_and_per_token_time_and_a_full_pass_costs_its_tokens() -> None:
    cost = PassCost(MAX)
    for n in (MAX, 128, 960, 64, MAX, 96):
        cost.observe(n, seconds(n))
    fixed_s, token_s = cost.fixed_and_per_token_s() or (0.0, 0.0)
    assert fixed_s == pytest.approx(FIXED_S) and token_s == pytest.approx(TOKEN_S)
    full = cost._full[0] if cost._full else 0.0
    assert cost.extraction(int(full)) == pytest.approx(full, rel=1e-3)
    # a lane pass of 128 tokens costs what it takes: about a third of a full pass, not an eighth
    assert cost.extraction(128) == pytest.approx(seconds(128) * cost.token_rate_s)
    assert cost.extraction(128) > 2.5 * 128


@pytest.mark.parametrize("small_s", [seconds(MAX) * 1.5, seconds(MAX)])
def test_a_noisy_model_falls_back_to_tokens(small_s: float) -> None:
    """Small passes as slow as full ones (another process took the CPU): no negative per-token time."""
    cost = PassCost(MAX)
    cost.observe(MAX, seconds(MAX))
    cost.observe(64, small_s)
    assert cost.fixed_and_per_token_s() is None
    assert cost.extraction(64) == 64.0


def test_generate_time_is_charged_at_the_full_passes_rate() -> None:
    cost = PassCost(MAX)
    assert cost.token_equivalents(0.5, 12) == 12.0  # no extraction seen yet
    cost.observe(16, seconds(16))  # a small pass: its extractions were charged their tokens
    assert cost.token_equivalents(seconds(16), 12) == pytest.approx(16)  # time on that scale, not 12
    cost.observe(MAX, seconds(MAX))
    assert cost.token_equivalents(seconds(MAX), 12) == pytest.approx(MAX)
