"""The offline round walk (draft_trainer.rounds) on hand-built hits: where rounds start, what they accept,
spans, sample boundaries and the length limit; and why per-round acceptance sits below per-token accuracy."""

from __future__ import annotations

import torch

from eagle3.draft_trainer.rounds import RoundCounts, simulate_rounds, supervised_spans


def _one_sample(hits: list[list[int]], n_prompt: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    k_steps, n = len(hits), len(hits[0])
    mask = torch.tensor([False] * n_prompt + [True] * (n - n_prompt))
    return (torch.tensor(hits, dtype=torch.bool).reshape(k_steps, n), mask, torch.zeros(n, dtype=torch.int64),
            torch.full((n,), n, dtype=torch.int64))  # fmt: skip


def test_rounds_start_after_the_accepted_run_and_the_bonus_token() -> None:
    # 10 rows, prompt 3 (first generated token at row 3): rounds sit at rows 2, then 2+a+1, ... while t+2 < 10
    step0 = [0, 0, 1, 0, 1, 1, 0, 1, 0, 0]
    step1 = [0, 0, 1, 0, 1, 0, 0, 0, 0, 0]
    counts = simulate_rounds(*_one_sample([step0, step1], 3))
    # row 2: accepts 2 (steps 0 and 1) -> row 5: accepts 1 -> row 7: accepts 1 -> row 9: 9+2 >= 10, stop
    assert (counts.rounds, counts.accepted, counts.at_least) == (3, 4, [3, 1])
    assert counts.tau == 1 + 4 / 3
    assert counts.accepted_per_position == [1.0, 1 / 3]


def test_a_missed_step_stops_the_chain_even_if_later_steps_hit() -> None:
    counts = simulate_rounds(*_one_sample([[0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1]], 1))
    # rows 0..3: nothing accepted at any, each round advances one row
    assert (counts.rounds, counts.accepted) == (4, 0)


def test_length_limit_and_sample_boundaries() -> None:
    hits = torch.ones(1, 12, dtype=torch.bool)
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
    starts = torch.tensor([0] * 6 + [6] * 6)
    ends = torch.tensor([6] * 6 + [12] * 6)
    counts = simulate_rounds(hits, mask, starts, ends)
    # each sample: span [2, 6) rounds at rows 1 (a=1) and 3 (a=1); row 5: 5+2 >= 6
    assert (counts.rounds, counts.accepted) == (4, 4)
    limited = simulate_rounds(hits, mask, starts, ends, max_new_tokens=2)
    assert (limited.rounds, limited.accepted) == (2, 2)  # one round per sample: 2 tokens are out after it
    assert supervised_spans([False, True, True, False, True], 0, 5) == [(1, 3), (4, 5)]


def test_per_round_acceptance_weighs_hard_stretches_more_than_per_token_accuracy() -> None:
    # an easy stretch (all hit) then a hard one (none hit): half the tokens hit at step 0, but the easy
    # stretch is crossed in few rounds, so far fewer than half of the rounds accept their first draft
    easy, hard = [1] * 40, [0] * 40
    counts = simulate_rounds(*_one_sample([easy + hard] * 4, 1))
    per_token = sum(easy) / (len(easy) + len(hard))
    assert per_token == 0.5
    assert counts.accepted_per_position[0] < 0.25


def test_round_counts_add_up_across_batches() -> None:
    a, b = RoundCounts(2), RoundCounts(2)
    a.add_round(2)
    b.add_round(0)
    b.add_round(1)
    a.merge(b)
    assert (a.rounds, a.accepted, a.at_least) == (3, 3, [2, 1])
    assert RoundCounts.from_tensor(a.as_tensor()) == a
