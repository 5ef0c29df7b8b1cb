"""Admission and token-budgeted scheduling of samples from every active request onto one backend.

* Admission reserves a request's tokens against a per-tenant and a global in-flight budget (tokens
  admitted and not yet streamed out): over the tenant's quota is a 429, a full server a 503.
* One worker thread packs samples into ``extract`` calls of at most ``max_batch_tokens`` tokens (a
  sample alone over the budget runs alone), taking turns across tenants by tokens served: the tenant
  with the fewest served tokens goes next (a tenant that becomes active starts level with the least
  served active one, so it neither banks idle time nor pays for old work).
* Each request has a bounded output buffer (``max_buffered_tokens`` of running, finished and not yet
  streamed states; ``request_buffer_tokens`` sizes it: two forward passes' worth, so a lone request
  fills pass k+1 while pass k is being encoded and sent, capped in bytes, never below one full pass);
  while it is full the request's samples are not scheduled, so a slow reader pauses only itself.
* Small requests (``interactive_max_tokens``) get forward passes of their own ahead of bulk work,
  within the fairness rules (server/lanes.py). Before each pass its samples are looked up in the
  feature cache and only the misses reach the backend (server/feature_cache.py).
* ``close`` (called exactly once per request, from the stream's ``finally``) drops the request's
  remaining work and returns whatever budget it still holds; releases never exceed the reservation.
* A generate request (``POST /v1/generate``, server/generate.py) is one ``Sample`` whose ``generation``
  is set: it is admitted, packed and taken in turn like any sample, charged prompt + ``max_new_tokens``
  tokens (``n_tokens``), run by the ``generate`` function (one call per unit, after the pass's
  extraction call); afterwards the tenant's fairness clock gives back the tokens it did not generate,
  so generated tokens count toward a tenant's share exactly like extracted ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from eagle3.core.errors import Eagle3Error
from eagle3.core.protocol.error_types import error_meta
from eagle3.server.feature_cache import FeatureCache, compute_with_cache
from eagle3.server.lanes import BULK, lane_of, lane_requests
from eagle3.server.metrics import Metrics

logger = logging.getLogger(__name__)
ExtractFn = Callable[[Sequence[Sequence[int]]], Sequence[Any]]
GenerateFn = Callable[[Any], Any]  # a Sample's ``generation`` -> its result (server/generate.py)


def request_buffer_tokens(max_batch_tokens: int, bytes_per_token: int, max_buffer_bytes: int) -> int:
    """Per-request output buffer in tokens: ``2 * max_batch_tokens`` (double buffering), at most
    ``max_buffer_bytes`` of states, but never less than one full forward pass (else a request alone
    could never fill a pass)."""
    by_bytes = max_buffer_bytes // max(1, bytes_per_token)
    return max(max_batch_tokens, min(2 * max_batch_tokens, by_bytes))


def sample_error(exc: Exception) -> dict[str, Any]:
    """A SAMPLE_ERROR's ``error`` for the engine's failure on one sample alone: ``invalid_sample``
    (deterministic) when the backend says the input was rejected, else ``backend_error`` (retryable)."""
    type_ = "backend_error" if getattr(exc, "retryable", True) else "invalid_sample"
    return error_meta(type_, f"{type(exc).__name__}: {exc}"[:500])


class AdmissionError(Eagle3Error):
    """Refused before any work: maps to an HTTP error (429 rate_limited, 503 unavailable)."""

    def __init__(self, status: int, type_: str, reason: str, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.status, self.type, self.reason, self.retry_after_s = status, type_, reason, retry_after_s


@dataclass(frozen=True)
class Sample:
    index: int  # position in the request
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    generation: Any = None  # a GenerateWork (server/generate.py): this unit is a whole generate request

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids) if self.generation is None else int(self.generation.n_tokens)


@dataclass
class Result:
    sample: Sample
    states: Any = None  # torch.Tensor [n_tokens, L+1, H] on success
    error: dict[str, Any] | None = None  # {type, message, retryable} on failure


@dataclass(eq=False)
class Request:
    request_id: str
    tenant: str
    samples: list[Sample]
    lock: threading.Lock
    loop: asyncio.AbstractEventLoop
    pending: deque[Sample] = field(default_factory=deque)  # not yet handed to the backend
    results: deque[Result] = field(default_factory=deque)  # finished, not yet taken by the stream
    outstanding_tokens: int = 0  # running or buffered (the output queue's fill)
    released_tokens: int = 0
    closed: bool = False
    abort_error: dict[str, Any] | None = None  # set by abort_all: the stream ends with ERROR
    event: asyncio.Event = field(default_factory=asyncio.Event)
    admitted_at: float = field(default_factory=time.monotonic)  # for the latency histograms
    first_scheduled: bool = False
    lane: str = BULK  # server/lanes.py
    use_cache: bool = True  # the request's "cache": "use" (else "bypass")

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.samples)

    def notify(self) -> None:
        # The stream's loop may be gone (shutdown, or closed between a check and the call): nobody waits.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.event.set)

    def take_results(self) -> list[Result]:
        """Everything finished so far, without waiting (possibly nothing)."""
        with self.lock:
            out = list(self.results)
            self.results.clear()
        return out

    async def next_results(self, timeout_s: float) -> list[Result]:
        """Everything finished so far; waits up to ``timeout_s`` when nothing is (an empty list then)."""
        with self.lock:
            ready = bool(self.results) or self.abort_error is not None
            if not ready:
                self.event.clear()
        if not ready:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.event.wait(), timeout_s)
        with self.lock:
            out = list(self.results)
            self.results.clear()
        return out


class Scheduler:
    def __init__(
        self,
        extract: ExtractFn,
        *,
        max_batch_tokens: int,
        max_inflight_tokens: int,
        max_tenant_inflight_tokens: int,
        max_buffered_tokens: int | None = None,
        metrics: Metrics | None = None,
        interactive_max_tokens: int = 0,
        cache: FeatureCache | None = None,
        generate: GenerateFn | None = None,
    ) -> None:
        self.extract = extract
        self.generate = generate
        self.max_batch_tokens = max_batch_tokens
        self.max_inflight_tokens = max_inflight_tokens
        self.max_tenant_inflight_tokens = max_tenant_inflight_tokens
        self.max_buffered_tokens = max_buffered_tokens or 2 * max_batch_tokens  # Runtime sets it in bytes
        self.metrics = metrics or Metrics()
        self.interactive_max_tokens = interactive_max_tokens  # 0: no interactive lane
        self.cache = cache  # set by Runtime once the backend is loaded (its identity is the cache's namespace)
        self._cond = threading.Condition()
        self._lock = threading.Lock()  # guards requests' result queues (shared with each Request)
        self._requests: list[Request] = []  # admitted, not closed; FIFO
        self._served: dict[str, int] = {}  # tenant -> tokens scheduled (fairness clock)
        self.inflight_tokens = 0
        self.tenant_inflight: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.throughput_tok_s = 0.0  # EWMA, for Retry-After

    # ---- admission (event loop) ----

    def submit(self, request_id: str, tenant: str, samples: list[Sample], *, use_cache: bool = True) -> Request:
        n_tokens = sum(s.n_tokens for s in samples)
        with self._cond:
            tenant_now = self.tenant_inflight.get(tenant, 0)
            if tenant_now + n_tokens > self.max_tenant_inflight_tokens:
                self.metrics.inc("eagle3_rejections_total", tenant=tenant, reason="tenant_quota")
                raise AdmissionError(
                    429,
                    "rate_limited",
                    "tenant_quota",
                    f"tenant {tenant!r} has {tenant_now} tokens in flight; {n_tokens} more would "
                    f"exceed its quota of {self.max_tenant_inflight_tokens}",
                    self._retry_after_s(tenant_now + n_tokens - self.max_tenant_inflight_tokens),
                )
            if self.inflight_tokens + n_tokens > self.max_inflight_tokens:
                self.metrics.inc("eagle3_rejections_total", tenant=tenant, reason="overloaded")
                raise AdmissionError(
                    503,
                    "unavailable",
                    "overloaded",
                    f"server has {self.inflight_tokens} tokens in flight; {n_tokens} more would "
                    f"exceed {self.max_inflight_tokens}",
                    self._retry_after_s(self.inflight_tokens + n_tokens - self.max_inflight_tokens),
                )
            req = Request(request_id, tenant, samples, self._lock, asyncio.get_running_loop(), use_cache=use_cache)
            req.lane = lane_of(n_tokens, self.interactive_max_tokens)
            req.pending.extend(samples)
            if not self._tenant_active(tenant):
                others = [self._served[t] for t in self._active_tenants()]
                self._served[tenant] = min(others) if others else self._served.get(tenant, 0)
            self._requests.append(req)
            self.inflight_tokens += n_tokens
            self.tenant_inflight[tenant] = tenant_now + n_tokens
            self.metrics.inc("eagle3_requests_total", tenant=tenant)
            self._cond.notify_all()
        return req

    def _retry_after_s(self, excess_tokens: int) -> int:
        rate = self.throughput_tok_s or 1000.0
        return max(1, min(60, math.ceil(excess_tokens / rate)))

    # ---- the stream's side (event loop) ----

    def consumed(self, req: Request, result: Result) -> None:
        """The stream took ``result`` off the request's buffer: room for more of its samples."""
        with self._cond:
            req.outstanding_tokens -= result.sample.n_tokens
            self._cond.notify_all()

    def release(self, req: Request, n_tokens: int) -> None:
        """Return up to ``n_tokens`` of ``req``'s reservation (never more than it holds)."""
        with self._cond:
            amount = max(0, min(n_tokens, req.n_tokens - req.released_tokens))
            if not amount:
                return
            req.released_tokens += amount
            self.inflight_tokens -= amount
            self.tenant_inflight[req.tenant] -= amount
            if not self.tenant_inflight[req.tenant]:
                del self.tenant_inflight[req.tenant]

    def close(self, req: Request) -> None:
        """End of the stream (complete, failed or disconnected): drop remaining work, return budget."""
        with self._cond:
            if req.closed:
                return
            req.closed = True
            if req.released_tokens < req.n_tokens and req.abort_error is None:
                self.metrics.inc("eagle3_cancellations_total", tenant=req.tenant)
            req.pending.clear()
            self._requests.remove(req)
            self._cond.notify_all()
        self.metrics.observe("eagle3_request_duration_seconds", time.monotonic() - req.admitted_at)
        self.release(req, req.n_tokens)

    def abort_all(self, error: dict[str, Any]) -> None:
        """Every open request's stream ends with an ERROR frame carrying ``error`` (drain timeout)."""
        with self._cond:
            for req in self._requests:
                req.abort_error = error
                req.pending.clear()
                req.notify()

    def forget_tenant(self, tenant: str) -> None:
        """Drop ``tenant``'s fairness clock when it has no open request (the warm-up's tenant)."""
        with self._cond:
            if not any(r.tenant == tenant for r in self._requests):
                self._served.pop(tenant, None)

    # ---- gauges ----

    @property
    def n_requests(self) -> int:
        return len(self._requests)

    def queue_depth(self) -> dict[str, int]:
        """Samples waiting for the backend, per tenant."""
        with self._cond:
            out: dict[str, int] = {}
            for req in self._requests:
                out[req.tenant] = out.get(req.tenant, 0) + len(req.pending)
            return out

    def gauges(self) -> Iterator[tuple[str, str, tuple[tuple[str, str], ...], float]]:
        yield "eagle3_inflight_tokens", "Tokens admitted and not yet streamed out", (), self.inflight_tokens
        for tenant, n in sorted(dict(self.tenant_inflight).items()):
            yield "eagle3_tenant_inflight_tokens", "In-flight tokens per tenant", (("tenant", tenant),), n
        yield "eagle3_active_requests", "Open extract streams", (), self.n_requests
        for tenant, n in sorted(self.queue_depth().items()):
            yield "eagle3_queue_samples", "Samples waiting for the backend per tenant", (("tenant", tenant),), n

    # ---- the worker thread ----

    def start(self) -> None:
        """Start the worker thread, unless ``stop`` came first. Under the lock, and published only once
        started: a ``stop`` racing the end of a load (the server shut down as its model became ready) either
        sees no thread or a started one, never one it cannot join."""
        thread = threading.Thread(target=self._run, name="eagle3-scheduler", daemon=True)
        with self._cond:
            if self._stopping:
                return
            thread.start()  # returns once the thread runs; it takes the lock only after we release it
            self._thread = thread

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop the worker after its current forward pass; wait at most ``timeout_s`` (None: forever).
        False if the pass is still running then (the thread is a daemon: it does not hold up exit)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        return True

    def _active_tenants(self) -> set[str]:
        return {r.tenant for r in self._requests if r.pending}

    def _tenant_active(self, tenant: str) -> bool:
        return any(r.tenant == tenant and r.pending for r in self._requests)

    def _schedulable(self, req: Request) -> bool:
        if not req.pending or req.closed:
            return False
        need = req.pending[0].n_tokens
        return req.outstanding_tokens == 0 or req.outstanding_tokens + need <= self.max_buffered_tokens

    def pick_batch(self) -> list[tuple[Request, Sample]]:
        """Fill one forward pass (call with the condition held): interactive requests alone when any is
        eligible (server/lanes.py), else everyone's; least-served tenant first."""
        lane = lane_requests(
            self._requests, self._served, self._active_tenants(), self._schedulable, self.max_batch_tokens
        )
        return self._pack(lane or self._requests)

    def _pack(self, requests: list[Request]) -> list[tuple[Request, Sample]]:
        batch: list[tuple[Request, Sample]] = []
        n_tokens = 0
        skipped: set[str] = set()
        while n_tokens < self.max_batch_tokens:
            heads: dict[str, Request] = {}
            for req in requests:  # FIFO within a tenant
                if req.tenant not in skipped and req.tenant not in heads and self._schedulable(req):
                    heads[req.tenant] = req
            if not heads:
                break
            tenant = min(heads, key=lambda t: self._served.get(t, 0))
            req = heads[tenant]
            sample = req.pending[0]
            if batch and n_tokens + sample.n_tokens > self.max_batch_tokens:
                skipped.add(tenant)
                continue
            req.pending.popleft()
            if not req.first_scheduled:
                req.first_scheduled = True
                self.metrics.observe("eagle3_queue_wait_seconds", time.monotonic() - req.admitted_at)
            req.outstanding_tokens += sample.n_tokens
            self._served[tenant] = self._served.get(tenant, 0) + sample.n_tokens
            n_tokens += sample.n_tokens
            batch.append((req, sample))
        return batch

    def _run(self) -> None:
        while True:
            with self._cond:
                batch = self.pick_batch()
                while not batch and not self._stopping:
                    self._cond.wait()
                    batch = self.pick_batch()
                if self._stopping:
                    return
            self._run_batch(batch)

    def _run_batch(self, batch: list[tuple[Request, Sample]]) -> None:
        started = time.monotonic()
        samples = [s for _, s in batch]
        use_cache = [r.use_cache and s.generation is None for r, s in batch]  # generation never cached
        tenants = [r.tenant for r, _ in batch]  # the key's tenant part under --cache-scope tenant
        outputs, computed = compute_with_cache(self.cache, samples, use_cache, self._run_samples, tenants)
        computed_ids = {id(s) for s in computed}
        if computed:  # a pass served wholly from the cache ran no forward pass: no throughput figure
            n_tokens = sum(s.n_tokens for s in computed)
            elapsed_s = max(time.monotonic() - started, 1e-6)
            if all(s.generation is None for s in computed):  # the Retry-After rate is extraction's
                rate = n_tokens / elapsed_s
                self.throughput_tok_s = 0.8 * self.throughput_tok_s + 0.2 * rate if self.throughput_tok_s else rate
            self.metrics.inc("eagle3_forward_passes_total")
            self.metrics.observe_fill(n_tokens / self.max_batch_tokens)
        with self._cond:
            for (req, sample), (states, error) in zip(batch, outputs, strict=True):
                if sample.generation is not None:
                    self._charge_generation(req.tenant, sample, states if error is None else None)
                elif error is None and id(sample) in computed_ids:
                    self.metrics.inc("eagle3_tokens_extracted_total", sample.n_tokens, tenant=req.tenant)
                if req.closed or req.abort_error is not None:
                    req.outstanding_tokens -= sample.n_tokens
                    continue
                with self._lock:
                    req.results.append(Result(sample, states, error))
                req.notify()

    def _run_samples(self, samples: list[Sample]) -> list[tuple[Any, dict[str, Any] | None]]:
        """Outputs in input order: the extraction samples in one call, then each generate unit alone."""
        if all(s.generation is None for s in samples):
            return self._extract_isolating(samples)
        out: list[tuple[Any, dict[str, Any] | None]] = [(None, None)] * len(samples)
        extract_at = [i for i, s in enumerate(samples) if s.generation is None]
        if extract_at:
            for i, output in zip(extract_at, self._extract_isolating([samples[i] for i in extract_at]), strict=True):
                out[i] = output
        for i, sample in enumerate(samples):
            if sample.generation is not None:
                out[i] = self._generate_one(sample)
        return out

    def _generate_one(self, sample: Sample) -> tuple[Any, dict[str, Any] | None]:
        try:
            if self.generate is None:
                raise RuntimeError("this scheduler was built without a generate function")
            return self.generate(sample.generation), None
        except Exception as exc:  # the engine's failure must not kill the worker thread
            logger.exception("backend failed to generate for request %r", sample.sample_id)
            return None, sample_error(exc)

    def _charge_generation(self, tenant: str, sample: Sample, result: Any) -> None:
        """(condition held) The tenant's clock keeps prompt + generated tokens, not the reservation."""
        used = int(sample.generation.used_tokens(result)) if result is not None else sample.n_tokens
        if tenant in self._served:
            self._served[tenant] -= max(0, sample.n_tokens - used)
        if result is not None:
            generated = used - int(sample.generation.prompt_tokens)
            self.metrics.inc("eagle3_tokens_generated_total", generated, tenant=tenant)

    def _extract_isolating(self, samples: list[Sample]) -> list[tuple[Any, dict[str, Any] | None]]:
        """States per sample; when a packed call fails, each sample is retried alone so only the
        sample that fails gets an error."""
        try:
            states = list(self.extract([s.input_ids for s in samples]))
            if len(states) != len(samples):
                raise RuntimeError(f"backend returned {len(states)} results for {len(samples)} samples")
            return [(t, None) for t in states]
        except Exception as exc:  # the engine's failure must not kill the worker thread
            if len(samples) > 1:
                return [out for s in samples for out in self._extract_isolating([s])]
            logger.exception("backend failed on sample %r", samples[0].sample_id)
            return [(None, sample_error(exc))]
