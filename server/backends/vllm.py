"""The vLLM backend: production extraction (CUDA, tensor parallel) behind the same contract as ``hf``.

The engine runs vLLM's ``extract_hidden_states`` speculative method: the verifier's forward pass
records the residual stream at ``aux_layer_ids + (N,)`` (vLLM semantics, docs/architecture.md, "Layer ids": id ``k < N``
is the stream entering decoder layer ``k``, id ``N`` the last layer's output before the final norm)
and ``eagle3.server.backends.vllm_connector`` hands each finished sample over through a private tmpfs
directory (its docstring says why not memory). Each ``extract`` call is one ``LLM.generate`` with
``max_tokens=1``; the scheduler's token budget is vLLM's ``max_num_batched_tokens``, so a packed
batch is one forward step (a sample longer than the budget is prefilled in chunks).

Engine settings: prefix caching off (a cached prefix would skip the forward pass that records the
states), eager mode unless ``compile``, the tokenizer skipped (requests are token ids). Options in
``BackendConfig.vllm`` (``VllmOptions``, all optional; docs/vllm.md):

* ``kv_cache_gib``: KV cache size (CPU default 2 GiB; vLLM's ``VLLM_CPU_KVCACHE_SPACE`` overrides it
  there). CUDA default: sized by ``gpu_memory_utilization``.
* ``gpu_memory_utilization``: CUDA, default 0.9.
* ``compile``: let vLLM compile (CUDA graphs / inductor) instead of eager.
* ``hidden_states_dir``: where the handover directory is created (default ``/dev/shm``).
* ``engine_args``: any other ``EngineArgs`` field (expert parallel, quantization, ...), checked
  against this vLLM's ``EngineArgs`` before the engine starts; the fields above that this backend
  owns (``OWNED_ENGINE_ARGS``) are refused. The keyword arguments are built in
  ``eagle3.server.backends.vllm_settings`` (pure: no engine).

While ``vllm.LLM(...)`` starts the engine (tens of minutes for a large verifier), ``load`` reports the
engine's own steps (weights, memory profiling, KV cache, CUDA graphs, ready) as ``/readyz`` phases,
read from the log records of vLLM's processes (``eagle3.server.backends.vllm_phases``; docs/vllm.md).

Every returned sample is checked before it leaves: its token ids equal the request's, the shape is
``[n_tokens, len(aux) + 1, hidden]``, the dtype is ``info.dtype``, every value is finite; otherwise
``extract`` raises ``BackendError``. Only the ``vllm*`` backend modules import vllm (tests/unit/test_architecture.py).

Generation (``generate``) is vLLM's own ``LLM.generate`` on the same engine, one call per request (vLLM
batches its prompts continuously): ``temperature=0`` for greedy, else ``temperature``/``top_p`` with
``seed + i`` for prompt ``i`` when a seed is given; ``ignore_eos`` with our ``stop_token_ids``, so the
stop ids the request resolved are exactly what ends a reply. The extraction method's "draft" (the
sampled token itself) is verified like any speculative token, so greedy output is vLLM's greedy output
(tests/integration/test_vllm_generate.py compares it with an engine that has no extraction hooks). The
connector still writes each prompt's states on finish; they are waited for and deleted unread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from eagle3.core.json_log import restyle_as_json, root_logs_json
from eagle3.core.protocol.generate import Sampling
from eagle3.server.backends.base import (
    BackendConfig,
    BackendConfigError,
    BackendError,
    BackendInfo,
    Generation,
    ProgressCallback,
    WholeGeneration,
    cut_at_stop,
)
from eagle3.server.backends.dtypes import DTYPES
from eagle3.server.backends.engine_guard import DIR_PREFIX, mark_server, owner_tag, remove_stale_dirs
from eagle3.server.backends.identity import backend_info, open_checkpoint
from eagle3.server.backends.vllm_family import (
    check_engine_fit,
    check_vllm_target,
    family_engine_kwargs,
    kv_hint,
)
from eagle3.server.backends.vllm_phases import PhaseTracker, PhaseWatcher, engine_phase_log
from eagle3.server.backends.vllm_settings import (
    bind_cpu_workers,
    engine_arg_fields,
    engine_kwargs,
    export_package_root,
    handover_root,
    kv_cache_bytes,
)

logger = logging.getLogger(__name__)
HANDOVER_READERS = 8  # threads reading a batch's handover files (at most the allowed cores)


def all_finite(states: torch.Tensor) -> bool:
    """No NaN or inf in ``states``: min and max in one pass (both propagate NaN), 20x faster on CPU than
    ``isfinite(states).all()`` over bf16 (1,024 x 4 x 4,096: 21 against 451 ms on one core, bench/handover.py)."""
    return states.numel() == 0 or bool(torch.isfinite(torch.stack(torch.aminmax(states))).all())


def _drop_chat_warmup_warning(record: logging.LogRecord) -> bool:
    """vLLM warns with a traceback that it cannot warm up a chat template without a tokenizer; this
    backend never asks vLLM to render chats (requests are token ids), so the warning is noise."""
    return "Chat template warmup failed" not in record.getMessage()


class VllmBackend:
    name = "vllm"
    can_generate = True

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.llm: Any = None
        self.info: BackendInfo | None = None
        self.store_dir: str | None = None
        self.phase_dir: str | None = None  # the engine's phase log (vllm_phases.py), beside the handover dir
        self._sampling: Any = None
        self._load_hidden_states: Any = None
        self._cleanup_hidden_states: Any = None
        self.engine_phases: PhaseTracker | None = None  # the engine phases seen during load (vllm_phases.py)
        # handover readers: a batch's files are read and checked on up to this many cores at once
        self._reader = ThreadPoolExecutor(
            max_workers=min(HANDOVER_READERS, len(os.sched_getaffinity(0))), thread_name_prefix="eagle3-vllm-read"
        )

    def load(self, progress: ProgressCallback) -> BackendInfo:
        started = time.monotonic()
        ckpt = open_checkpoint(self.config, progress)
        model_dir, aux, n_layers = ckpt.model_dir, ckpt.aux_layer_ids, ckpt.num_hidden_layers
        check_vllm_target(ckpt)  # the family's traps, before the engine (server/backends/vllm_family.py)
        max_len = int(getattr(ckpt.text, "max_position_embeddings", 0) or 0)
        # vLLM's max_model_len counts the one token generate() makes: a prompt of exactly that length is
        # rejected. The engine gets one more position when the model has it; the longest sample served
        # (advertised as max_model_len in /v1/info, the SDK's pre-check) is one less than the engine's.
        engine_len = min(ckpt.max_model_len + 1, max_len) if max_len else ckpt.max_model_len + 1
        max_model_len = engine_len - 1
        ckpt = dataclasses.replace(ckpt, max_model_len=max_model_len)

        progress("importing vllm", 0.02)
        import vllm

        if root_logs_json():  # --log-format json: vLLM's own handler (set up at its import) writes JSON too
            restyle_as_json(logging.getLogger("vllm"))
        from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as stock
        from vllm.platforms import current_platform

        device = str(current_platform.device_type)
        if self.config.device not in ("auto", device):
            raise BackendConfigError(
                f"--device {self.config.device}, but this vLLM build ({vllm.__version__}) runs on {device}"
            )
        self._load_hidden_states, self._cleanup_hidden_states = stock.load_hidden_states, stock.cleanup_hidden_states
        self._sampling = vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        # before the engine: one sequence of the context must fit this KV cache (server/backends/vllm_family.py)
        check_engine_fit(ckpt, self.config, device, engine_len, kv_cache_bytes(self.config, device))
        server = mark_server()  # every engine process dies with this one (server/backends/engine_guard.py)
        root = handover_root(self.config)
        remove_stale_dirs(root)
        self.store_dir = tempfile.mkdtemp(prefix=DIR_PREFIX + owner_tag(), dir=root)
        kwargs = engine_kwargs(
            self.config, model_dir, [*aux, n_layers], engine_len, device, self.store_dir, engine_arg_fields(), server
        )
        kwargs = family_engine_kwargs(ckpt, DTYPES[self.config.dtype], device, kwargs)
        export_package_root()
        if device == "cpu":
            bind_cpu_workers(self.config.tensor_parallel_size)
        progress(f"starting vLLM {vllm.__version__} engine (tp={self.config.tensor_parallel_size}, {device})", 0.05)
        logging.getLogger("vllm.renderers.base").addFilter(_drop_chat_warmup_warning)
        # the engine's own phases, read from its log records (server/backends/vllm_phases.py)
        self.phase_dir = tempfile.mkdtemp(prefix=DIR_PREFIX + owner_tag() + "phases-", dir=root)
        phase_log = engine_phase_log(Path(self.phase_dir), kwargs, os.environ)
        self.engine_phases = PhaseTracker(progress, floor=0.05)
        try:
            with PhaseWatcher(phase_log, self.engine_phases) if phase_log else contextlib.nullcontext():
                self.llm = vllm.LLM(**kwargs)
            self.info = backend_info(ckpt, self.config, self.name, device, progress=progress)
            progress("warming up", 0.95)
            self.extract([[0] * min(8, max_model_len)])
        except Exception as exc:
            self.close()
            if isinstance(exc, BackendError):
                raise
            # the root cause is only in the engine processes' log: name the KV need, the usual one
            hint = kv_hint(ckpt, self.config, engine_len) if "initialization failed" in str(exc) else ""
            raise BackendError(f"vLLM engine failed to start: {type(exc).__name__}: {exc}{hint}") from exc
        progress("ready", 1.0)
        logger.info(
            "vllm backend: %s on %s (%s, tp=%d) loaded in %.1f s; handover dir %s",
            model_dir,
            device,
            self.config.dtype,
            self.config.tensor_parallel_size,
            time.monotonic() - started,
            self.store_dir,
        )
        return self.info

    def extract(self, batch: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        if self.llm is None or self.info is None:
            raise BackendError("backend not loaded")
        prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids in batch]
        try:
            outputs = self.llm.generate(prompts, self._sampling, use_tqdm=False)
        except (ValueError, TypeError) as exc:  # vLLM's input validation: this input can only fail again
            raise BackendError(f"vLLM rejected the input: {type(exc).__name__}: {exc}", retryable=False) from exc
        except Exception as exc:
            raise BackendError(f"vLLM generate failed: {type(exc).__name__}: {exc}") from exc
        if len(outputs) != len(batch):
            raise BackendError(f"vLLM returned {len(outputs)} outputs for {len(batch)} samples")
        paths = [(out.kv_transfer_params or {}).get("hidden_states_path") for out in outputs]

        def read(index: int) -> torch.Tensor:
            return self._checked(index, prompts[index]["prompt_token_ids"], self._load_hidden_states(paths[index]))

        try:  # the samples' files are read and checked in parallel (load_file and the checks release the GIL)
            for index, path in enumerate(paths):
                if not path:
                    raise BackendError(f"sample {index}: vLLM returned no hidden states (kv_transfer_params)")
            return list(self._reader.map(read, range(len(paths))))
        except (OSError, RuntimeError, ValueError) as exc:
            raise BackendError(f"reading vLLM hidden states failed: {type(exc).__name__}: {exc}") from exc
        finally:
            for path in paths:
                if path:
                    self._cleanup_hidden_states(path)

    def check_sampling(self, sampling: Sampling) -> None:
        """vLLM's own ``SamplingParams`` validation (e.g. temperature in [0, 2] in vLLM 0.32, where the
        wire allows up to 100): what it refuses is a 400 naming vLLM's limit, before any work."""
        self._sampling_params(sampling, 0)

    def _sampling_params(self, sampling: Sampling, i: int) -> Any:
        """The ``SamplingParams`` of prompt ``i``; vLLM's refusal is a non-retryable ``BackendError``."""
        import vllm

        try:
            return vllm.SamplingParams(
                max_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_p=1.0 if sampling.greedy else sampling.top_p,
                seed=None if sampling.seed is None or sampling.greedy else (sampling.seed + i) % (1 << 63),
                stop_token_ids=[int(t) for t in sampling.stop_token_ids or ()],
                ignore_eos=True,  # our stop ids are the whole rule (they include the eos ids by default)
                detokenize=False,
            )
        except Exception as exc:  # its validation error (VLLMValidationError in 0.32) or a ValueError: deterministic
            raise BackendError(f"vLLM refuses these sampling settings: {exc}", retryable=False) from exc

    def start_generation(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> WholeGeneration:
        """One slice: ``LLM.generate`` runs a request to its end (stopping it midway is not offered here)."""
        return WholeGeneration(lambda: self.generate(prompts, sampling))

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Generation]:
        """vLLM's ``LLM.generate`` on the request's prompts (module docstring)."""
        if self.llm is None or self.info is None:
            raise BackendError("backend not loaded")
        params = [self._sampling_params(sampling, i) for i in range(len(prompts))]
        inputs = [{"prompt_token_ids": [int(t) for t in ids]} for ids in prompts]
        try:
            outputs = self.llm.generate(inputs, params, use_tqdm=False)
        except (ValueError, TypeError) as exc:
            raise BackendError(f"vLLM rejected the input: {type(exc).__name__}: {exc}", retryable=False) from exc
        except Exception as exc:
            raise BackendError(f"vLLM generate failed: {type(exc).__name__}: {exc}") from exc
        for out in outputs:  # the connector wrote each prompt's states: wait for the write, then delete
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if path:
                self._discard_hidden_states(path)
        if len(outputs) != len(prompts):
            raise BackendError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        stops = [int(t) for t in sampling.stop_token_ids or ()]
        return [cut_at_stop(list(out.outputs[0].token_ids), stops, sampling.max_new_tokens) for out in outputs]

    def _discard_hidden_states(self, path: str) -> None:
        """Delete a handover file unread, once its writer released the lock (else it would appear later)."""
        try:
            with open(path + ".lock") as lock:
                fcntl.flock(lock, fcntl.LOCK_SH)  # sleeps until the writer's LOCK_EX is gone
        except FileNotFoundError:
            pass
        self._cleanup_hidden_states(path)

    def _checked(self, index: int, ids: list[int], data: dict[str, torch.Tensor]) -> torch.Tensor:
        """The sample's ``[T, L+1, H]`` states, or BackendError naming what is wrong with them."""
        assert self.info is not None
        info = self.info
        hidden, token_ids = data.get("hidden_states"), data.get("token_ids")
        if hidden is None or token_ids is None:
            raise BackendError(
                f"sample {index}: hidden-states file lacks {sorted({'hidden_states', 'token_ids'} - set(data))}"
            )
        want_shape = (len(ids), info.n_layers_out, info.hidden_size)
        if tuple(hidden.shape) != want_shape:
            raise BackendError(f"sample {index}: vLLM states have shape {tuple(hidden.shape)}, expected {want_shape}")
        if token_ids.tolist() != ids:
            raise BackendError(f"sample {index}: vLLM recorded other token ids than the request's")
        if hidden.dtype != DTYPES[info.dtype]:
            raise BackendError(f"sample {index}: vLLM states are {hidden.dtype}, expected {info.dtype}")
        if not all_finite(hidden):
            raise BackendError(f"sample {index}: vLLM states contain NaN or inf")
        return hidden.contiguous()  # [T, L+1, H]

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as exc:  # noqa: BLE001 (closing must not raise; the engine may be dead already)
                logger.warning("vLLM engine shutdown: %s", exc)
            del llm
        self._reader.shutdown(wait=True)
        for directory in (self.store_dir, self.phase_dir):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
        self.store_dir = self.phase_dir = None
