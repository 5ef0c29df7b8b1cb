"""``eagle3 eval``: offline acceptance on held-out features, and real speculative decoding on CPU.

τ (mean acceptance length) = mean over rounds of (accepted drafts + 1): the tokens one verifier
forward yields. Offline τ replays the same round walk on the held-out features
(``eagle3.draft_trainer.rounds``): a product of per-token accuracies overstates it, because rounds start
where the draft just failed and so sample hard positions more than tokens do.
Speedup = the verifier alone's wall time / speculative wall time over the same
prompts, both greedy with KV cache. Prompts come from the prepared dataset and exclude every prompt
present in the features directory (the training data), so they were not trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3.core.features_union import open_features
from eagle3.core.progress import ProgressBar
from eagle3.core.protocol.prepared import is_heldout, iter_prepared
from eagle3.draft_trainer.data import FeaturesData
from eagle3.draft_trainer.errors import CheckpointError, DataError
from eagle3.draft_trainer.export import read_export
from eagle3.draft_trainer.model import DraftConfig, EagleDraft
from eagle3.draft_trainer.offline_online import compare_offline_online
from eagle3.draft_trainer.rounds import RoundCounts, simulate_rounds
from eagle3.draft_trainer.speculate import VerifierTaps, greedy_generate, speculative_generate
from eagle3.draft_trainer.ttt import Teacher, load_verifier_tensors, ttt_forward
from eagle3.draft_trainer.vocab import outside_share


@dataclass
class EvalResult:
    k: int
    n_prompts: int
    tau: float  # mean tokens per verifier forward in speculative decoding
    speedup: float  # baseline seconds / speculative seconds
    rounds: int
    generated_tokens: int
    speculative_s: float
    baseline_s: float
    identical: bool  # every speculative output == the verifier's greedy output
    accepted_per_position: list[float] = field(default_factory=list)  # share of rounds accepting >= i+1 drafts
    offline_acc: list[float] = field(default_factory=list)  # per-step accuracy on held-out features
    offline_tau: float = 0.0  # the online round walk replayed on the held-out features (rounds.simulate_rounds)
    offline_accepted_per_position: list[float] = field(default_factory=list)  # the same walk, per position
    offline_rounds: int = 0
    same_sequences: dict[str, Any] = field(default_factory=dict)  # OfflineOnline.to_dict() on the eval prompts
    # share of the verifier's greedy tokens on these prompts that the draft vocabulary lacks (vocab.outside_share)
    outside_vocab_share: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format_text(self) -> str:
        lines = [
            f"speculative decoding, k={self.k}, {self.n_prompts} held-out prompts, {self.generated_tokens} tokens",
            f"  tau (mean acceptance length)  {self.tau:.2f}  ({self.rounds} rounds)",
            "  accepted at position          " + "  ".join(f"{100 * a:.0f}%" for a in self.accepted_per_position),
            f"  speedup vs verifier alone     {self.speedup:.2f}x  "
            f"({self.baseline_s:.1f} s -> {self.speculative_s:.1f} s)",
            f"  output identical to greedy    {'yes' if self.identical else 'NO'}",
            f"  outside the draft vocabulary  {100 * self.outside_vocab_share:.1f}% of the verifier's tokens "
            "(never proposed)",
        ]
        if self.offline_acc:
            accs = "  ".join(f"{100 * a:.1f}%" for a in self.offline_acc)
            walk = "  ".join(f"{100 * a:.0f}%" for a in self.offline_accepted_per_position)
            lines.append(f"  offline (held-out features)   per token, acc per step {accs}")
            lines.append(
                f"  offline rounds replayed       tau {self.offline_tau:.2f}  ({self.offline_rounds} rounds)"
                f"  accepted at position {walk}"
            )
        same = self.same_sequences
        if same:
            first = same["offline_accepted_per_position"][0], same["online_accepted_per_position"][0]
            lines.append(
                f"  same sequences, offline/online  step-0 per token {100 * same['offline_step0']:.1f}/"
                f"{100 * same['online_step0']:.1f}%  position 1 per round {100 * first[0]:.1f}/{100 * first[1]:.1f}%"
                f"  tau {same['offline_tau']:.2f}/{same['online_tau']:.2f}"
            )
        return "\n".join(lines)


def load_export_draft(export_dir: str | Path, embed: torch.Tensor) -> EagleDraft:
    """An ``EagleDraft`` (fp32) from an export directory; ``embed`` [V, H] is the verifier's embedding."""
    config, tensors = read_export(export_dir)
    try:
        cfg = DraftConfig(
            hidden_size=config["hidden_size"],
            target_hidden_size=config["target_hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            head_dim=config["head_dim"],
            draft_vocab_size=config["draft_vocab_size"],
            target_vocab_size=config["vocab_size"],
            aux_layer_ids=tuple(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=config["rope_theta"],
            max_position_embeddings=config["max_position_embeddings"],
            rope_scaling=config.get("rope_scaling"),
            norm_before_fc=bool(config.get("norm_before_fc") or config["eagle_config"].get("norm_before_fc")),
            norm_before_residual=bool(config.get("norm_before_residual", False)),
            norm_output=bool(config.get("norm_output", False)),
        )
    except KeyError as exc:
        raise CheckpointError(f"{export_dir}/config.json lacks {exc}") from None
    model = EagleDraft(cfg)
    state = {name: t.float() if t.is_floating_point() else t for name, t in tensors.items()}
    if "d2t" not in state:
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)  # full vocab: identity
    model.load_state_dict(state)
    model.embed_tokens.copy_(embed)
    model.eval()
    return model


def heldout_prompts(
    prepared: str | Path, features: str | Path | None, n_prompts: int, heldout_fraction: float | None = None
) -> list[list[int]]:
    """Up to ``n_prompts`` distinct prompts of ``prepared`` that were not trained on.

    ``heldout_fraction`` None: prompts that no features sample starts with (unseen by any run on
    ``features``). A fraction: only prompts of the features' held-out split (``data.is_heldout``, the
    hash split training uses with that fraction), so the prompts come from the training distribution;
    no training-split sample starts with one of them. Reads no model: ``eval`` calls it before loading
    the verifier, and an empty choice is a ``DataError`` that says what to pass."""
    trained: set[tuple[int, ...]] = set()
    split: set[tuple[int, ...]] = set()
    n_features = 0
    if features is not None:
        for extracted in open_features(features):
            n_features += 1
            mask = extracted.loss_mask.tolist()
            prompt_ids = tuple(extracted.input_ids[: mask.index(1) if 1 in mask else len(mask)].tolist())
            held = heldout_fraction is not None and is_heldout(extracted.sample_id, heldout_fraction)
            (split if held else trained).add(prompt_ids)
    elif heldout_fraction is not None:
        raise DataError("prompts of the held-out split need the features directory (--features)")
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    n_prepared = 0
    for sample in iter_prepared(prepared):
        prompt = tuple(sample.input_ids[: sample.loss_mask.index(1)])
        n_prepared += bool(prompt)
        wanted = prompt in split if heldout_fraction is not None else True
        if prompt and wanted and prompt not in trained and prompt not in seen:
            seen.add(prompt)
            prompts.append(list(prompt))
    if not prompts:
        raise DataError(_no_prompt_message(prepared, features, heldout_fraction, n_prepared, n_features, len(split)))
    step = max(1, len(prompts) // n_prompts)  # spread over the dataset, not its first topic
    return prompts[::step][:n_prompts]


def _no_prompt_message(
    prepared: str | Path,
    features: str | Path | None,
    heldout_fraction: float | None,
    n_prepared: int,
    n_features: int,
    n_split_prompts: int,
) -> str:
    """Why no prompt is left to evaluate, and what to pass instead."""
    if n_prepared == 0:
        return f"{prepared}: no sample with a prompt (an assistant turn after some context) to evaluate"
    if heldout_fraction is None:
        return (
            f"{prepared}: every prompt was trained on (all are in --features {features}, {n_features} samples), "
            "so none is left to evaluate unbiased: pass --heldout-fraction 0.05 (the heldout_fraction eagle3 "
            "train used; 0.05 by default) to evaluate on the prompts it held out, or a --prepared set the "
            "features were not extracted from"
        )
    if n_split_prompts == 0:
        return (
            f"{prepared}: the held-out split of --features {features} at --heldout-fraction {heldout_fraction} "
            f"is empty ({n_features} samples, none held out): pass the heldout_fraction eagle3 train used (0.05 "
            "by default) or a larger one, or leave --heldout-fraction out and give a --prepared set the features "
            "were not extracted from"
        )
    return (
        f"{prepared}: none of the {n_split_prompts} prompts held out of --features {features} at "
        f"--heldout-fraction {heldout_fraction} is in this prepared set (or each also opens a training sample): "
        "give the --prepared directory the features were extracted from"
    )


@torch.no_grad()
def offline_acceptance(
    draft: EagleDraft, teacher: Teacher, features: str | Path, k: int, heldout_fraction: float = 0.05
) -> tuple[list[float], RoundCounts]:
    """Per-step accuracy (the trainer's count) and the replayed rounds on the held-out split of
    ``features`` (all of it when the split is empty)."""
    data = FeaturesData(features, heldout_fraction=heldout_fraction)
    positions = data.split.heldout or data.split.train
    stats = torch.zeros(2, k)
    rounds = RoundCounts(k)
    for plan in data.plan(positions, 2048, seed=0, epoch=0, shuffle=False, truncate=True):
        batch = data.load(plan, 2048)
        result = ttt_forward(draft, teacher, batch, k)
        stats += torch.stack([result.correct, result.n_terms])
        rounds.merge(simulate_rounds(torch.stack(result.hits), batch.loss_mask, batch.seg_start, batch.seg_end))
    return (stats[0] / stats[1].clamp(min=1)).tolist(), rounds


def evaluate(
    export_dir: str | Path,
    *,
    prepared: str | Path | None,
    features: str | Path | None = None,
    model: str,
    k: int = 4,
    n_prompts: int = 10,
    max_new_tokens: int = 48,
    threads: int = 1,
    dtype: str = "float32",
    heldout_fraction: float | None = None,
    same_sequences: bool = False,
    prompts: list[list[int]] | None = None,
) -> EvalResult:
    """Online figures on held-out prompts, offline ones on the held-out features; ``same_sequences``
    also scores the eval prompts' own greedy sequences both ways (``offline_online``, untimed)."""
    return evaluate_ks(
        export_dir,
        (k,),
        prepared=prepared,
        features=features,
        model=model,
        n_prompts=n_prompts,
        max_new_tokens=max_new_tokens,
        threads=threads,
        dtype=dtype,
        heldout_fraction=heldout_fraction,
        same_sequences=same_sequences,
        prompts=prompts,
    )[0]


def evaluate_ks(
    export_dir: str | Path,
    ks: Sequence[int],
    *,
    prepared: str | Path | None,
    features: str | Path | None = None,
    model: str,
    n_prompts: int = 10,
    max_new_tokens: int = 48,
    threads: int = 1,
    dtype: str = "float32",
    heldout_fraction: float | None = None,
    same_sequences: bool = False,
    prompts: list[list[int]] | None = None,
) -> list[EvalResult]:
    """``evaluate`` at every k of ``ks`` (one result each, in order): the verifier and the draft load once
    and each prompt's greedy baseline runs once, whatever the number of ks."""
    from transformers import AutoModelForCausalLM

    from eagle3.core.models import resolve_model_dir

    torch.set_num_threads(threads)
    if prompts is None:  # the held-out prompts of ``prepared``, chosen before any model is loaded
        if prepared is None:
            raise DataError("no prompts: pass the prepared dataset the held-out prompts come from (--prepared)")
        prompts = heldout_prompts(prepared, features, n_prompts, heldout_fraction)
    model_dir = resolve_model_dir(model)
    target, tensors = load_verifier_tensors(model_dir)
    draft = load_export_draft(export_dir, tensors["embed"])
    verifier = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    verifier.eval()  # type: ignore[no-untyped-call]
    eos = target.get("eos_token_id")
    eos_id = int(eos[0] if isinstance(eos, list) else eos) if eos is not None else None
    taps = VerifierTaps(verifier, draft.cfg.aux_layer_ids)
    base_s = 0.0
    spec_s = dict.fromkeys(ks, 0.0)
    accepted: dict[int, list[int]] = {k: [] for k in ks}
    identical = dict.fromkeys(ks, True)
    n_tokens = dict.fromkeys(ks, 0)
    greedy_tokens: list[list[int]] = []
    greedy_generate(verifier, prompts[0], 2, eos_id)  # warm-up
    bar = ProgressBar("eval", len(prompts), unit="prompt")
    for prompt in prompts:
        bar.update(1)
        base = greedy_generate(verifier, prompt, max_new_tokens, eos_id)
        base_s += base.seconds
        greedy_tokens.append(base.tokens)
        for k in ks:
            spec = speculative_generate(verifier, draft, taps, prompt, k, max_new_tokens, eos_id)
            identical[k] &= spec.tokens == base.tokens
            spec_s[k] += spec.seconds
            accepted[k] += spec.accepted
            n_tokens[k] += len(spec.tokens)
    bar.close()
    teacher = Teacher(tensors["norm"], tensors["lm_head"], draft.cfg.rms_norm_eps)
    outside = outside_share(greedy_tokens, draft.target_ids.numpy())  # one baseline for every k
    results = []
    for k in ks:
        acc = accepted[k]
        result = EvalResult(
            k=k,
            n_prompts=len(prompts),
            tau=sum(a + 1 for a in acc) / max(1, len(acc)),
            speedup=base_s / spec_s[k] if spec_s[k] else 0.0,
            rounds=len(acc),
            generated_tokens=n_tokens[k],
            speculative_s=spec_s[k],
            baseline_s=base_s,
            identical=identical[k],
            accepted_per_position=[sum(a > i for a in acc) / max(1, len(acc)) for i in range(k)],
            outside_vocab_share=outside,
        )
        if same_sequences:
            check = compare_offline_online(
                verifier, draft, teacher, taps, prompts, k=k, max_new_tokens=max_new_tokens, eos_id=eos_id
            )
            result.same_sequences = check.to_dict()
        results.append(result)
    taps.remove()
    if features is not None:
        for result in results:
            result.offline_acc, rounds = offline_acceptance(
                draft, teacher, features, result.k, heldout_fraction or 0.05
            )
            result.offline_tau = rounds.tau
            result.offline_accepted_per_position = rounds.accepted_per_position
            result.offline_rounds = rounds.rounds
    return results
