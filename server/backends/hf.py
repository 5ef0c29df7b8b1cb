"""The transformers backend: the verifier's base model (no lm_head), CPU here and CUDA when present.

Layer taps follow ``server/backends/base.py``: aux id ``k`` is the residual stream entering decoder
layer ``k`` (HF ``output_hidden_states[k]``), captured by a forward hook on the module that produces
it (``embed_tokens`` for ``k = 0``, decoder layer ``k - 1`` otherwise), and the final state is the
output of the last decoder layer before the final norm. Hooks keep only the tapped layers alive,
instead of all ``N + 1`` states that ``output_hidden_states=True`` would hold.

Batching depends on the dtype's contract (DESIGN.md §3.1: fp32 bitwise, bf16 within bf16 rounding):

* bf16 (the default): the batch is sorted by length and cut into groups padded on the right to their
  longest member, each group one forward call of at most ``max_batch_tokens`` padded tokens with at most
  ``MAX_PADDING_WASTE`` of them padding. No attention mask is needed: attention is causal, so a real
  position never sees the pad tokens after it. A sample's states then differ from a lone call only by
  kernel choice for the larger matmuls (bf16 rounding). On this 2-core CPU, padded groups of short chat
  samples run ~1.8x the tokens/s of one call per sequence (docs/performance.md, "Extraction").
* fp32: every sample's states must be bitwise equal to transformers on that sample alone, and matmul
  kernels pick their blocking by row count, so on CPU each sequence runs through its own call; on CUDA
  sequences of equal length share one call (no padding).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from client.prepare import tokenizer_sha256
from eagle3.models import DEFAULT_MODEL, resolve_model_dir
from server.backends.base import (
    BackendConfig,
    BackendError,
    BackendInfo,
    ProgressCallback,
    check_aux_layer_ids,
    default_aux_layer_ids,
)
from server.backends.dummy_model import build_dummy_model, dummy_revision, is_dummy

logger = logging.getLogger(__name__)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
MAX_PADDING_WASTE = 0.125  # bf16 groups: at most this share of a forward call's tokens is padding


def checkpoint_revision(model_dir: Path) -> str:
    """sha256 over config.json and the weight files' names and sizes (cheap: no weight bytes read)."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and path.name.endswith(WEIGHT_SUFFIXES):
            digest.update(f"\0{path.name}\0{path.stat().st_size}".encode())
    return digest.hexdigest()


class HfBackend:
    name = "hf"

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.model: Any = None
        self.info: BackendInfo | None = None
        self._taps: dict[int, torch.Tensor] = {}  # module slot -> its output for the current call
        self._hooks: list[Any] = []
        self._copy_stream: Any = None  # CUDA only: device-to-host copies (``_to_host``)

    def load(self, progress: ProgressCallback) -> BackendInfo:
        from transformers import AutoConfig, AutoModel

        started = time.monotonic()
        progress("resolving model", 0.0)
        dummy = is_dummy(self.config.model)
        model_dir = resolve_model_dir(DEFAULT_MODEL if dummy else self.config.model)  # dummy: the tokenizer's
        device = self.config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendError("--device cuda but torch sees no CUDA device")
        progress("loading weights", 0.1)
        if dummy:  # random weights of a named shape, made on the device (server/backends/dummy_model.py)
            vocab_size = int(AutoConfig.from_pretrained(model_dir).vocab_size)
            model, hf_config = build_dummy_model(self.config.model, vocab_size, DTYPES[self.config.dtype], device)
            revision = dummy_revision(self.config.model, vocab_size)
        else:  # on CUDA straight to the device (device_map): no full copy of the checkpoint in host memory
            hf_config = AutoConfig.from_pretrained(model_dir)
            placement = {"device_map": device} if device != "cpu" else {}
            model = AutoModel.from_pretrained(model_dir, dtype=DTYPES[self.config.dtype], **placement)  # no lm_head
            revision = checkpoint_revision(model_dir)
        n_layers = int(hf_config.num_hidden_layers)
        aux = check_aux_layer_ids(self.config.aux_layer_ids or default_aux_layer_ids(n_layers), n_layers)
        self.model = model.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)
        self._install_hooks(aux, n_layers)
        max_len = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
        max_model_len = self.config.max_model_len or max_len
        if max_len and max_model_len > max_len:
            raise BackendError(f"--max-model-len {max_model_len} exceeds the model's {max_len}")
        self.info = BackendInfo(
            model_id=self.config.model if dummy else os.path.basename(os.path.normpath(model_dir)),
            revision=revision,
            model_dir=str(model_dir),
            num_hidden_layers=n_layers,
            hidden_size=int(hf_config.hidden_size),
            vocab_size=int(self.model.get_input_embeddings().weight.shape[0]),
            max_model_len=max_model_len,
            dtype=self.config.dtype,
            aux_layer_ids=aux,
            tokenizer_sha256=tokenizer_sha256(model_dir),
            backend=self.name,
            device=device,
        )
        progress("warming up", 0.9)
        self.extract([[0] * min(8, max_model_len)])
        progress("ready", 1.0)
        logger.info(
            "hf backend: %s on %s (%s) loaded in %.1f s",
            model_dir,
            device,
            self.config.dtype,
            time.monotonic() - started,
        )
        return self.info

    def _install_hooks(self, aux: tuple[int, ...], n_layers: int) -> None:
        """Slot j of the output comes from ``self._taps[j]``; the last slot is layer N-1's output."""
        layers = self.model.layers
        sources = [self.model.get_input_embeddings() if k == 0 else layers[k - 1] for k in aux]
        sources.append(layers[n_layers - 1])
        for slot, module in enumerate(sources):
            self._hooks.append(module.register_forward_hook(self._make_hook(slot)))

    def _make_hook(self, slot: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            self._taps[slot] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.inference_mode()
    def _forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` [B, T] -> [B, T, len(aux) + 1, H] (B sequences of equal length T, no padding)."""
        assert self.info is not None
        self._taps.clear()
        self.model(input_ids=input_ids, use_cache=False)
        states = [self._taps[slot] for slot in range(self.info.n_layers_out)]  # each [B, T, H]
        self._taps.clear()
        return torch.stack(states, dim=2)  # [B, T, L+1, H]

    def extract(self, batch: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        if self.model is None or self.info is None:
            raise BackendError("backend not loaded")
        out: list[torch.Tensor | None] = [None] * len(batch)
        try:
            for group in self._groups(batch):
                width = max(len(batch[i]) for i in group)
                rows = torch.zeros((len(group), width), dtype=torch.long)  # [B, T]: right-padded with id 0
                for row, i in enumerate(group):
                    rows[row, : len(batch[i])] = torch.tensor(list(batch[i]), dtype=torch.long)
                states = self._to_host(self._forward(rows.to(self.device)))  # [B, T, L+1, H]
                for row, i in enumerate(group):
                    out[i] = states[row, : len(batch[i])]  # [T_i, L+1, H]: a prefix of a row, contiguous
            if self._copy_stream is not None:
                self._copy_stream.synchronize()  # every group's device-to-host copy has landed
        except (RuntimeError, ValueError, IndexError) as exc:
            raise BackendError(f"forward pass failed: {exc}") from exc
        return [t for t in out if t is not None]

    def _to_host(self, states: torch.Tensor) -> torch.Tensor:
        """CPU copy of ``states``. On CUDA: into pinned memory on a side stream, without waiting, so the
        copy of group k overlaps the forward pass of group k+1 (``extract`` synchronizes once at the
        end; torch's caching host allocator reuses the pinned blocks)."""
        if self.device.type != "cuda":
            return states.cpu()
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        host = torch.empty(states.shape, dtype=states.dtype, pin_memory=True)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the forward pass wrote it
        with torch.cuda.stream(self._copy_stream):
            host.copy_(states, non_blocking=True)
        states.record_stream(self._copy_stream)  # not reused by the next forward pass until copied
        return host

    def _groups(self, batch: Sequence[Sequence[int]]) -> list[list[int]]:
        """Indices into ``batch``, one list per forward call (see the module docstring)."""
        assert self.info is not None
        if self.info.dtype == "float32":
            if self.device.type == "cpu":
                return [[i] for i in range(len(batch))]
            by_len: dict[int, list[int]] = defaultdict(list)
            for i, ids in enumerate(batch):
                by_len[len(ids)].append(i)
            return list(by_len.values())
        groups: list[list[int]] = []
        group_tokens = 0
        for i in sorted(range(len(batch)), key=lambda j: len(batch[j])):
            n = len(batch[i])  # ascending: n is the width of the group if i joins it
            padded = (len(groups[-1]) + 1) * n if groups else 0
            if (
                groups
                and padded <= self.config.max_batch_tokens
                and group_tokens + n >= padded * (1 - MAX_PADDING_WASTE)
            ):
                groups[-1].append(i)
                group_tokens += n
            else:
                groups.append([i])
                group_tokens = n
        return groups

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
