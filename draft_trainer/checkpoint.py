"""Run directory files: the training checkpoint (exact resume) and the draft weights (export input).

Layout of a run directory::

    config.json          the resolved TrainConfig
    checkpoint.pt        model + optimizer + scheduler + step + RNG states (written atomically)
    draft/model.safetensors, draft/draft_config.json     fp32 weights incl. d2t/t2d, and DraftConfig
    metrics.jsonl        one JSON object per logged step (appended; a resumed run continues it)
    training.png         loss and per-step acceptance over training

Invariants: every file is written to a temp name, fsynced and renamed, so a kill leaves the previous
complete version; a resumed run replays the same data order from the saved global step.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from eagle3.core.atomic_write import atomic_path
from eagle3.core.atomic_write import write_text_atomic as write_text_atomic  # export.py and train.py take it here
from eagle3.draft_trainer.errors import CheckpointError
from eagle3.draft_trainer.model import DraftConfig, EagleDraft

CHECKPOINT_FILE = "checkpoint.pt"
DRAFT_DIR = "draft"
DRAFT_WEIGHTS = "model.safetensors"
DRAFT_CONFIG = "draft_config.json"


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """CPU, numpy and Python RNG states, plus ``device``'s CUDA RNG state when it is a GPU; tensors and
    plain types only (``checkpoint.pt`` loads with ``weights_only=True``: numpy's key array is a tensor)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    numpy_state = [
        str(kind),
        torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        int(pos),
        int(has_gauss),
        float(cached_gaussian),
    ]
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore ``rng_state``'s states; the CUDA one only when both the checkpoint and ``device`` have it
    (a checkpoint moved between a CPU and a GPU host resumes with the other RNGs exact)."""
    torch.set_rng_state(state["torch"].cpu())
    kind, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
    random.setstate(_as_tuples(state["python"]))
    if device is not None and device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> Path:
    path = run_dir / CHECKPOINT_FILE
    with atomic_path(path) as tmp:
        torch.save(_to_cpu(state), tmp)  # CPU tensors: loadable on any host
    return path


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _as_tuples(value: Any) -> Any:
    """Python's RNG state with its nested tuples restored (a checkpoint may hand back lists)."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list | tuple) else value


def load_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The state ``save_checkpoint`` wrote, unpickled with ``weights_only=True`` (tensors and plain types
    only: a checkpoint cannot run code); None when the run has none."""
    path = run_dir / CHECKPOINT_FILE
    if not path.is_file():
        return None
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    if unsafe:
        raise CheckpointError(
            f"{path}: holds {', '.join(unsafe[:3])}, not only tensors and plain types, so eagle3 does not unpickle "
            "it; a checkpoint.pt of an eagle3 before weights-only checkpoints holds numpy's RNG state pickled: "
            "finish that run with the eagle3 that started it, or delete the file to train from step 0"
        )
    state: dict[str, Any] = torch.load(path, weights_only=True, map_location="cpu")
    return state


def save_draft(model: EagleDraft, draft_dir: Path) -> Path:
    draft_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    with atomic_path(draft_dir / DRAFT_WEIGHTS) as tmp:
        save_file(tensors, str(tmp))
    write_text_atomic(draft_dir / DRAFT_CONFIG, json.dumps(model.cfg.to_dict(), indent=2) + "\n")
    return draft_dir


def resolve_draft_dir(path: str | Path) -> Path:
    """A run directory or its ``draft/`` -> the ``draft/`` directory."""
    path = Path(path)
    if (path / DRAFT_DIR / DRAFT_CONFIG).is_file():
        return path / DRAFT_DIR
    if (path / DRAFT_CONFIG).is_file():
        return path
    raise CheckpointError(f"{path}: no {DRAFT_CONFIG} (expected a run directory or its {DRAFT_DIR}/)")


def load_draft(path: str | Path) -> EagleDraft:
    """Weights + config saved by ``save_draft`` (``embed_tokens`` is not included: set it separately)."""
    draft_dir = resolve_draft_dir(path)
    cfg = DraftConfig.from_dict(json.loads((draft_dir / DRAFT_CONFIG).read_text()))
    model = EagleDraft(cfg)
    tensors = load_file(str(draft_dir / DRAFT_WEIGHTS))
    try:
        model.load_state_dict(tensors)
    except RuntimeError as exc:
        raise CheckpointError(f"{draft_dir}: weights do not match {DRAFT_CONFIG}: {exc}") from None
    return model
