"""The transformers backend: the verifier's base model (no lm_head), CPU here and CUDA when present.

Layer taps follow ``server/backends/base.py``: aux id ``k`` is the residual stream entering decoder
layer ``k`` (HF ``output_hidden_states[k]``), captured by a forward hook on the module that produces
it (``embed_tokens`` for ``k = 0``, decoder layer ``k - 1`` otherwise), and the final state is the
output of the last decoder layer before the final norm. Hooks keep only the tapped layers alive,
instead of all ``N + 1`` states that ``output_hidden_states=True`` would hold.

Batching depends on the dtype's contract (docs/architecture.md, "Layer ids": fp32 bitwise, bf16 within bf16 rounding):

* bf16 (the default): the batch is sorted by length and cut into groups padded on the right to their
  longest member, each group one forward call of at most ``max_batch_tokens`` padded tokens with at most
  ``MAX_PADDING_WASTE`` of them padding. No attention mask is needed: attention is causal, so a real
  position never sees the pad tokens after it. A sample's states then differ from a lone call only by
  kernel choice for the larger matmuls (bf16 rounding). On this 2-core CPU, padded groups of short chat
  samples run ~1.8x the tokens/s of one call per sequence (docs/performance.md, "Extraction").
* fp32: every sample's states must be bitwise equal to transformers on that sample alone, and matmul
  kernels pick their blocking by row count, so on CPU each sequence runs through its own call; on CUDA
  sequences of equal length share one call (no padding).

Generation (``generate``): the checkpoint is loaded as ``AutoModelForCausalLM`` (extraction runs its
``base_model``, so the lm_head costs no extraction time) and each request is transformers' own
``generate``: its prompts left-padded into one batch (as transformers batches them), greedy or
sampled under ``torch.manual_seed(seed)`` inside ``fork_rng`` (the server's global RNG is untouched),
run in slices of a few new tokens that continue from the KV cache and the generator's state
(server/backends/hf_generation.py), so the scheduler interleaves other work and stops a request whose
client left. A one-prompt request is therefore transformers' ``generate`` on that prompt alone, token
for token.
``--model dummy:<shape>`` has no lm_head: ``can_generate`` is False.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from eagle3.core.layers import tap_module
from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir
from eagle3.core.protocol.generate import Sampling
from eagle3.server.backends.base import (
    BackendConfig,
    BackendConfigError,
    BackendError,
    BackendInfo,
    Generation,
    ProgressCallback,
)
from eagle3.server.backends.dtypes import DTYPES
from eagle3.server.backends.dummy_model import build_dummy_model, dummy_revision, is_dummy
from eagle3.server.backends.hf_generation import HfGenerationRun
from eagle3.server.backends.identity import backend_info, checkpoint_from_config, open_checkpoint

logger = logging.getLogger(__name__)
MAX_PADDING_WASTE = 0.125  # bf16 groups: at most this share of a forward call's tokens is padding


def load_language_model(model_dir: Any, dtype: torch.dtype, trust_remote_code: bool, placement: dict[str, Any]) -> Any:
    """``AutoModelForCausalLM``; a multimodal wrapper that transformers maps only as image-text-to-text
    (Kimi-K2.5's ``kimi_k25``: a DeepSeek-V3 language model beside a vision tower) loads as that."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code, **placement}
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        return AutoModelForImageTextToText.from_pretrained(model_dir, **kwargs)


def text_decoder(causal: Any) -> Any:
    """The decoder stack layer ids count in (``layers`` and the token embedding): the causal LM's base
    model, or a wrapper's ``language_model`` (Kimi-K2.5: ``model.language_model``, a ``DeepseekV3Model``)."""
    base = causal.base_model
    inner = getattr(base, "language_model", None)
    return base if hasattr(base, "layers") or inner is None else inner


class HfBackend:
    name = "hf"

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.model: Any = None  # the base model (decoder stack, no lm_head): extraction
        self.lm_model: Any = None  # the causal LM around it: generation (None for dummy models)
        self.can_generate = False
        self.info: BackendInfo | None = None
        self._taps: dict[int, torch.Tensor] = {}  # module slot -> its output for the current call
        self._hooks: list[Any] = []
        self._copy_stream: Any = None  # CUDA only: device-to-host copies (``_to_host``)

    def load(self, progress: ProgressCallback) -> BackendInfo:
        from transformers import AutoConfig

        started = time.monotonic()
        device = self.config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendConfigError("--device cuda but torch sees no CUDA device")
        if is_dummy(self.config.model):  # random weights of a named shape, made on the device (dummy_model.py)
            progress("resolving model", 0.0)
            model_dir = resolve_model_dir(DEFAULT_MODEL)  # the tokenizer's
            vocab_size = int(AutoConfig.from_pretrained(model_dir).vocab_size)
            progress("loading weights", 0.1)
            model, hf_config = build_dummy_model(self.config.model, vocab_size, DTYPES[self.config.dtype], device)
            ckpt = checkpoint_from_config(model_dir, hf_config, self.config)
        else:  # on CUDA straight to the device (device_map): no full copy of the checkpoint in host memory
            ckpt = open_checkpoint(self.config, progress)
            progress("loading weights", 0.1)
            placement = {"device_map": device} if device != "cpu" else {}
            causal = load_language_model(
                ckpt.model_dir, DTYPES[self.config.dtype], self.config.trust_remote_code, placement
            )
            self.lm_model = causal.to(device).eval().requires_grad_(False)
            self.can_generate = True
            model = text_decoder(causal)  # the same modules: extraction never runs the lm_head
        model_dir = ckpt.model_dir
        self.model = model.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)
        self._install_hooks(ckpt.aux_layer_ids, ckpt.num_hidden_layers)
        vocab_rows = int(self.model.get_input_embeddings().weight.shape[0])
        self.info = backend_info(ckpt, self.config, self.name, device, vocab_size=vocab_rows, progress=progress)
        if is_dummy(self.config.model):
            revision = dummy_revision(self.config.model, vocab_rows)
            self.info = dataclasses.replace(self.info, model_id=self.config.model, revision=revision)
        max_model_len = ckpt.max_model_len
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
        for slot, layer_id in enumerate((*aux, n_layers)):
            module = tap_module(self.model, layer_id)
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

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Generation]:
        """transformers' ``generate`` on the request's prompts as one left-padded batch (module docstring)."""
        replies = self.start_generation(prompts, sampling).advance(sampling.max_new_tokens)
        assert replies is not None  # one slice of max_new_tokens finishes the request
        return replies

    def check_sampling(self, sampling: Sampling) -> None:
        """transformers samples any temperature the wire allows ((0, 100]) and any top_p in (0, 1]."""

    def start_generation(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> HfGenerationRun:
        """The request as a run of slices (server/backends/hf_generation.py): the same replies as ``generate``."""
        if self.lm_model is None:
            raise BackendError(
                f"{self.config.model}: no lm_head to generate with (a dummy model); serve a checkpoint",
                retryable=False,
            )
        # the extraction hooks fire on every decoding step: their taps are dropped after each slice
        return HfGenerationRun(self.lm_model, self.device, prompts, sampling, after_call=self._taps.clear)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.model = None
        self.lm_model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
