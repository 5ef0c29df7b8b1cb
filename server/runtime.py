"""``Runtime``: what one server process owns (backend, scheduler, encoder threads, lifecycle phase).

Created by ``create_app`` and driven by its lifespan: ``start`` loads the backend in a background
thread (``/readyz`` reports the phase and progress) and warms up the whole request path
(``server/warmup.py``) before it reports ready; ``drain`` is the SIGTERM path; ``stop`` releases
everything. There are no module-level singletons: two apps in one process do not share state.

Drain (bounded): refuse new work, let open streams finish for ``drain_timeout_s``; then abort every
open request (queued samples are dropped, states of the pass in flight are discarded, each stream
ends with a retryable ERROR frame ``unavailable/draining``) and give the streams ``ABORT_GRACE_S``
to send it; ``stop`` waits at most ``STOP_WAIT_S`` for a forward pass still running (the worker is a
daemon thread: it does not hold up exit). ``server/serve.py`` adds a hard deadline on top.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from eagle3.core.masking import ChatTokenizer
from eagle3.core.protocol.frames import CODEC_NAMES
from eagle3.server.backends import Backend, BackendConfig, BackendInfo, make_backend
from eagle3.server.config import ServerSettings
from eagle3.server.load_history import expected_load_s, load_key, record_load_s
from eagle3.server.metrics import Metrics
from eagle3.server.scheduler import Scheduler, request_buffer_tokens
from eagle3.server.warmup import warm_up

logger = logging.getLogger(__name__)
ABORT_GRACE_S = 5.0  # after the drain timeout: streams get this long to send their ERROR frame
STOP_WAIT_S = 5.0  # stop(): the longest wait for a forward pass still running
STATE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}  # per element of the backend's output
DRAIN_ERROR = {
    "type": "unavailable",
    "reason": "draining",
    "retryable": True,
    "message": "server shut down before this request finished; retry the samples not received",
}


def load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None off glibc. Called after every forward pass: the pass's activations
    and the last pass's encoded states are freed by several threads into several malloc arenas, and
    without a trim the freed pages stay in the process (RSS creeps up with the dataset; with it, 1x and
    8x the data peak within a few MB, docs/performance.md "Extraction"). Costs about a millisecond."""
    try:
        trim: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


class Runtime:
    def __init__(self, settings: ServerSettings, backend: Backend | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.info: BackendInfo | None = None
        self.chat: ChatTokenizer | None = None
        self.metrics = Metrics()
        self._malloc_trim = load_malloc_trim()
        self.scheduler = Scheduler(
            self._extract,
            max_batch_tokens=settings.max_batch_tokens,
            max_inflight_tokens=settings.max_inflight_tokens,
            max_tenant_inflight_tokens=settings.max_tenant_inflight_tokens,
            metrics=self.metrics,
        )
        self.metrics.gauges = self.scheduler.gauges
        self.executor = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="eagle3-enc")
        self.status = "loading"  # loading | ready | failed | draining
        self.phase = "starting"
        self.progress = 0.0
        self.error: str | None = None
        self.started_at = time.monotonic()
        self._load_key = load_key(settings.model, settings.backend, settings.tensor_parallel_size or 1, settings.dtype)
        self._records_load = backend is None  # an injected backend (tests) is no evidence of a real load time
        self.expected_load_s = expected_load_s(self._load_key) if self._records_load else None
        self._thread: threading.Thread | None = None

    def _extract(self, batch: Any) -> Any:
        assert self.backend is not None
        states = self.backend.extract(batch)
        if self._malloc_trim is not None:
            self._malloc_trim(0)
        return states

    def _progress(self, phase: str, fraction: float) -> None:
        self.phase, self.progress = phase, max(0.0, min(1.0, float(fraction)))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._load, name="eagle3-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        s = self.settings
        try:
            if self.backend is None:
                config = BackendConfig(
                    model=s.model,
                    aux_layer_ids=s.aux_layer_ids,
                    dtype=s.dtype,
                    device=s.device,
                    max_batch_tokens=s.max_batch_tokens,
                    max_model_len=s.max_model_len,
                    tensor_parallel_size=s.tensor_parallel_size or 1,
                    trust_remote_code=s.trust_remote_code,
                    vllm=s.vllm_options,
                )
                self.backend = make_backend(s.backend, config)
            info = self.backend.load(self._progress)
            self._progress("loading tokenizer", 0.96)
            self.chat = load_chat_tokenizer(info.model_dir)
            self.info = info
            bytes_per_token = info.n_layers_out * info.hidden_size * STATE_BYTES.get(info.dtype, 4)
            self.scheduler.max_buffered_tokens = request_buffer_tokens(
                s.max_batch_tokens, bytes_per_token, s.request_buffer_bytes
            )
            self.scheduler.start()
            self._progress("warming up the request path", 0.98)
            timings = warm_up(self)
            logger.info("warm-up: %s", ", ".join(f"{k} {v:.2f}" for k, v in timings.items()))
            self.metrics.load_time_s = time.monotonic() - self.started_at
            if self._records_load:
                record_load_s(self._load_key, self.metrics.load_time_s)
            if self.status == "loading":
                self.status = "ready"
            self._progress("ready", 1.0)
            logger.info(
                "ready: %s (%s, %s) in %.1f s", info.model_id, info.backend, info.device, self.metrics.load_time_s
            )
        except Exception as exc:  # reported on /readyz; the process stays up for the operator to see it
            logger.exception("backend failed to load")
            self.error = f"{type(exc).__name__}: {exc}"
            self.status, self.phase = "failed", f"failed: {self.error}"[:500]

    async def drain(self) -> bool:
        """Refuse new work, let open streams finish for up to ``drain_timeout_s``, then abort them.
        True when every stream finished by itself."""
        self.status = "draining"
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.scheduler.n_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.scheduler.n_requests:
            return True
        logger.warning("drain timeout: aborting %d open stream(s)", self.scheduler.n_requests)
        self.scheduler.abort_all(DRAIN_ERROR)
        deadline = time.monotonic() + ABORT_GRACE_S
        while self.scheduler.n_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return False

    def stop(self) -> None:
        if self._thread is not None and self.info is not None and not self.scheduler.stop(timeout_s=STOP_WAIT_S):
            logger.warning("a forward pass is still running after %.0f s; exiting without it", STOP_WAIT_S)
        if self.backend is not None:
            self.backend.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def load_estimate(self) -> dict[str, float]:
        """``expected_s`` (the last load of the same model, backend, TP and dtype) and ``eta_s`` while
        loading, when a previous load was recorded; else nothing."""
        if self.status != "loading" or self.expected_load_s is None:
            return {}
        elapsed_s = time.monotonic() - self.started_at
        return {"expected_s": self.expected_load_s, "eta_s": round(max(0.0, self.expected_load_s - elapsed_s), 1)}

    def describe(self) -> dict[str, Any]:
        """``/v1/info`` body (call only when loaded)."""
        info, s = self.info, self.settings
        assert info is not None
        return {
            "protocol_version": 1,
            "model_id": info.model_id,
            "revision": info.revision,
            "backend": info.backend,
            "device": info.device,
            "dtype": info.dtype,
            "num_hidden_layers": info.num_hidden_layers,
            "aux_layer_ids": list(info.aux_layer_ids),
            "final_layer_id": info.final_layer_id,
            "final_norm_applied": False,
            "hidden_size": info.hidden_size,
            "vocab_size": info.vocab_size,
            "max_model_len": info.max_model_len,
            "tokenizer_sha256": info.tokenizer_sha256,
            "chat_template": self.chat is not None,
            "codecs": list(CODEC_NAMES),
            "default_codec": s.default_codec,
            "limits": {
                "max_batch_tokens": s.max_batch_tokens,
                "max_request_tokens": s.request_token_cap,
                "max_body_bytes": s.max_body_bytes,
                "max_inflight_tokens": s.max_inflight_tokens,
                "max_tenant_inflight_tokens": s.max_tenant_inflight_tokens,
                "max_payload_bytes": s.max_payload_bytes,
            },
        }


def load_chat_tokenizer(model_dir: str) -> ChatTokenizer | None:
    """The model's tokenizer with its chat template, or None (then only ``input_ids`` are accepted)."""
    from transformers import AutoTokenizer

    try:
        return ChatTokenizer(AutoTokenizer.from_pretrained(model_dir))
    except Exception as exc:  # noqa: BLE001 (any tokenizer failure means: no chat template)
        logger.warning("no chat tokenizer for %s (%s): requests must send input_ids", model_dir, exc)
        return None
