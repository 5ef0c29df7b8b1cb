"""The TTT distillation loss in row chunks: no ``[T, Vd]`` logits tensor of a step is ever whole.

For the counted rows of one step, ``chunk_terms`` runs ``draft.logits`` -> log-softmax -> CE against the
teacher's draft-vocab distribution ``chunk_rows`` rows at a time. With gradients on, each chunk is an
activation checkpoint (``torch.utils.checkpoint``, non-reentrant): only its ``[rows, H]`` input is kept
for backward and the chunk's logits are recomputed there, so the vocab-sized memory of a step is one
chunk (``rows * Vd <= LOSS_CHUNK_ELEMENTS``, larger on CUDA) instead of K steps x T rows x Vd kept until backward.
The values equal the unchunked loss up to float summation order (the CE of a row is computed whole).

A step whose counted rows are few (``rows * Vd <= KEEP_LOSS_ELEMENTS``: 512 rows at Vd 8,192, the demo's
micro-batch) is one chunk computed without the checkpoint: its activations (a few ``[rows, Vd]`` tensors,
<= 16 MiB each in fp32) are kept for backward instead of the logits being recomputed there: 6-8 % more
tokens/s on CPU, measured side by side (docs/training.md, "Speed on this CPU").
Memory stays bounded by a constant per step, so it stays linear in tokens for large micro-batches.

The objective (``TrainConfig.loss``, ``Objective``): "kl" (default) is the CE above. "lk_lambda" and
"lk_alpha" are the LK losses (Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for
Speculative Decoding", arXiv:2602.23881; as SpecForge PR #492 implements them, ``specforge/core/lk_loss.py``),
built on a row's expected acceptance under speculative sampling, ``alpha = sum_v min(p_v, q_v)`` = 1 - TV:
``q`` the draft's softmax over the draft vocab, ``p`` the verifier's full-vocab probabilities of the draft
vocab's tokens, *not* renormalised (the mass on tokens outside the draft vocab is acceptance the draft
can never get; the CE keeps the renormalised distribution). Per step, over its counted rows:

* lk_alpha: ``-mean(log alpha)`` (a row whose alpha is 0 adds 0, as the reference's ``where``);
* lk_lambda: ``w * mean(CE) + (1 - w) * (1 - mean(alpha))``, ``w = kl_scale * exp(-kl_decay * mean(alpha))``
  with the mean acceptance detached (w moves from the KL side to the acceptance side as the draft improves).

Both are sums of per-row terms (w is a constant of the step's micro-batch), so the chunked loss equals the
unchunked one. Under greedy verification (eagle3's eval, temperature 0) a row is accepted iff the draft's
argmax is the verifier's; the sampled-verification alpha is the smooth objective the reference trains on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional
from torch.utils.checkpoint import checkpoint

from eagle3.draft_trainer.model import EagleDraft

LOSS_CHUNK_ELEMENTS = 1 << 23  # rows * vocab of one chunk off CUDA (8 Mi elements: 32 MiB in fp32)
# On CUDA a chunk of 262 rows (Vd 32,000) leaves the GPU idle between small kernels and checkpoints;
# 32 Mi elements (1,048 rows, ~0.6 GB of transient fp32 per chunk) keeps the matrix products large.
CUDA_LOSS_CHUNK_ELEMENTS = 1 << 25
KEEP_LOSS_ELEMENTS = 1 << 22  # rows * vocab of a step at most this: no checkpoint, its activations are kept


def chunk_rows_for(vocab_size: int, device: torch.device | None = None) -> int:
    """Rows per chunk so that ``rows * vocab_size`` stays within the device's chunk size (at least 1)."""
    cuda = device is not None and device.type == "cuda"
    return max(1, (CUDA_LOSS_CHUNK_ELEMENTS if cuda else LOSS_CHUNK_ELEMENTS) // vocab_size)


OBJECTIVES = ("kl", "lk_lambda", "lk_alpha")


@dataclass(frozen=True)
class Objective:
    """The training objective of a step's counted rows (module docstring; ``TrainConfig.loss``, ``lk_*``)."""

    name: str = "kl"
    kl_scale: float = 1.0  # lk_lambda: w = kl_scale * exp(-kl_decay * mean alpha); SpecForge PR #492's
    kl_decay: float = 3.0  # defaults (--kl-scale 1, --kl-decay 3)

    def __post_init__(self) -> None:
        if self.name not in OBJECTIVES:
            raise ValueError(f"loss must be one of {', '.join(OBJECTIVES)}, got {self.name!r}")
        if self.kl_scale < 0 or self.kl_decay < 0:
            raise ValueError(f"lk_kl_scale and lk_kl_decay must be >= 0, got {self.kl_scale} and {self.kl_decay}")

    def step_sum(self, ce: torch.Tensor, accept: torch.Tensor) -> torch.Tensor:
        """[m] CE and [m] expected acceptance of one step's counted rows -> the objective summed over them
        (the caller divides by the step's term count: a mean over the micro-batch, as the reference's)."""
        if self.name == "kl" or ce.numel() == 0:
            return ce.sum()
        if self.name == "lk_alpha":
            return -torch.where(accept > 0, accept.clamp(min=torch.finfo(accept.dtype).tiny).log(), 0).sum()
        weight = self.kl_scale * torch.exp(-self.kl_decay * accept.detach().mean())
        return weight * ce.sum() + (1 - weight) * (1 - accept).sum()


KL = Objective()


def _chunk(
    draft: EagleDraft,
    prenorm: torch.Tensor,
    teacher_logp: torch.Tensor,
    teacher_log_mass: torch.Tensor,
    teacher_rows: torch.Tensor,
    teacher_arg: torch.Tensor,
    accept_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[c, H] prenorm, the micro-batch's [T, Vd] teacher log-probs, its [T] log draft-vocab mass and the chunk's
    [c] rows of them, [c] teacher argmax -> ([c] CE, [c] expected acceptance alpha, [c] bool argmax hits).
    The teacher rows are gathered here, inside the checkpoint: a gathered [c, Vd] argument would be a copy the
    checkpoint keeps for backward (K x T x Vd fp32 over a step's chunks and the K steps: 3.7 GB at 4,096
    tokens, Vd 32,000), while the whole [T, Vd] tensor is one shared reference. alpha carries gradients only
    when ``accept_grad`` (an LK objective); for KL it is a logged metric."""
    logits = draft.logits(prenorm)  # [c, Vd]
    log_q = functional.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)  # [c, Vd] >= fp32
    log_p = teacher_logp[teacher_rows]  # [c, Vd], renormalised over the draft vocab
    ce = -(log_p.exp() * log_q).sum(-1)  # [c]
    with torch.set_grad_enabled(accept_grad and torch.is_grad_enabled()):
        accept = torch.minimum((log_p + teacher_log_mass[teacher_rows, None]).exp(), log_q.exp()).sum(-1)  # [c]
    return ce, accept, logits.argmax(-1) == teacher_arg


def chunk_terms(
    draft: EagleDraft,
    prenorm: torch.Tensor,
    rows: torch.Tensor,
    teacher_rows: torch.Tensor,
    teacher_logp: torch.Tensor,
    teacher_arg: torch.Tensor,
    teacher_log_mass: torch.Tensor | None = None,
    objective: Objective = KL,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CE [m], expected acceptance [m] and argmax hits ([m] bool: the draft's top token is the teacher's) of
    the ``m`` counted ``rows`` of ``prenorm`` [T, H], whose teacher rows of ``teacher_logp`` [T, Vd] /
    ``teacher_arg`` [T] / ``teacher_log_mass`` [T] (log of the verifier's probability mass on the draft
    vocab; None: 0, all of it) are ``teacher_rows`` [m]."""
    if teacher_log_mass is None:
        teacher_log_mass = torch.zeros(teacher_logp.shape[0], dtype=teacher_logp.dtype, device=teacher_logp.device)
    accept_grad = objective.name != "kl"
    step = chunk_rows_for(teacher_logp.shape[-1], prenorm.device)
    keep = rows.shape[0] * teacher_logp.shape[-1] <= KEEP_LOSS_ELEMENTS  # small step: one chunk, no recompute
    if keep:
        step = max(step, rows.shape[0])
    ces, accepts, hits = [], [], []
    for start in range(0, rows.shape[0], step):
        part, tpart = rows[start : start + step], teacher_rows[start : start + step]
        args = (draft, prenorm[part], teacher_logp, teacher_log_mass, tpart, teacher_arg[tpart], accept_grad)
        if torch.is_grad_enabled() and prenorm.requires_grad and not keep:
            ce, accept, hit = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            ce, accept, hit = _chunk(*args)
        ces.append(ce)
        accepts.append(accept)
        hits.append(hit)
    return torch.cat(ces), torch.cat(accepts), torch.cat(hits)
