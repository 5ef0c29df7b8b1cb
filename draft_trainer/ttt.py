"""Training-time test (TTT): the draft unrolled ``K`` steps on packed features, with its teacher.

Indexing (packed batch of T tokens, several samples; ``t`` a row of the batch, all inside one sample):

* step ``k`` at row ``t`` reads token ``x[t+k+1]`` and hidden ``fc(aux[t])`` (k = 0) or the step
  ``k-1`` prenorm output at row ``t`` (k > 0); its rope position is ``pos[t] + k`` (vLLM drafts at
  the next position each step);
* it predicts token ``x[t+k+2]``; the teacher is the verifier's ``norm`` + ``lm_head`` on the stored
  final state at row ``t+k+1``, restricted (softmax) to the draft vocabulary;
* attention: the step-``k`` query at ``t`` sees the step-0 keys of rows ``<= t`` of its own sample and
  the step-``1..k`` keys of row ``t`` only (the draft's own chain), exactly the KV cache a chain of
  drafts has at inference;
* the term ``(k, t)`` counts iff ``t+k+2`` lies in the sample, ``loss_mask[t+k+2] == 1`` and the
  teacher's full-vocab argmax lies in the draft vocab.

So a term ``(k, t)`` depends only on features at rows ``<= t+k+1`` of its own sample and tokens
``<= t+k+1`` (tests/unit/test_draft_ttt.py perturbs the rest).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3.draft_trainer.model import EagleDraft
from eagle3.draft_trainer.ttt_attention import TTTAttention
from eagle3.draft_trainer.ttt_loss import KL, Objective, chunk_rows_for, chunk_terms


class Teacher(torch.nn.Module):
    """The verifier's final ``norm`` and ``lm_head``: logits from stored pre-norm final states."""

    norm_weight: torch.Tensor  # [Ht]
    lm_head_weight: torch.Tensor  # [V, Ht]

    def __init__(self, norm_weight: torch.Tensor, lm_head_weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.register_buffer("norm_weight", norm_weight.float())  # [Ht]
        self.register_buffer("lm_head_weight", lm_head_weight.float())  # [V, Ht]
        self.eps = eps
        self._columns: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, lm_head rows^T) cache

    def forward(self, final: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """[n, Ht] -> [n, V] logits, or [n, len(columns)] for just those target ids."""
        normed = final * torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        if columns is None:
            return normed @ self.lm_head_weight.T
        if self._columns is None or not torch.equal(self._columns[0], columns):
            self._columns = (columns.clone(), self.lm_head_weight[columns].T.contiguous())  # [Ht, Vd]
        return normed @ self._columns[1]

    @torch.no_grad()
    def argmax_in_vocab(self, final: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
        """[n, Ht] -> [n] bool: the full-vocab argmax lies in the draft vocab (``t2d`` [V]).

        Row chunks of ``chunk_rows_for(V)``, so the full-vocab logits are never whole."""
        return self.draft_vocab_stats(final, t2d)[0]

    @torch.no_grad()
    def draft_vocab_stats(self, final: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, Ht] -> ([n] bool: the full-vocab argmax lies in the draft vocab (``t2d`` [V]), [n] float: log of
        the probability mass the full-vocab softmax puts on the draft vocab), in row chunks of
        ``chunk_rows_for(V)``, so the full-vocab logits are never whole."""
        step = chunk_rows_for(self.lm_head_weight.shape[0], final.device)
        flags, masses = [], []
        for i in range(0, final.shape[0], step):
            full = self(final[i : i + step]).float()  # [c, V]
            flags.append(t2d[full.argmax(-1)])
            masses.append(full[:, t2d].logsumexp(-1) - full.logsumexp(-1))
        if not flags:
            return torch.zeros(0, dtype=torch.bool, device=final.device), torch.zeros(0, device=final.device)
        return torch.cat(flags), torch.cat(masses)


def load_verifier_tensors(model_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The verifier's config dict and just ``embed_tokens``, ``norm``, ``lm_head`` (never the model)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    wanted = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
    out: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key in wanted:
                    out[wanted[key]] = fh.get_tensor(key).float()
    if "lm_head" not in out and "embed" in out:
        out["lm_head"] = out["embed"]  # tied embeddings
    missing = {"embed", "norm", "lm_head"} - set(out)
    if missing:
        raise FileNotFoundError(f"{model_dir}: safetensors lack {sorted(missing)} (need embed_tokens, norm, lm_head)")
    return config, out


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor  # [T] int64
    aux: torch.Tensor  # [T, 3*Ht] float32
    final: torch.Tensor  # [T, Ht] float32, pre-norm
    loss_mask: torch.Tensor  # [T] bool
    positions: torch.Tensor  # [T] int64, position inside its sample
    seg_start: torch.Tensor  # [T] int64, first row of its sample
    seg_end: torch.Tensor  # [T] int64, one past the last row of its sample

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device) -> PackedBatch:
        """The same batch with every tensor on ``device`` (itself when already there)."""
        if self.input_ids.device == device:
            return self
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)}
        return PackedBatch(**moved)


def step_valid(batch: PackedBatch, k: int) -> torch.Tensor:
    """[T] bool: term (k, t) is supervised by the data (before the teacher-argmax filter)."""
    t_rows = torch.arange(batch.n_tokens, device=batch.input_ids.device)
    target = t_rows + k + 2  # [T] the predicted token's row
    inside = target < batch.seg_end
    return inside & batch.loss_mask[target.clamp(max=batch.n_tokens - 1)]


def step_counts(batch: PackedBatch, ttt_steps: int) -> torch.Tensor:
    """[K] float: supervised terms per step (the loss normaliser, summed over ranks/micro-batches)."""
    return torch.stack([step_valid(batch, k).sum() for k in range(ttt_steps)]).float()


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar: sum_k decay^k * sum(term losses) / denominators[k]
    loss_sums: torch.Tensor  # [K] summed CE per step (detached)
    correct: torch.Tensor  # [K] draft argmax == teacher argmax, counted over the terms
    n_terms: torch.Tensor  # [K] terms counted (after the teacher-argmax filter)
    term_losses: list[torch.Tensor]  # per step [T], 0 where not counted (detached; for tests)
    # per step [T] bool: the draft's token is the teacher's full-vocab argmax (False where the term is not
    # supervised, and where that argmax lies outside the draft vocab: online such a token is always rejected)
    hits: list[torch.Tensor] = field(default_factory=list)
    # [K] summed expected acceptance sum_v min(p_v, q_v) over the counted terms (detached; draft_trainer/ttt_loss.py)
    accept_sums: torch.Tensor = field(default_factory=lambda: torch.zeros(0))


def _teacher_targets(
    draft: EagleDraft,
    teacher: Teacher,
    final: torch.Tensor,
    need: torch.Tensor,
    in_vocab: torch.Tensor | None,
    log_mass: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher log-probs over the draft vocab [T, Vd] (0 where not ``need``), [T] in-vocab flags and [T] log
    probability mass on the draft vocab.

    Without cached ``in_vocab`` and ``log_mass`` the full-vocab logits are computed in row chunks (never
    [T, V] whole)."""
    n, target_ids = final.shape[0], draft.target_ids
    teacher_logp = torch.zeros(n, target_ids.shape[0], device=final.device)  # [T, Vd]
    rows = need.nonzero().squeeze(1)  # [n_need]
    if in_vocab is not None and log_mass is not None:
        step = chunk_rows_for(target_ids.shape[0], final.device)
        for i in range(0, rows.shape[0], step):
            part = rows[i : i + step]
            teacher_logp[part] = teacher(final[part], target_ids).float().log_softmax(-1)  # [c, Vd]
        return teacher_logp, in_vocab & need, log_mass
    flags = torch.zeros(n, dtype=torch.bool, device=final.device)  # [T]
    masses = torch.zeros(n, device=final.device)  # [T]
    step = chunk_rows_for(teacher.lm_head_weight.shape[0], final.device)
    for i in range(0, rows.shape[0], step):
        part = rows[i : i + step]
        full = teacher(final[part]).float()  # [c, V]
        in_draft = full[:, target_ids]
        teacher_logp[part] = in_draft.log_softmax(-1)
        masses[part] = in_draft.logsumexp(-1) - full.logsumexp(-1)
        flags[part] = draft.t2d[full.argmax(-1)]
    return teacher_logp, flags, masses


def ttt_forward(
    draft: EagleDraft,
    teacher: Teacher,
    batch: PackedBatch,
    ttt_steps: int,
    step_decay: float = 0.8,
    denominators: torch.Tensor | None = None,
    teacher_in_vocab: torch.Tensor | None = None,
    attention: str = "auto",
    teacher_log_mass: torch.Tensor | None = None,
    objective: Objective = KL,
) -> TTTResult:
    """Unroll ``ttt_steps`` draft steps; ``denominators`` [K] defaults to this batch's ``step_counts``.

    ``teacher_in_vocab`` [T] bool (the teacher's full-vocab argmax of each row is in the draft vocab) and
    ``teacher_log_mass`` [T] (``Teacher.draft_vocab_stats``), when a caller has both cached, spare the
    full-vocab teacher logits: only the draft-vocab columns are computed (the softmax over them is the same
    either way). ``attention``: "auto" (flex_attention on CUDA, blockwise elsewhere), "blockwise", "flex" or
    "dense" (the quadratic reference); all give the same result (draft_trainer/ttt_attention.py). Memory is
    linear in the batch's tokens except with "dense"; the loss runs in row chunks (draft_trainer/ttt_loss.py).
    ``objective``: the loss of the counted terms (draft_trainer/ttt_loss.py; KL by default)."""
    n = batch.n_tokens
    device = batch.input_ids.device  # the draft, teacher and batch share it
    rows = torch.arange(n, device=device)
    denominators = step_counts(batch, ttt_steps) if denominators is None else denominators
    # teacher log-probs over the draft vocab at every row whose next token is supervised
    need = step_valid(batch, -1)  # [T] row j is a teacher row iff token j+1 is supervised
    with torch.no_grad():
        teacher_logp, in_vocab, log_mass = _teacher_targets(
            draft, teacher, batch.final, need, teacher_in_vocab, teacher_log_mass
        )
        teacher_arg = teacher_logp.argmax(-1)  # [T] draft ids
    steps_attention = TTTAttention.for_batch(batch.seg_start, draft.midlayer.self_attn.n_heads, attention)
    hidden = draft.project_aux(batch.aux)  # [T, H]
    loss = torch.zeros((), device=device)
    sums, correct, counted, terms, hits, accepts = [], [], [], [], [], []
    for k in range(ttt_steps):
        tok_rows = (rows + k + 1).clamp(max=n - 1)  # [T]
        prenorm = draft.step(batch.input_ids[tok_rows], hidden, batch.positions + k, steps_attention)  # [T, H]
        mask = step_valid(batch, k) & in_vocab[tok_rows]  # [T]
        term = torch.zeros(n, device=device)
        hit = torch.zeros(n, dtype=torch.bool, device=device)
        if bool(mask.any()):
            counted_rows = mask.nonzero().squeeze(1)  # [m]
            ce, accept, same_token = chunk_terms(
                draft, prenorm, counted_rows, tok_rows[counted_rows], teacher_logp, teacher_arg, log_mass, objective
            )
            loss = loss + (step_decay**k) * objective.step_sum(ce, accept) / denominators[k].clamp(min=1)
            term = term.index_put((counted_rows,), ce.detach())
            hit = hit.index_put((counted_rows,), same_token)
            correct.append(same_token.sum().float())
            accepts.append(accept.detach().sum())
        else:
            correct.append(torch.zeros((), device=device))
            accepts.append(torch.zeros((), device=device))
        sums.append(term.sum())
        counted.append(mask.sum().float())
        terms.append(term)
        hits.append(hit)
        hidden = draft.feedback(prenorm)
    return TTTResult(
        loss, torch.stack(sums), torch.stack(correct), torch.stack(counted), terms, hits, torch.stack(accepts)
    )


def simulated_acceptance(accuracy: list[float]) -> float:
    """Expected accepted draft tokens per round, sum_k prod_{i<=k} acc_i (tau = this + 1)."""
    total, running = 0.0, 1.0
    for acc in accuracy:
        running *= acc
        total += running
    return total
