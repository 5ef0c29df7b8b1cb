"""What every backend does before and after starting its engine: open the checkpoint (text config,
layer count, aux ids, context length) and describe it as ``BackendInfo``. One place, so the hf and
vllm backends cannot report the same checkpoint differently.

The checkpoint's revision is a content hash of its weights (``core/identity.py::checkpoint_revision``):
on the first start of a checkpoint it reads every weight byte once, so it runs on a thread
(``RevisionJob``) from the moment the directory is known, while the engine loads the same files;
``backend_info`` waits for whatever is left. Later starts find every file's digest remembered."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.core.file_digests import FileDigests
from eagle3.core.identity import checkpoint_revision, tokenizer_sha256
from eagle3.core.layers import check_aux_layer_ids, default_aux_layer_ids
from eagle3.core.models import resolve_model_dir
from eagle3.server.backends.base import BackendConfig, BackendConfigError, BackendError, BackendInfo, ProgressCallback

logger = logging.getLogger(__name__)


class RevisionJob:
    """``checkpoint_revision(model_dir)`` on a daemon thread (a server that exits does not wait for it)."""

    report_every_s = 5.0  # while ``result`` waits

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.digests = FileDigests()
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._done = threading.Event()
        self._revision: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="eagle3-revision", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._revision = checkpoint_revision(self.model_dir, self.digests, self._stop)
        except BaseException as exc:  # noqa: BLE001 (handed to the thread that waits in result())
            self._error = exc
        finally:
            self._done.set()

    def cancel(self) -> None:
        self._stop.set()

    def result(self, progress: ProgressCallback | None = None, fraction: float = 0.9) -> str:
        """The revision; while it is still being computed, ``progress`` says so every few seconds."""
        while not self._done.wait(self.report_every_s):
            if progress is not None:
                progress(f"hashing the checkpoint's weights ({self.digests.hashed_bytes / 1e9:.1f} GB read)", fraction)
        if self._error is not None:
            raise BackendError(f"{self.model_dir}: cannot hash the weights for its revision: {self._error}")
        assert self._revision is not None
        if self.digests.hashed_bytes:
            logger.info(
                "%s: hashed %.1f GB of weights for its revision in %.1f s (remembered for later starts)",
                self.model_dir,
                self.digests.hashed_bytes / 1e9,
                time.monotonic() - self.started,
            )
        return self._revision


@dataclass(frozen=True)
class Checkpoint:
    model_dir: Path
    hf_config: Any  # transformers PretrainedConfig (the whole one; ``text`` is its language-model part)
    text: Any
    num_hidden_layers: int
    aux_layer_ids: tuple[int, ...]
    max_model_len: int
    revision: RevisionJob | None = None  # started by open_checkpoint; None: computed in backend_info


def open_checkpoint(config: BackendConfig, progress: ProgressCallback) -> Checkpoint:
    """Resolve ``config.model``, read its config (nested ``text_config`` of multimodal/MoE checkpoints
    included), check the aux layer ids and ``--max-model-len`` against it."""
    from transformers import AutoConfig

    progress("resolving model", 0.0)
    model_dir = resolve_model_dir(config.model)
    revision = RevisionJob(model_dir)  # reads the weights while the engine loads them
    try:
        hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=config.trust_remote_code)
        return dataclasses.replace(checkpoint_from_config(model_dir, hf_config, config), revision=revision)
    except BaseException:
        revision.cancel()
        raise


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


def backend_info(
    ckpt: Checkpoint,
    config: BackendConfig,
    backend: str,
    device: str,
    vocab_size: int | None = None,
    progress: ProgressCallback | None = None,
) -> BackendInfo:
    """``vocab_size``: the embedding's rows when the engine knows them (they may exceed the config's)."""
    revision = ckpt.revision.result(progress) if ckpt.revision else checkpoint_revision(ckpt.model_dir)
    return BackendInfo(
        model_id=os.path.basename(os.path.normpath(ckpt.model_dir)),
        revision=revision,
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
