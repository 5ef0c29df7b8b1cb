"""Optional experiment trackers for ``eagle3 train``: TensorBoard and Weights & Biases.

``metrics.jsonl`` in the run directory stays the record (exact resume truncates it); a tracker is a
copy of the same records for the tools people already watch. Config key ``log_to``: ``""`` (none),
``"tensorboard"``, ``"wandb"`` or both, comma-separated. Only rank 0 logs.

* TensorBoard: event files under ``RUN/tensorboard`` (``tensorboard --logdir RUN``), one scalar per
  numeric field of a record, tagged ``train/<field>`` (``heldout/<field>`` for held-out records), at the
  record's optimizer step. Needs the ``tensorboard`` package.
* W&B: ``wandb.init(project=wandb_project, dir=RUN, id=<kept in RUN/wandb_run_id>, resume="allow")``,
  so a resumed run continues the same W&B run; ``WANDB_MODE=offline`` works without a network. Needs
  ``wandb``.
A missing package is a ``ConfigError`` at start, before any step, with the pip command.
"""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path
from typing import Any, Protocol

from eagle3.draft_trainer.errors import ConfigError

TRACKERS = ("tensorboard", "wandb")
RUN_ID_FILE = "wandb_run_id"


class Tracker(Protocol):
    def log(self, record: dict[str, Any], step: int) -> None: ...
    def close(self) -> None: ...


def parse_log_to(text: str) -> tuple[str, ...]:
    """``"tensorboard, wandb"`` -> ("tensorboard", "wandb"); unknown names and missing packages are errors."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"log_to: unknown tracker {name!r} (known: {', '.join(TRACKERS)})")
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"log_to={name} needs the {name} package: pip install {name}")
    return names


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a record; lists (per-step accuracies) become ``name/k``."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("step", "time") or isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            out[key] = float(value)
        elif isinstance(value, list) and all(isinstance(v, int | float) for v in value):
            out.update({f"{key}/{k}": float(v) for k, v in enumerate(value)})
    return out


class TensorBoardTracker:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, record: dict[str, Any], step: int) -> None:
        group = "heldout" if any(k.startswith("heldout") for k in record) else "train"
        for key, value in _scalars(record).items():
            self.writer.add_scalar(f"{group}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]) -> None:
        import wandb

        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=project, dir=str(run_dir), id=run_id, resume="allow", config=config)

    def log(self, record: dict[str, Any], step: int) -> None:
        self.run.log(_scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()


def open_trackers(names: tuple[str, ...], run_dir: Path, project: str, config: dict[str, Any]) -> list[Tracker]:
    """One tracker per name (rank 0 only: the caller passes ``()`` on other ranks)."""
    made: list[Tracker] = []
    for name in names:
        made.append(TensorBoardTracker(run_dir) if name == "tensorboard" else WandbTracker(run_dir, project, config))
    return made
