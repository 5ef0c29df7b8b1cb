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
import dataclasses
import gc
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from eagle3.core.masking import ChatTokenizer
from eagle3.core.protocol.error_types import error_meta
from eagle3.core.protocol.features import DTYPE_BF16, DTYPE_FP8
from eagle3.core.protocol.frames import CODEC_NAMES, Codec
from eagle3.core.protocol.generate import Sampling
from eagle3.core.protocol.wire import REQUEST_CODECS, ServerInfo
from eagle3.core.sizes import feature_sizes
from eagle3.server.backends import (
    Backend,
    BackendConfig,
    BackendError,
    BackendInfo,
    make_backend,
)
from eagle3.server.backends.base import GeneratingBackend, Generation, GenerationRun
from eagle3.server.chat_limits import ChatLimits, chat_limits
from eagle3.server.codec_choice import choose_codec, measure_encode_mb_s
from eagle3.server.config import ServerSettings
from eagle3.server.feature_cache import FeatureCache
from eagle3.server.generation import GenerateWork, default_stop_token_ids
from eagle3.server.load_checks import check_tokenizer, load_chat_tokenizer, retry_could_cure
from eagle3.server.load_history import expected_load_s, load_key, record_load_s
from eagle3.server.metrics import Metrics
from eagle3.server.request_limits import TenantConnections
from eagle3.server.request_state import GENERATE_SLICE_TOKENS, request_buffer_tokens
from eagle3.server.scheduler import Scheduler
from eagle3.server.stream import EncodeOptions, ExtractStream, stream_header
from eagle3.server.units import Sample
from eagle3.server.warmup import warm_up

logger = logging.getLogger(__name__)
ABORT_GRACE_S = 5.0  # after the drain timeout: streams get this long to send their ERROR frame
STOP_WAIT_S = 5.0  # stop(): the longest wait for a forward pass still running
TOKENIZE_WORKERS = 2  # threads validating/tokenizing request bodies (never the event loop)
TOKENIZE_QUEUE = 16  # requests validating or waiting for it at once; more get 503 overloaded
STATE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}  # per element of the backend's output
DRAIN_ERROR = error_meta(
    "unavailable", "server shut down before this request finished; retry the samples not received", reason="draining"
)


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


def encoder_threads_for_host() -> int:
    """One encoder thread per CPU this process may use: zstd and the byte-plane shuffle release the GIL,
    so on a 16-core host 16 threads encode ~16x one (a fixed 4 capped a GPU host at ~1/4 of its cores)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


class Runtime:
    def __init__(
        self, settings: ServerSettings, backend: Backend | None = None, *, freeze_gc_when_ready: bool = False
    ) -> None:
        if backend is None:
            settings.check_model()  # before any thread starts: no model, no backend to load
        self.settings = settings
        self.freeze_gc_when_ready = freeze_gc_when_ready  # only the process that exists to serve (serve.py)
        self.backend = backend
        self.info: BackendInfo | None = None
        self.chat: ChatTokenizer | None = None
        self.chat_limits: ChatLimits | None = None
        self.tokenize_pool = ThreadPoolExecutor(max_workers=TOKENIZE_WORKERS, thread_name_prefix="eagle3-tok")
        self.tokenize_slots = threading.BoundedSemaphore(TOKENIZE_QUEUE)
        self.metrics = Metrics()
        self.metrics.info.update(backend=settings.backend, model=settings.backend_model)  # eagle3_info; set at load
        self._malloc_trim = load_malloc_trim()
        self.generate_slice_tokens = GENERATE_SLICE_TOKENS  # Engine: new tokens per prompt in one slice
        self.scheduler = Scheduler(
            self,  # the Engine its units run on (server/units.py)
            max_batch_tokens=settings.max_batch_tokens,
            max_inflight_tokens=settings.max_inflight_tokens,
            max_tenant_inflight_tokens=settings.max_tenant_inflight_tokens,
            metrics=self.metrics,
            interactive_max_tokens=settings.interactive_max_tokens,
        )
        self.stop_token_ids: tuple[int, ...] = ()  # /v1/generate's default end of turn (set at load)
        self.metrics.gauges = self.scheduler.gauges
        self.cache: FeatureCache | None = None  # opened once the backend is loaded (server/feature_cache.py)
        self.encoder_threads = settings.encoder_threads or encoder_threads_for_host()
        self.connections = TenantConnections(settings.max_tenant_connections)  # open extracts per tenant
        self.executor = ThreadPoolExecutor(max_workers=self.encoder_threads, thread_name_prefix="eagle3-enc")
        self.encode_mb_s_per_core = 0.0  # zstd+planes, one thread (server/codec_choice.py)
        self.status = "loading"  # loading | ready | failed | draining
        self.phase = "starting"
        self.progress = 0.0
        self.error: str | None = None
        self.exit_status: int | None = None  # set on a load failure no restart can cure (see _failed)
        self.started_at = time.monotonic()
        self._load_key = load_key(
            settings.backend_model, settings.backend, settings.tensor_parallel_size or 1, settings.dtype
        )
        self._records_load = backend is None  # an injected backend (tests) is no evidence of a real load time
        self.expected_load_s = expected_load_s(self._load_key) if self._records_load else None
        self._thread: threading.Thread | None = None

    def extract(self, batch: Sequence[Sequence[int]]) -> Sequence[Any]:
        """Engine: one forward pass on the scheduler thread (timed, then the heap trimmed)."""
        assert self.backend is not None
        started = time.perf_counter()
        states = self.backend.extract(batch)
        self.metrics.inc("eagle3_stage_seconds_total", time.perf_counter() - started, stage="forward")
        if self._malloc_trim is not None:
            self._malloc_trim(0)
        return states

    @property
    def can_generate(self) -> bool:
        return isinstance(self.backend, GeneratingBackend) and self.backend.can_generate

    def check_sampling(self, sampling: Sampling) -> None:
        """The engine's own validation of ``sampling`` (a non-retryable ``BackendError``), before admission."""
        if isinstance(self.backend, GeneratingBackend):
            self.backend.check_sampling(sampling)

    def start_generation(self, work: GenerateWork) -> GenerationRun:
        """Engine: one ``/v1/generate`` request in progress, each slice timed on the scheduler thread."""
        backend = self.backend
        if not (isinstance(backend, GeneratingBackend) and backend.can_generate):
            raise BackendError(f"the {self.settings.backend} backend cannot generate", retryable=False)
        return _MeteredRun(backend.start_generation(work.prompts, work.sampling), self)

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
                    model=s.backend_model,
                    aux_layer_ids=s.aux_layer_ids,
                    dtype=s.dtype,
                    device=s.device,
                    max_batch_tokens=s.max_batch_tokens,
                    max_model_len=s.max_model_len,
                    tensor_parallel_size=s.tensor_parallel_size or 1,
                    trust_remote_code=s.trust_remote_code,
                    vllm=s.vllm_options,
                    synthetic=s.synthetic_options,
                )
                self._progress("checking the tokenizer", 0.0)
                check_tokenizer(s.backend_model, s.trust_remote_code)  # before any engine (core/tokenizer_probe.py)
                self.backend = make_backend(s.backend, config)
            info = self.backend.load(self._progress)
            self._progress("loading tokenizer", 0.96)
            self.chat = load_chat_tokenizer(info.model_dir, s.trust_remote_code)
            self.chat_limits = chat_limits(self.chat, info.max_model_len) if self.chat is not None else None
            self.stop_token_ids = default_stop_token_ids(info.model_dir, self.chat)
            self.info = info
            self.metrics.info.update(backend=info.backend, model=info.model_id)
            bytes_per_token = info.n_layers_out * info.hidden_size * STATE_BYTES.get(info.dtype, 4)
            self.scheduler.max_buffered_tokens = request_buffer_tokens(
                s.max_batch_tokens, bytes_per_token, s.request_buffer_bytes
            )
            if s.cache_on:
                self._open_cache(info)
            self.scheduler.start()
            self._progress("measuring the encoder", 0.97)
            self.encode_mb_s_per_core = measure_encode_mb_s()
            self._progress("warming up the request path", 0.98)
            timings = warm_up(self)
            logger.info("warm-up: %s", ", ".join(f"{k} {v:.2f}" for k, v in timings.items()))
            if self.freeze_gc_when_ready:
                # In `eagle3 serve` everything alive now lives as long as the process (modules, the model's
                # Python objects, the tokenizer: hundreds of thousands of tracked objects). Frozen, the cyclic
                # collector stops re-scanning them in every full pass: those passes were ~30 % of the event
                # loop's CPU while streaming (perf, docs/performance.md "Serving path"). Not for an app in a
                # process that outlives it (tests, embedding): its frozen cycles would never be collected.
                gc.collect()
                gc.freeze()
            self.metrics.load_time_s = time.monotonic() - self.started_at
            if self._records_load:
                record_load_s(self._load_key, self.metrics.load_time_s)
            if self.status == "loading":
                self.status = "ready"
            self._progress("ready", 1.0)
            logger.info(
                "ready: %s (%s, %s) in %.1f s", info.model_id, info.backend, info.device, self.metrics.load_time_s
            )
        except Exception as exc:  # noqa: BLE001 - any load failure is reported on /readyz (see _failed)
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        """A load failure: ``failed`` on /readyz. A configuration error (``retry_could_cure`` False) also
        sets ``exit_status`` 2: ``eagle3 serve`` then exits (server/serve.py), as ``vllm serve`` does,
        instead of staying up until a liveness probe restarts it into the same error."""
        self.error = f"{type(exc).__name__}: {exc}"
        self.status, self.phase = "failed", f"failed: {self.error}"[:500]
        if retry_could_cure(exc):
            logger.exception("backend failed to load")
        else:
            logger.error("backend cannot load with these settings (a restart would fail the same way): %s", exc)
            self.exit_status = 2

    def _open_cache(self, info: BackendInfo) -> None:
        """The feature cache for this backend's identity (server/feature_cache.py); its series join /metrics."""
        s = self.settings
        engine: dict[str, object] = {"tensor_parallel_size": s.tensor_parallel_size or 1}
        if info.backend == "vllm":
            options = s.vllm_options
            engine["vllm"] = {"compile": options.compile, "engine_args": options.engine_args}
        cache = FeatureCache.open(
            info, engine, s.cache_memory_bytes, s.cache_dir, s.cache_disk_bytes, per_tenant=s.cache_scope == "tenant"
        )
        self.cache = self.scheduler.cache = cache
        self.metrics.gauges = lambda: itertools.chain(self.scheduler.gauges(), cache.gauges())
        self.metrics.scrape_counters = cache.counters

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
        if self.cache is not None:
            self.cache.close()  # queued disk writes land first (bounded wait)
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def load_estimate(self) -> dict[str, float]:
        """``expected_s`` (the last load of the same model, backend, TP and dtype) and ``eta_s`` while
        loading, when a previous load was recorded; else nothing."""
        if self.status != "loading" or self.expected_load_s is None:
            return {}
        elapsed_s = time.monotonic() - self.started_at
        return {"expected_s": self.expected_load_s, "eta_s": round(max(0.0, self.expected_load_s - elapsed_s), 1)}

    def open_stream(
        self,
        request_id: str,
        tenant: str,
        samples: list[Sample],
        codec: Codec,
        zstd_level: int = 1,
        *,
        use_cache: bool = True,
        fp8: bool = False,
    ) -> ExtractStream:
        """Admit ``samples`` (``AdmissionError`` when over a budget) and return the stream that will
        carry their states. The one way a request becomes a stream: the route and the warm-up both use it.
        ``use_cache``: False for a request's ``"cache": "bypass"`` (neither looked up nor stored). ``fp8``: the
        request's ``"dtype": "float8_e4m3fn"`` (the states leave as FP8; the cache keeps them lossless)."""
        assert self.info is not None
        s = self.settings
        req = self.scheduler.submit(request_id, tenant, samples, use_cache=use_cache)
        header = dataclasses.replace(
            stream_header(self.info, request_id, len(samples), req.n_tokens, s.max_payload_bytes),
            codec=next(name for name, c in CODEC_NAMES.items() if c == codec),
            dtype=DTYPE_FP8 if fp8 else DTYPE_BF16,
        )
        opts = EncodeOptions(codec, zstd_level, s.max_payload_bytes, fp8)
        return ExtractStream(
            self.scheduler, req, header, opts, self.executor, self.metrics, s.heartbeat_s, s.stream_chunk_bytes
        )

    def codec_for(self, name: str, peer: str | None) -> Codec:
        """The codec of one request (``name``: the request's or the server's default; ``auto`` decides)."""
        return choose_codec(name, peer, self.encode_mb_s_per_core, self.encoder_threads, self.settings.link_mb_s)

    def describe(self) -> ServerInfo:
        """``/v1/info`` (call only when loaded)."""
        info, s = self.info, self.settings
        assert info is not None
        return ServerInfo(
            **info.identity.as_fields(),
            backend=info.backend,
            device=info.device,
            dtype=info.dtype,
            num_hidden_layers=info.num_hidden_layers,
            max_model_len=info.max_model_len,
            chat_template=self.chat is not None,
            codecs=REQUEST_CODECS,
            default_codec=s.default_codec,
            benchmark_only=info.backend == "synthetic",  # synthetic states, not a model's
            feature_cache=self.cache.describe() if self.cache is not None else {},
            interactive_max_tokens=s.interactive_max_tokens,
            can_generate=self.can_generate,
            stop_token_ids=self.stop_token_ids,
            feature_bytes=feature_sizes(info.n_layers_out, info.hidden_size).as_dict(),  # as extract stores them
            codec_auto={
                "encode_mb_s_per_core": round(self.encode_mb_s_per_core, 1),
                "encoder_threads": self.encoder_threads,
                "link_mb_s": s.link_mb_s,
            },
            limits={
                "max_batch_tokens": s.max_batch_tokens,
                "max_request_tokens": s.request_token_cap,
                "max_body_bytes": s.max_body_bytes,
                "max_inflight_tokens": s.max_inflight_tokens,
                "max_tenant_inflight_tokens": s.max_tenant_inflight_tokens,
                "max_payload_bytes": s.max_payload_bytes,
            },
        )


class _MeteredRun:
    """A backend's ``GenerationRun`` whose slices count as the ``generate`` stage (then the heap is trimmed)."""

    def __init__(self, run: GenerationRun, rt: Runtime) -> None:
        self.run, self.rt = run, rt

    @property
    def generated_tokens(self) -> int:
        return self.run.generated_tokens

    def advance(self, max_new_tokens: int) -> list[Generation] | None:
        started = time.perf_counter()
        try:
            return self.run.advance(max_new_tokens)
        finally:
            self.rt.metrics.inc("eagle3_stage_seconds_total", time.perf_counter() - started, stage="generate")
            if self.rt._malloc_trim is not None:
                self.rt._malloc_trim(0)
