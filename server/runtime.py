"""``Runtime``: what one server process owns (backend, scheduler, encoder threads, lifecycle phase).

Created by ``create_app`` and driven by its lifespan: ``start`` loads the backend in a background
thread (``/readyz`` reports the phase and progress), ``drain`` is the SIGTERM path, ``stop`` releases
everything. There are no module-level singletons: two apps in one process do not share state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from client.masking import ChatTokenizer
from client.protocol.frames import CODEC_NAMES
from server.backends import Backend, BackendConfig, BackendInfo, make_backend
from server.config import ServerSettings
from server.metrics import Metrics
from server.scheduler import Scheduler

logger = logging.getLogger(__name__)


class Runtime:
    def __init__(self, settings: ServerSettings, backend: Backend | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.info: BackendInfo | None = None
        self.chat: ChatTokenizer | None = None
        self.metrics = Metrics()
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
        self._thread: threading.Thread | None = None

    def _extract(self, batch: Any) -> Any:
        assert self.backend is not None
        return self.backend.extract(batch)

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
                    tensor_parallel_size=s.tensor_parallel_size,
                    extra=s.backend_extra,
                )
                self.backend = make_backend(s.backend, config)
            info = self.backend.load(self._progress)
            self._progress("loading tokenizer", 1.0)
            self.chat = load_chat_tokenizer(info.model_dir)
            self.info = info
            self.scheduler.start()
            self.metrics.load_time_s = time.monotonic() - self.started_at
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

    async def drain(self) -> None:
        """Refuse new work, let open streams finish for up to ``drain_timeout_s``, then abort them."""
        self.status = "draining"
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.scheduler.n_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.scheduler.n_requests:
            logger.warning("drain timeout: aborting %d open stream(s)", self.scheduler.n_requests)
            self.scheduler.abort_all(
                {
                    "type": "unavailable",
                    "reason": "draining",
                    "retryable": True,
                    "message": "server shut down before this request finished",
                }
            )
            for _ in range(100):
                if not self.scheduler.n_requests:
                    break
                await asyncio.sleep(0.05)

    def stop(self) -> None:
        if self._thread is not None and self.info is not None:
            self.scheduler.stop()
        if self.backend is not None:
            self.backend.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

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
