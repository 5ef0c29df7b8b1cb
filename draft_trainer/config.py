"""One typed training config: defaults < config file (YAML, JSON or TOML by extension, read by
``eagle3.core.config_files`` as ``serve --config`` is) < ``--set key=value`` overrides.

The resolved config is saved as ``RUN/config.json``; ``load_config`` on that file gives it back.
Unknown keys and values of the wrong type are errors naming the key (and the file).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from eagle3.core.config_files import ConfigFileError, read_config_file
from eagle3.draft_trainer.errors import ConfigError
from eagle3.draft_trainer.trackers import parse_log_to

_DEVICE_RE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
_ATTENTION = ("auto", "blockwise", "flex", "dense")  # draft_trainer/ttt_attention.py IMPLEMENTATIONS
LOSSES = ("kl", "lk_lambda", "lk_alpha")  # draft_trainer/ttt_loss.py OBJECTIVES


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """``spec`` (a ``TrainConfig.device`` value) -> the device this process trains on.

    "auto": ``cuda:{local_rank}`` when CUDA is available, else cpu; "cuda" means ``cuda:{local_rank}``
    too (one GPU per torchrun rank). Asking for CUDA without it, or for a GPU index that does not
    exist, is a ConfigError naming the value."""
    if not _DEVICE_RE.fullmatch(spec):
        raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {spec!r}")
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {spec!r}: CUDA is not available on this host (use device=cpu or auto)")
    index = local_rank if spec in ("auto", "cuda") else int(spec.split(":", 1)[1])
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device {spec!r}: cuda:{index} does not exist ({torch.cuda.device_count()} GPUs visible)")
    return torch.device("cuda", index)


@dataclass(frozen=True)
class TrainConfig:
    features: str = ""  # features directory (eagle3 extract); or, streamed from servers (--server), ...
    prepared: str = ""  # ... the prepared dataset whose features the servers compute (draft_trainer/stream_data.py)
    features_cache: str = ""  # streamed: hybrid mode's features directory (read what it holds, append the rest)
    prefetch_micro_batches: int = 0  # streamed: the prefetch window in micro-batches (0: max(4, 2 x requests))
    loader_threads: int = 2  # --features: threads reading (decompressing, dequantizing) the next micro-batches
    vocab: str = ""  # vocab directory or its vocab.safetensors (eagle3 vocab)
    model: str = ""  # the verifier (required; eagle3.core.models.resolve_model_dir): teacher norm/lm_head, embed_tokens
    out: str = "run"  # run directory
    ttt_steps: int = 7  # K unrolled draft steps
    step_decay: float = 0.8  # step k's loss weight is step_decay**k
    # the objective per step: "kl" (CE to the verifier's draft-vocab distribution), "lk_lambda" or "lk_alpha"
    # (the LK losses, direct acceptance-rate objectives, arXiv:2602.23881; docs/training.md "Objective")
    loss: str = "kl"
    lk_kl_scale: float = 1.0  # lk_lambda: KL weight w = lk_kl_scale * exp(-lk_kl_decay * mean acceptance)
    lk_kl_decay: float = 3.0  # SpecForge PR #492's --kl-decay default (the paper's eta = 3)
    max_batch_tokens: int = 2048  # tokens per micro-batch (packed, no padding)
    grad_accum_steps: int = 1  # micro-batches per rank per optimizer step
    epochs: int = 1
    max_steps: int = 0  # stop after this many optimizer steps (0: run all epochs)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.0
    # residual dropout on the draft layer's attention and MLP outputs while training (GPT-2's place); the
    # held-out eval, speculation and the export never drop; 0 = off (docs/draft-quality.md, "Regularisers")
    dropout: float = 0.0
    grad_clip: float = 1.0
    heldout_fraction: float = 0.05
    seed: int = 0
    checkpoint_every_steps: int = 50
    log_every_steps: int = 1
    eval_every_steps: int = 0  # held-out accuracy every N steps (0: only at the end)
    # held-out accuracy and simulated tau (the online rounds replayed) at the end of every N-th epoch, a record
    # of its own in metrics.jsonl, the plot and the trackers (0: only at the end)
    eval_every_epochs: int = 1
    # the draft's rope: "verifier" (the verifier's rope scaling, exported so vLLM builds the same) or "default"
    # (the plain rope, trained and exported alike: for a scaling draft_trainer/rope.py does not reproduce)
    draft_rope: str = "verifier"
    # the "Eagle 3.1" norms (speculators' defaults; vLLM reads them from the export's config): an RMSNorm on the
    # concatenated taps before fc, the residual taken after hidden_norm, the post-norm hidden fed back between
    # steps (keeps its scale from growing with depth: docs/draft-quality.md, "Head-to-head"). Off: EAGLE-3 as published
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    torch_threads: int = 1
    device: str = "auto"  # "auto" (cuda:LOCAL_RANK when CUDA is available, else cpu), "cpu", "cuda", "cuda:N"
    autocast_bf16: bool = False  # bf16 autocast when training on CPU; fp32 unless set
    autocast_bf16_cuda: bool = True  # bf16 autocast when training on CUDA
    attention: str = "auto"  # TTT attention: auto (flex on CUDA, blockwise on CPU), blockwise, flex, dense
    truncate: bool = False  # cut samples longer than max_batch_tokens instead of failing
    init_from: str = ""  # warm start: a run directory or its draft/ (weights only)
    init_lm_head_from_verifier: bool = True  # lm_head rows = the verifier's rows of the draft vocab
    # keep those rows (and the final norm, the verifier's too) fixed: the draft must then produce states the
    # verifier's own head reads, EAGLE-1's choice; less to memorise on small data (docs/draft-quality.md)
    freeze_lm_head: bool = False
    progress: bool = True
    log_to: str = ""  # experiment trackers besides metrics.jsonl: "tensorboard", "wandb" or both (comma list)
    wandb_project: str = "eagle3"

    def __post_init__(self) -> None:
        positive = ("ttt_steps", "max_batch_tokens", "grad_accum_steps", "epochs", "torch_threads")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_every_epochs < 0 or self.eval_every_steps < 0:
            raise ConfigError(
                "eval_every_epochs and eval_every_steps must be >= 0 (0: only at the end), got "
                f"{self.eval_every_epochs} and {self.eval_every_steps}"
            )
        if self.draft_rope not in ("verifier", "default"):
            raise ConfigError(f"draft_rope must be 'verifier' or 'default', got {self.draft_rope!r}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ConfigError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if not _DEVICE_RE.fullmatch(self.device):
            raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        parse_log_to(self.log_to)  # unknown names and missing packages fail before any step
        if self.freeze_lm_head and not self.init_lm_head_from_verifier and not self.init_from:
            raise ConfigError(
                "freeze_lm_head keeps the verifier's lm_head rows: it needs init_lm_head_from_verifier "
                "(or init_from a run that had them)"
            )
        if self.loader_threads < 0:
            raise ConfigError(f"loader_threads must be >= 0, got {self.loader_threads}")
        if self.prefetch_micro_batches < 0:
            raise ConfigError(f"prefetch_micro_batches must be >= 0, got {self.prefetch_micro_batches}")
        if self.features and (self.prepared or self.features_cache):
            raise ConfigError(
                "features is the offline mode; prepared/features_cache are for streaming from "
                "servers (--server): give one or the other"
            )
        if self.loss not in LOSSES:
            raise ConfigError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.lk_kl_scale < 0 or self.lk_kl_decay < 0:
            raise ConfigError(
                f"lk_kl_scale and lk_kl_decay must be >= 0, got {self.lk_kl_scale} and {self.lk_kl_decay}"
            )
        if self.attention not in _ATTENTION:
            raise ConfigError(f"attention must be one of {', '.join(_ATTENTION)}, got {self.attention!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


_FIELDS = {f.name: f for f in fields(TrainConfig)}


def _coerce(key: str, value: Any, where: str) -> Any:
    if key not in _FIELDS:
        raise ConfigError(f"{where}: unknown config key {key!r} (known: {', '.join(sorted(_FIELDS))})")
    kind = type(getattr(TrainConfig(), key))
    if isinstance(value, str) and kind is not str:
        text = value.strip().lower()
        try:
            if kind is bool:
                if text not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(text)
                return text in ("true", "1", "yes")
            return kind(value)
        except ValueError:
            raise ConfigError(f"{where}: {key} expects {kind.__name__}, got {value!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: {key} expects {kind.__name__}, got {value!r}")
    return value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the file at ``path`` (``.yaml``/``.yml``, ``.json`` or ``.toml``), then ``overrides``."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            data = read_config_file(path)
        except ConfigFileError as exc:
            raise ConfigError(f"--config {exc}") from None
        values.update({k: _coerce(k, v, str(path)) for k, v in data.items()})
    for key, value in (overrides or {}).items():
        values[key] = _coerce(key, value, "--set")
    return replace(TrainConfig(), **values)


def parse_overrides(items: list[str]) -> dict[str, str]:
    """``["lr=1e-3", ...]`` -> ``{"lr": "1e-3"}`` (types are checked by ``load_config``)."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = value
    return out


def data_overrides(
    file_cfg: TrainConfig,
    *,
    features: Path | None,
    prepared: Path | None,
    features_cache: Path | None,
    servers: list[str],
) -> dict[str, Any]:
    """Where ``eagle3 train`` reads its features: its flags, else ``file_cfg`` (the config file and ``--set``: a
    run's own ``config.json`` names its features, or its prepared dataset and cache; servers are always flags).
    Offline clears the streaming keys and streaming the offline one, so a config of the other mode does not
    clash with the flags."""
    flags_stream = bool(servers or prepared or features_cache)
    if features is not None and flags_stream:
        raise ConfigError(
            "--features trains offline; --prepared/--server/--features-cache stream: give one or the other"
        )
    if features is not None or (not flags_stream and file_cfg.features):
        return {"features": str(features or file_cfg.features), "prepared": "", "features_cache": ""}
    source = prepared or file_cfg.prepared
    if not (servers and source):
        if not flags_stream and not source:
            raise ConfigError("give --features DIR (eagle3 extract), or --prepared DIR and --server URL to stream")
        raise ConfigError("streaming needs --prepared DIR and at least one --server URL (the servers are always flags)")
    return {
        "prepared": str(source),
        "features_cache": str(features_cache or file_cfg.features_cache or ""),
        "features": "",
    }
