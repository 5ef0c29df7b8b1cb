"""What a training run starts from: the draft (its vocabulary, the verifier's embedding and lm_head rows) and
its teacher, built from the verifier's tensors, and the learning-rate schedule (linear warmup, then cosine
down to ``min_lr_ratio``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from eagle3.core.models import resolve_model_dir
from eagle3.draft_trainer.checkpoint import load_draft
from eagle3.draft_trainer.config import TrainConfig
from eagle3.draft_trainer.errors import ConfigError, DataError
from eagle3.draft_trainer.model import NORM_FLAGS, EagleDraft, draft_config_from_target
from eagle3.draft_trainer.ttt import Teacher, load_verifier_tensors
from eagle3.draft_trainer.vocab import VOCAB_FILE, load_vocab


def build_draft(cfg: TrainConfig, meta_hidden: int, aux_ids: tuple[int, ...]) -> tuple[EagleDraft, Teacher]:
    """Draft (vocab set, verifier embedding, lm_head rows) and teacher from the verifier's tensors."""
    vocab_path = Path(cfg.vocab)
    vocab = load_vocab(vocab_path.parent if vocab_path.name == VOCAB_FILE else vocab_path)
    target, tensors = load_verifier_tensors(resolve_model_dir(cfg.model))
    if int(target["hidden_size"]) != meta_hidden:
        raise DataError(
            f"features hidden size {meta_hidden} != verifier {cfg.model} hidden size {target['hidden_size']}"
        )
    if vocab.target_vocab_size != int(target["vocab_size"]):
        raise DataError(f"vocab {cfg.vocab} is over {vocab.target_vocab_size} ids, verifier has {target['vocab_size']}")
    norms = {name: bool(getattr(cfg, name)) for name in NORM_FLAGS}
    draft_cfg = draft_config_from_target(target, vocab.draft_vocab_size, aux_ids, rope=cfg.draft_rope, norms=norms)
    if cfg.init_from:
        model = load_draft(cfg.init_from)
        if model.cfg != draft_cfg:
            raise ConfigError(f"init_from {cfg.init_from}: its draft config differs from this run's")
    else:
        torch.manual_seed(cfg.seed)
        model = EagleDraft(draft_cfg)
        if cfg.init_lm_head_from_verifier:
            with torch.no_grad():
                model.lm_head.weight.copy_(tensors["lm_head"][torch.from_numpy(vocab.target_ids)])
                model.norm.weight.copy_(tensors["norm"])
    model.set_vocab(torch.from_numpy(vocab.d2t), torch.from_numpy(vocab.t2d))
    model.embed_tokens.copy_(tensors["embed"])
    teacher = Teacher(tensors["norm"], tensors["lm_head"], draft_cfg.rms_norm_eps)
    return model, teacher


def lr_lambda(cfg: TrainConfig, total_steps: int) -> Any:
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor
