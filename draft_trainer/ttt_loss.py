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
"""

from __future__ import annotations

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


def _chunk(
    draft: EagleDraft,
    prenorm: torch.Tensor,
    teacher_logp: torch.Tensor,
    teacher_rows: torch.Tensor,
    teacher_arg: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[c, H] prenorm, the micro-batch's [T, Vd] teacher log-probs and the chunk's [c] rows of it, [c] teacher
    argmax -> ([c] CE, [c] bool argmax hits). The teacher rows are gathered here, inside the checkpoint: a
    gathered [c, Vd] argument would be a copy the checkpoint keeps for backward (K x T x Vd fp32 over a step's
    chunks and the K steps: 3.7 GB at 4,096 tokens, Vd 32,000), while the whole [T, Vd] tensor is one shared
    reference."""
    logits = draft.logits(prenorm)  # [c, Vd]
    ce = -(teacher_logp[teacher_rows].exp() * functional.log_softmax(logits.float(), -1)).sum(-1)  # [c]
    return ce, logits.argmax(-1) == teacher_arg


def chunk_terms(
    draft: EagleDraft,
    prenorm: torch.Tensor,
    rows: torch.Tensor,
    teacher_rows: torch.Tensor,
    teacher_logp: torch.Tensor,
    teacher_arg: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CE [m] and argmax hits ([m] bool: the draft's top token is the teacher's) of the ``m`` counted
    ``rows`` of ``prenorm`` [T, H], whose teacher rows of ``teacher_logp`` [T, Vd] / ``teacher_arg`` [T]
    are ``teacher_rows`` [m]."""
    step = chunk_rows_for(teacher_logp.shape[-1], prenorm.device)
    keep = rows.shape[0] * teacher_logp.shape[-1] <= KEEP_LOSS_ELEMENTS  # small step: one chunk, no recompute
    if keep:
        step = max(step, rows.shape[0])
    ces, hits = [], []
    for start in range(0, rows.shape[0], step):
        part, tpart = rows[start : start + step], teacher_rows[start : start + step]
        args = (draft, prenorm[part], teacher_logp, tpart, teacher_arg[tpart])
        if torch.is_grad_enabled() and prenorm.requires_grad and not keep:
            ce, hit = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            ce, hit = _chunk(*args)
        ces.append(ce)
        hits.append(hit)
    return torch.cat(ces), torch.cat(hits)
