"""What ``eagle3 eval --engine vllm`` returns: one engine's run and the comparison report
(``draft_trainer/evaluate_vllm.py`` fills them; its module docstring states what a report guarantees)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class EngineRun:
    """One engine's result. ``token_ids[i]`` are the tokens generated for prompt ``i``."""

    load_s: float
    generate_s: float
    n_generated_tokens: int
    token_ids: tuple[tuple[int, ...], ...]
    spec_counters: dict[str, Any]  # metric name -> int or list[int] (difference around generate)
    # per prompt, per generated token: the top TOP_LOGPROBS (token id, logprob), best first (baseline only)
    top_logprobs: tuple[tuple[tuple[tuple[int, float], ...], ...], ...] = ()

    @property
    def tokens_per_s(self) -> float:
        return self.n_generated_tokens / self.generate_s if self.generate_s > 0 else 0.0


@dataclass(frozen=True)
class VllmSpecReport:
    export_dir: str
    model_dir: str
    k: int
    dtype: str
    n_prompts: int
    n_prompt_tokens: int
    n_generated_tokens: int
    outputs_identical: bool
    first_mismatch: str | None
    n_drafts: int  # verifier steps that checked a draft
    n_draft_tokens: int  # drafted tokens (= n_drafts * k unless a request ends early)
    n_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]  # (k,)
    mean_acceptance_length: float  # τ_vllm = 1 + accepted / drafts
    acceptance_rate_per_pos: tuple[float, ...]  # (k,) accepted_per_pos / drafts
    baseline_tokens_per_s: float
    speculative_tokens_per_s: float
    baseline_load_s: float
    speculative_load_s: float
    generated_token_ids: tuple[tuple[int, ...], ...] = ()  # per prompt, with the draft (== without when identical)
    near_ties: tuple[dict[str, Any], ...] = ()  # NearTie.to_dict() of each prompt that diverged at a near-tie
    near_tie_margin: float = 0.0  # the bound they were held to (NEAR_TIE_MARGIN[dtype])
    # share of the verifier's generated tokens (without the draft) that the draft's vocabulary lacks: tokens it
    # can never propose (vocab.outside_share); None when the checkpoint stores no d2t (the whole vocabulary)
    outside_vocab_share: float | None = None

    @property
    def speedup(self) -> float:
        return self.speculative_tokens_per_s / self.baseline_tokens_per_s if self.baseline_tokens_per_s else 0.0

    def to_json(self) -> dict[str, Any]:
        """The figures (no token ids), for JSON output."""
        data = asdict(self)
        del data["generated_token_ids"]
        return {**data, "speedup": self.speedup}

    def format_text(self) -> str:
        per_pos = "  ".join(f"{r:.3f}" for r in self.acceptance_rate_per_pos)
        same = "identical" if self.outputs_identical else f"DIFFERENT ({self.first_mismatch})"
        if self.near_ties and self.first_mismatch is None:
            widest = max(t["margin"] for t in self.near_ties)
            same = (
                f"identical up to {len(self.near_ties)} {self.dtype} near-tie(s) (verifier top-2 margin at the "
                f"divergence <= {widest:.3g}, bound {self.near_tie_margin})"
            )
        lines = [
            f"vLLM speculative decoding (eagle3, k={self.k}, {self.dtype}): {self.export_dir}",
            f"  verifier          {self.model_dir}",
            f"  prompts           {self.n_prompts} ({self.n_prompt_tokens:,} prompt tokens, "
            f"{self.n_generated_tokens:,} generated)",
            f"  greedy output     {same} with and without the draft",
            f"  acceptance (vLLM) tau = {self.mean_acceptance_length:.3f} tokens per verifier step "
            f"({self.n_accepted_tokens:,} accepted of {self.n_draft_tokens:,} drafted, "
            f"{self.n_drafts:,} drafts)",
            f"  per position      {per_pos}",
            f"  tokens/s          {self.baseline_tokens_per_s:.1f} without, "
            f"{self.speculative_tokens_per_s:.1f} with the draft (x{self.speedup:.2f})",
        ]
        if self.outside_vocab_share is not None:
            lines.append(
                f"  outside the vocab {100 * self.outside_vocab_share:.1f}% of the verifier's tokens are not in the "
                "draft vocabulary (never proposed)"
            )
        return "\n".join(lines)
