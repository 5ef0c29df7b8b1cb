"""Offline metrics against online speculative decoding, on exactly the same tokens.

For each prompt: speculative decoding (``speculate.speculative_generate``) produces the verifier's
greedy output and the online rounds; the verifier's greedy continuation (``k`` tokens longer, so the
last round's chain is scored on real tokens) is then extracted (the server's taps, cast to bf16 as the
features store keeps them) and scored offline by ``ttt.ttt_forward`` as the trainer scores held-out
data. Three pairs of figures, each pair on the same positions:

* per token: the draft's step-0 token at every generated position, online (recorded while decoding)
  and offline (TTT step 0);
* per round: position-1 acceptance and τ, online (the verifier's counters) and offline
  (``rounds.simulate_rounds`` over TTT's hits);
* the trainer's filtered step-0 accuracy (terms whose teacher argmax is outside the draft vocab
  dropped), for reference: the figure training logs.

Invariant (tests/integration/test_offline_online.py): the per-token pair and the per-round pair agree
up to bf16 feature noise; per-token and per-round figures differ by the round walk's selection of
positions (``eagle3.draft_trainer.rounds``), which is why offline τ is simulated, not multiplied out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from eagle3.draft_trainer.model import EagleDraft
from eagle3.draft_trainer.rounds import RoundCounts, simulate_rounds
from eagle3.draft_trainer.speculate import VerifierTaps, greedy_generate, speculative_generate
from eagle3.draft_trainer.ttt import PackedBatch, Teacher, ttt_forward

Extract = Callable[[list[int]], torch.Tensor]  # ids [T] -> [T, n_aux + 1, H]: aux states then the final state


@dataclass
class OfflineOnline:
    k: int
    n_sequences: int = 0
    tokens: int = 0  # generated positions scored per token
    identical: bool = True  # speculative output == greedy output on every prompt
    online_step0_hits: int = 0
    offline_step0_hits: int = 0
    oov: int = 0  # positions whose teacher argmax lies outside the draft vocab (never accepted online)
    teacher_differs: int = 0  # positions where the bf16 features' teacher argmax != the fp32 greedy token
    step0_disagree: int = 0  # positions where the online and offline step-0 verdicts differ (bf16 vs fp32 inputs)
    online: RoundCounts = field(init=False)  # the verifier's rounds
    offline: RoundCounts = field(init=False)  # simulated on the features

    def __post_init__(self) -> None:
        self.online, self.offline = RoundCounts(self.k), RoundCounts(self.k)

    @property
    def online_step0(self) -> float:
        return self.online_step0_hits / max(1, self.tokens)

    @property
    def offline_step0(self) -> float:
        return self.offline_step0_hits / max(1, self.tokens)

    @property
    def offline_step0_filtered(self) -> float:
        """The trainer's counting: out-of-vocab targets dropped from the denominator."""
        return self.offline_step0_hits / max(1, self.tokens - self.oov)

    def to_dict(self) -> dict[str, Any]:
        out = {key: value for key, value in asdict(self).items() if key not in ("online", "offline")}
        for name, counts in (("online", self.online), ("offline", self.offline)):
            out[f"{name}_rounds"] = counts.rounds
            out[f"{name}_tau"] = counts.tau
            out[f"{name}_accepted_per_position"] = counts.accepted_per_position
        out.update(
            online_step0=self.online_step0,
            offline_step0=self.offline_step0,
            offline_step0_filtered=self.offline_step0_filtered,
        )
        return out

    def format_text(self) -> str:
        def pct(values: list[float]) -> str:
            return " / ".join(f"{100 * v:.1f}" for v in values)

        return "\n".join(
            [
                f"offline vs online on the same {self.n_sequences} greedy sequences "
                f"({self.tokens} positions, k={self.k})",
                f"  per token, step-0 draft right   online {100 * self.online_step0:.1f}%  offline "
                f"{100 * self.offline_step0:.1f}%  (trainer's count, out-of-vocab dropped: "
                f"{100 * self.offline_step0_filtered:.1f}%; out of vocab {100 * self.oov / max(1, self.tokens):.1f}%)",
                f"  per round, accepted at position online {pct(self.online.accepted_per_position)} % "
                f"({self.online.rounds} rounds)  offline {pct(self.offline.accepted_per_position)} % "
                f"({self.offline.rounds} rounds)",
                f"  tau                             online {self.online.tau:.3f}  offline {self.offline.tau:.3f}",
                f"  step-0 verdicts differing online/offline at {self.step0_disagree} positions; "
                "bf16 teacher argmax != "
                f"fp32 greedy token at {self.teacher_differs}; output identical to greedy: "
                f"{'yes' if self.identical else 'NO'}",
            ]
        )


def taps_extract(verifier: Any, taps: VerifierTaps) -> Extract:
    """Features of a sequence from the verifier in this process (the server's hf backend taps the same
    modules; its fp32 states are what the client casts to bf16)."""

    @torch.inference_mode()
    def extract(ids: list[int]) -> torch.Tensor:
        verifier(input_ids=torch.tensor([ids]))
        return taps.states()

    return extract


def sequence_batch(states: torch.Tensor, ids: list[int], n_prompt: int) -> PackedBatch:
    """One sample as the trainer loads it: bf16-rounded features, loss mask 1 after the prompt."""
    n = len(ids)
    stored = states.to(torch.bfloat16).float()  # [T, L, H] what the features directory keeps
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        aux=stored[:, :-1].reshape(n, -1),
        final=stored[:, -1],
        loss_mask=torch.tensor([False] * n_prompt + [True] * (n - n_prompt)),
        positions=torch.arange(n),
        seg_start=torch.zeros(n, dtype=torch.int64),
        seg_end=torch.full((n,), n, dtype=torch.int64),
    )


@torch.no_grad()
def compare_offline_online(
    verifier: Any,
    draft: EagleDraft,
    teacher: Teacher,
    taps: VerifierTaps,
    prompts: Sequence[list[int]],
    *,
    k: int,
    max_new_tokens: int,
    eos_id: int | None,
    extract: Extract | None = None,
) -> OfflineOnline:
    """The figures of the module docstring over ``prompts``; ``extract`` defaults to ``taps_extract``."""
    extract = extract or taps_extract(verifier, taps)
    report = OfflineOnline(k)
    for prompt in prompts:
        step0: list[int] = []
        spec = speculative_generate(verifier, draft, taps, prompt, k, max_new_tokens, eos_id, step0_tokens=step0)
        for accepted in spec.accepted:
            report.online.add_round(accepted)
        longer = greedy_generate(verifier, prompt, max_new_tokens + k, eos_id).tokens
        report.identical &= longer[: len(spec.tokens)] == spec.tokens
        ids = list(prompt) + longer
        batch = sequence_batch(extract(ids), ids, len(prompt))
        hits = torch.stack(ttt_forward(draft, teacher, batch, k).hits)  # [K, T]
        report.offline.merge(simulate_rounds(hits, batch.loss_mask, batch.seg_start, batch.seg_end, max_new_tokens))
        # per token: rows t predicting a generated token t+2 that online also ran step 0 on
        p = len(prompt)
        rows = range(max(0, p - 2), min(len(step0), p + len(spec.tokens) - 2))
        teacher_ids = teacher(batch.final).argmax(-1)  # [T] full-vocab argmax at each row
        for t in rows:
            target = ids[t + 2]
            report.tokens += 1
            online_hit, offline_hit = step0[t] == target, bool(hits[0, t])
            report.online_step0_hits += int(online_hit)
            report.offline_step0_hits += int(offline_hit)
            report.step0_disagree += int(online_hit != offline_hit)
            report.oov += int(not bool(draft.t2d[int(teacher_ids[t + 1])]))
            report.teacher_differs += int(int(teacher_ids[t + 1]) != target)
        report.n_sequences += 1
    return report
