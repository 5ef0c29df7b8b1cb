"""Offline speculative rounds: the rounds greedy speculative decoding would run over a stored sequence.

Why per-token accuracy does not predict online acceptance: a round starts right after the token the
previous round got wrong (or after ``k`` accepted drafts), so easy stretches are crossed in few rounds
and hard stretches in many. The share of *rounds* whose first draft is accepted (online position-1
acceptance) therefore weighs hard positions more than the share of *tokens* whose step-0 draft is right
(the trainer's step-0 accuracy). ``simulate_rounds`` replays the online round walk on TTT's per-token
hits, so its figures are the online ones on the same tokens (tests/integration/test_offline_online.py).

Round walk over one supervised span ``[a, b)`` of a sample (rows as in ``eagle3.draft_trainer.ttt``: step ``k``
at row ``t`` predicts token ``t+k+2``): the first round sits at row ``a-1`` (the prompt is committed and
the verifier has produced token ``a``), accepts the leading run of hits ``hits[0..K-1, t]`` (``acc``
drafts) and the next round sits at row ``t + acc + 1``; rounds run while ``t + 2 < b`` (a token is left
to draft: online, generation stops once the last token of the span, EOS or the length limit, is out).
Exactness: a step ``j`` chain draft online reads the drafts ``d_1..d_j``; in a counted run they equal the
stored tokens that TTT reads, so the run is the online one (given the same features and verifier argmax).
Drafts past the span count as rejected (online they may match the verifier's next turn: a small bias on
a span's last round).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RoundCounts:
    """Sums over rounds (add them across batches and ranks); ``k`` draft tokens per round."""

    k: int
    rounds: int = 0
    accepted: int = 0  # drafts accepted, summed over rounds
    at_least: list[int] = field(default_factory=list)  # [k] rounds accepting >= i+1 drafts

    def __post_init__(self) -> None:
        if not self.at_least:
            self.at_least = [0] * self.k

    def add_round(self, n_accepted: int) -> None:
        self.rounds += 1
        self.accepted += n_accepted
        for i in range(n_accepted):
            self.at_least[i] += 1

    def merge(self, other: RoundCounts) -> None:
        self.rounds += other.rounds
        self.accepted += other.accepted
        self.at_least = [a + b for a, b in zip(self.at_least, other.at_least, strict=True)]

    def as_tensor(self) -> torch.Tensor:
        """[2 + k] float64 (rounds, accepted, at_least...) for an all-reduce."""
        return torch.tensor([self.rounds, self.accepted, *self.at_least], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> RoundCounts:
        ints = [round(float(v)) for v in values.tolist()]
        return cls(len(ints) - 2, ints[0], ints[1], ints[2:])

    @property
    def tau(self) -> float:
        """Mean tokens per verifier forward, 1 + mean accepted drafts (0 rounds: 1.0)."""
        return 1.0 + self.accepted / max(1, self.rounds)

    @property
    def accepted_per_position(self) -> list[float]:
        """[k] share of rounds accepting >= i+1 drafts (position 1 = the first draft)."""
        return [n / max(1, self.rounds) for n in self.at_least]


def supervised_spans(loss_mask: list[bool], start: int, end: int) -> list[tuple[int, int]]:
    """Maximal runs ``[a, b)`` of supervised rows inside the sample ``[start, end)``."""
    spans: list[tuple[int, int]] = []
    a = None
    for row in range(start, end):
        if loss_mask[row] and a is None:
            a = row
        elif not loss_mask[row] and a is not None:
            spans.append((a, row))
            a = None
    if a is not None:
        spans.append((a, end))
    return spans


def simulate_rounds(
    hits: torch.Tensor,
    loss_mask: torch.Tensor,
    seg_start: torch.Tensor,
    seg_end: torch.Tensor,
    max_new_tokens: int | None = None,
) -> RoundCounts:
    """The online round walk (module docstring) over every sample of a packed batch.

    ``hits`` [K, T] bool (``TTTResult.hits`` stacked); ``loss_mask``, ``seg_start``, ``seg_end`` [T] as in
    ``PackedBatch``. ``max_new_tokens``: online generation stops after that many tokens of a span (a
    round runs while fewer are out); the stored span may go on, so the last round's chain is scored on
    real tokens (exact, where the stored sequence runs ``k`` tokens past the limit)."""
    k, n = hits.shape
    runs = torch.cumprod(hits.T.to(torch.int64), dim=1).sum(1).tolist()  # [T] leading hits at each row
    mask = loss_mask.tolist()
    starts, ends = seg_start.tolist(), seg_end.tolist()
    counts = RoundCounts(k)
    row = 0
    while row < n:
        s, e = starts[row], ends[row]
        for a, b in supervised_spans(mask, s, e):
            t = max(a - 1, s)
            stop = b if max_new_tokens is None else min(b, a + max_new_tokens)
            while t + 2 < stop:
                counts.add_round(runs[t])
                t += runs[t] + 1
        row = e
    return counts
