"""Greedy output with and without the draft: a bf16 near-tie told from a real mismatch.

In bf16 the verifier's k+1-token verify pass (with the draft) and its 1-token step (without) round
different sums, so where its top two logits are nearly tied the greedy choice can flip: the outputs
then differ although nothing is broken. At the first difference of each prompt the baseline engine's
top-2 logprobs decide: the two engines' tokens must be those two (in either order: at an exact tie the
list may name first the token greedy did not take, measured on the DeepSeek toy in bf16, docs/targets.md),
and their margin (top-1 minus top-2 logprob, which equals the logit margin) within
``NEAR_TIE_MARGIN[dtype]``. Anything else is a real mismatch. Later tokens of a prompt that diverged
continue another text and are not compared.

The bounds: bf16 keeps 8 significant bits, so logits of 16-32 are stored 0.125 apart and the two passes
sum in different orders through every layer; top logits within 4 such steps (0.5) may swap. fp16 has 3
more bits (0.0625). fp32 is the exact check (0: any difference fails).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

NEAR_TIE_MARGIN = {"bfloat16": 0.5, "float16": 0.0625, "float32": 0.0}
TOP_LOGPROBS = 2  # the baseline engine's logprobs per generated token the check needs


@dataclass(frozen=True)
class NearTie:
    """A prompt whose outputs first differ where the baseline verifier's top two tokens are nearly tied."""

    prompt: int
    position: int  # generated-token index of the first difference
    baseline_token: int  # the verifier's greedy choice without the draft (its top 1)
    speculative_token: int  # the token chosen with the draft (the baseline's top 2)
    margin: float  # top-1 minus top-2 logprob (= logit) margin of the baseline verifier there

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def classify_divergences(
    base_tokens: Sequence[Sequence[int]],
    spec_tokens: Sequence[Sequence[int]],
    base_top: Sequence[Sequence[Sequence[tuple[int, float]]]],
    margin_bound: float,
) -> tuple[list[NearTie], str | None]:
    """Every prompt whose outputs differ, at its first difference: a ``NearTie`` when the two tokens are the
        baseline verifier's top two there with a margin within ``margin_bound``; else (the first such prompt)
        a description of the real mismatch, with the margin when known. ``base_top``: the baseline's top
    ``TOP_LOGPROBS`` (token, logprob) per prompt and generated token, best first. Later tokens of a prompt that diverged
        continue another text and are not compared."""
    ties: list[NearTie] = []
    for i, (a, b) in enumerate(zip(base_tokens, spec_tokens, strict=True)):
        if a == b:
            continue
        j = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        x = a[j] if j < len(a) else "<end>"
        y = b[j] if j < len(b) else "<end>"
        where = f"prompt {i}, generated token {j}: {x} without the draft, {y} with it"
        top = base_top[i][j] if i < len(base_top) and j < len(base_top[i]) else ()
        if len(top) < 2 or isinstance(x, str) or isinstance(y, str):
            return ties, f"{where} (no verifier logprobs there to tell a near-tie)"
        (first, first_lp), (second, second_lp) = top[0], top[1]
        margin = abs(first_lp - second_lp)
        # either order: at an exact tie vLLM's top-logprob list may name first the token greedy did not take
        if {first, second} != {x, y}:
            return ties, f"{where} (not the verifier's top two there: {first}, {second})"
        if margin > margin_bound:
            return ties, f"{where} (verifier top-2 margin {margin:.4g} > near-tie bound {margin_bound})"
        ties.append(NearTie(i, j, int(x), int(y), float(margin)))
    return ties, None
