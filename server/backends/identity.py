"""What every backend does before and after starting its engine: open the checkpoint (text config,
layer count, aux ids, context length) and describe it as ``BackendInfo``. One place, so the hf and
vllm backends cannot report the same checkpoint differently."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.core.identity import checkpoint_revision, tokenizer_sha256
from eagle3.core.layers import check_aux_layer_ids, default_aux_layer_ids
from eagle3.core.models import resolve_model_dir
from eagle3.server.backends.base import BackendConfig, BackendConfigError, BackendInfo, ProgressCallback


@dataclass(frozen=True)
class Checkpoint:
    model_dir: Path
    hf_config: Any  # transformers PretrainedConfig (the whole one; ``text`` is its language-model part)
    text: Any
    num_hidden_layers: int
    aux_layer_ids: tuple[int, ...]
    max_model_len: int


def open_checkpoint(config: BackendConfig, progress: ProgressCallback) -> Checkpoint:
    """Resolve ``config.model``, read its config (nested ``text_config`` of multimodal/MoE checkpoints
    included), check the aux layer ids and ``--max-model-len`` against it."""
    from transformers import AutoConfig

    progress("resolving model", 0.0)
    model_dir = resolve_model_dir(config.model)
    hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=config.trust_remote_code)
    return checkpoint_from_config(model_dir, hf_config, config)


def checkpoint_from_config(model_dir: Path, hf_config: Any, config: BackendConfig) -> Checkpoint:
    """The checks of ``open_checkpoint`` on a config already in hand (``--model dummy:<shape>``)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    n_layers = int(text.num_hidden_layers)
    try:
        aux = check_aux_layer_ids(config.aux_layer_ids or default_aux_layer_ids(n_layers), n_layers)
    except ValueError as exc:
        raise BackendConfigError(f"--aux-layer-ids: {exc}") from None
    max_len = int(getattr(text, "max_position_embeddings", 0) or 0)
    max_model_len = config.max_model_len or max_len
    if max_len and max_model_len > max_len:
        raise BackendConfigError(f"--max-model-len {max_model_len} exceeds the model's {max_len}")
    return Checkpoint(model_dir, hf_config, text, n_layers, aux, max_model_len)


def backend_info(ckpt: Checkpoint, config: BackendConfig, backend: str, device: str,
                 vocab_size: int | None = None) -> BackendInfo:  # fmt: skip
    """``vocab_size``: the embedding's rows when the engine knows them (they may exceed the config's)."""
    return BackendInfo(
        model_id=os.path.basename(os.path.normpath(ckpt.model_dir)),
        revision=checkpoint_revision(ckpt.model_dir),
        model_dir=str(ckpt.model_dir),
        num_hidden_layers=ckpt.num_hidden_layers,
        hidden_size=int(ckpt.text.hidden_size),
        vocab_size=int(vocab_size if vocab_size is not None else ckpt.text.vocab_size),
        max_model_len=ckpt.max_model_len,
        dtype=config.dtype,
        aux_layer_ids=ckpt.aux_layer_ids,
        tokenizer_sha256=tokenizer_sha256(ckpt.model_dir),
        backend=backend,
        device=device,
    )
