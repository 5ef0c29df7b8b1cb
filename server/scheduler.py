"""Admission and token-budgeted scheduling of samples from every active request onto one backend.

* Admission reserves a request's tokens against a per-tenant and a global in-flight budget (tokens
  admitted and not yet streamed out): over the tenant's quota is a 429, a full server a 503.
* One worker thread packs units of work (server/units.py: extraction samples, generate requests,
  any kind with the ``Unit`` members) into forward passes of at most ``max_batch_tokens`` reserved
  tokens (a unit alone over the budget runs alone), taking turns across tenants by a fairness clock
  (start-time fair queuing, server/fair_clock.py): the tenant with the least clock goes next. A unit is
  charged, when picked, its reserved tokens, and after its pass what it cost (server/pass_cost.py): an
  extraction its share of a model of the pass (a fixed time plus a time per token), a generate slice the
  backend time it took, both at the rate of full extraction passes. A pass is filled by tokens; a tenant
  reached only because the one ahead of it did not fit (backfill) adds extraction samples, which ride the
  pass's forward pass, never a unit of another kind, which is a backend call of its own. A tenant whose
  every request has a full output buffer (below) counts as idle: a reader that stops for a while comes
  back at the floor, not with the passes it missed as credit to take all of them back at once.
* Each request has a bounded output buffer (``max_buffered_tokens`` of running, finished and not yet
  streamed states; ``request_buffer_tokens`` sizes it: two forward passes' worth, so a lone request
  fills pass k+1 while pass k is being encoded and sent, capped in bytes, never below one full pass);
  while it is full the request's samples are not scheduled, so a slow reader pauses only itself.
* Small requests (``interactive_max_tokens``) get forward passes of their own ahead of bulk work,
  within the fairness rules (server/lanes.py). Before each pass its samples are looked up in the
  feature cache and only the misses reach the backend (server/feature_cache.py).
* ``close`` (called exactly once per request, from the stream's ``finally``) drops the request's
  remaining work and returns whatever budget it still holds; releases never exceed the reservation.
* A unit whose ``Outcome`` has ``more`` (a generate request between slices) goes back to the head of
  its request's queue and takes its turn again: other tenants' work interleaves between its slices,
  and ``close`` (the client left) or ``abort_all`` (drain) stops it after the slice in flight.

The invariant (tests/unit/test_scheduler_fairness.py drives it with closed-loop clients): over any
window, a tenant backlogged throughout gets at least ``W / n - 2 * (slack + P)`` of the ``W``
token-equivalents of backend work done in it, ``n`` the tenants with work in the window, ``slack`` the
lane's (``max_batch_tokens``), ``P`` the largest charge of one pass.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

from eagle3.server.fair_clock import FairClock
from eagle3.server.feature_cache import FeatureCache
from eagle3.server.lanes import BULK, lane_of, lane_requests
from eagle3.server.metrics import Metrics
from eagle3.server.pass_cost import PassCost
from eagle3.server.request_state import AdmissionError, ExtractFn, FunctionEngine, GenerateFn, Request, Result
from eagle3.server.run_group import run_cached
from eagle3.server.units import Engine, Outcome, Unit

logger = logging.getLogger(__name__)
MAX_LANE_STREAK = 4  # lane passes in a row while bulk work waits; then an ordinary pass


class Scheduler:
    def __init__(
        self,
        engine: Engine | ExtractFn,
        *,
        max_batch_tokens: int,
        max_inflight_tokens: int,
        max_tenant_inflight_tokens: int,
        max_buffered_tokens: int | None = None,
        metrics: Metrics | None = None,
        interactive_max_tokens: int = 0,
        cache: FeatureCache | None = None,
        generate: GenerateFn | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``engine``: what units run on (the runtime), or an extract function (with ``generate``: a
        function running a whole generate request). ``clock``: seconds, for the units' costs."""
        self.engine: Engine = FunctionEngine(engine, generate) if callable(engine) else engine
        self.clock = clock
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
        self.fair = FairClock()  # per tenant: work charged and tokens processed (server/fair_clock.py)
        self._lane_streak = 0  # lane passes in a row (server/lanes.py)
        self.pass_cost = PassCost(max_batch_tokens)  # what a unit costs on the fairness clock
        self.inflight_tokens = 0
        self.tenant_inflight: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.throughput_tok_s = 0.0  # EWMA, for Retry-After

    # ---- admission (event loop) ----

    def submit(self, request_id: str, tenant: str, samples: Sequence[Unit], *, use_cache: bool = True) -> Request:
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
                self._become_active(tenant)
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

    def consumed(self, req: Request, result: Result[Any]) -> None:
        """The stream took ``result`` off the request's buffer: room for more of its samples."""
        with self._cond:
            was_blocked = bool(req.pending) and not self._schedulable(req)  # rare: O(1) on the common path
            req.outstanding_tokens -= result.sample.n_tokens
            back = was_blocked and self._schedulable(req)  # room again in a full buffer; was its tenant idle?
            others = (r for r in self._requests if r is not req and r.tenant == req.tenant)
            if back and not any(self._schedulable(r) for r in others):
                self._become_active(req.tenant)
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
            self.fair.closed(req.tenant, still_open=self._tenant_open(req.tenant))
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
            if not self._tenant_open(tenant):
                self.fair.forget(tenant)

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
        """Tenants with work that could run now. A request whose output buffer is full (its reader is
        behind) is not backlogged: its tenant neither holds the floor down nor banks the passes it misses."""
        return {r.tenant for r in self._requests if self._schedulable(r)}

    def _tenant_active(self, tenant: str) -> bool:
        return any(r.tenant == tenant and self._schedulable(r) for r in self._requests)

    def _tenant_open(self, tenant: str) -> bool:
        return any(r.tenant == tenant for r in self._requests)

    def _become_active(self, tenant: str) -> None:
        """(condition held) ``tenant`` has work that can run again (a new request, or room in a full
        buffer): ``max(own clock, floor)`` (server/fair_clock.py)."""
        self.fair.become_active(tenant, self._active_tenants())

    def _schedulable(self, req: Request) -> bool:
        if not req.pending or req.closed:
            return False
        need = req.pending[0].n_tokens
        return req.outstanding_tokens == 0 or req.outstanding_tokens + need <= self.max_buffered_tokens

    def pick_batch(self) -> list[tuple[Request, Unit]]:
        """Fill one forward pass (call with the condition held): interactive requests alone when any is
        eligible (server/lanes.py), else everyone's; least clock first."""
        active = self._active_tenants()
        self.fair.advance(active)
        lane = lane_requests(self._requests, self.fair.clock, active, self._schedulable, self.max_batch_tokens)
        if (
            lane
            and self._lane_streak >= MAX_LANE_STREAK
            and any(r.lane == BULK and self._schedulable(r) for r in self._requests)
        ):
            lane = []  # bulk work has waited MAX_LANE_STREAK lane passes: an ordinary pass now
        batch = self._pack(lane or self._requests)
        self._lane_streak = self._lane_streak + 1 if lane and batch else 0
        return batch

    def _pack(self, requests: list[Request]) -> list[tuple[Request, Unit]]:
        batch: list[tuple[Request, Unit]] = []
        n_tokens = 0
        skipped: set[str] = set()
        while n_tokens < self.max_batch_tokens:
            heads: dict[str, Request] = {}
            for req in requests:  # FIFO within a tenant
                if req.tenant not in skipped and req.tenant not in heads and self._schedulable(req):
                    heads[req.tenant] = req
            if not heads:
                break
            tenant = self.fair.least(heads)
            req = heads[tenant]
            unit = req.pending[0]
            if batch and n_tokens + unit.n_tokens > self.max_batch_tokens:
                skipped.add(tenant)
                continue
            if skipped and not unit.sets_rate:
                # Backfill (a tenant ahead of one whose unit did not fit) rides the extraction already in the
                # pass, at a few us per token. A unit of another kind (a generate slice) is a backend call of its
                # own, worth hundreds of tokens of its reservation: backfilled, its tenant took a slot in every
                # pass however far its clock ran ahead (0.42 of the backend time beside a bulk tenant's 0.29).
                skipped.add(tenant)
                continue
            req.pending.popleft()
            if not req.first_scheduled:
                req.first_scheduled = True
                self.metrics.observe("eagle3_queue_wait_seconds", time.monotonic() - req.admitted_at)
            req.outstanding_tokens += unit.n_tokens
            self.fair.pick(tenant, unit.n_tokens)  # corrected after the pass, by what it cost
            n_tokens += unit.n_tokens
            batch.append((req, unit))
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

    def _run_batch(self, batch: list[tuple[Request, Unit]]) -> None:
        """Run the pass's groups (units of one ``batch_key``; rate-setting kinds, the packed extraction,
        first); after each group, charge its units (server/pass_cost.py: an extraction the model of its pass,
        other kinds their group's time) and hand out its results (an
        extraction's states do not wait for a generate slice in the same pass). Unfinished units go back
        to the head of their requests' queues at the end of the pass, in their order."""
        groups: dict[Hashable, list[int]] = {}
        for i, (_, unit) in enumerate(batch):
            groups.setdefault(unit.batch_key, []).append(i)
        computed_tokens = 0
        requeue: dict[int, tuple[Request, list[Unit]]] = {}
        for at in sorted(groups.values(), key=lambda at: not batch[at[0]][1].sets_rate):
            units = [batch[i][1] for i in at]
            use_cache = [batch[i][0].use_cache and batch[i][1].cacheable for i in at]
            started = self.clock()
            tenants = [batch[i][0].tenant for i in at]
            outs, computed = run_cached(self.cache, self.engine, units, use_cache, tenants)
            elapsed_s = max(self.clock() - started, 1e-9)
            group_tokens = sum(u.n_tokens for u in units)
            if computed:
                done = sum(u.n_tokens for u in computed)
                computed_tokens += done
                if units[0].sets_rate:
                    self._note_rate(done, elapsed_s)
            # an extraction (the rate-setting kind) costs what the model of a pass says (server/pass_cost.py),
            # not its own timing; other kinds cost their backend time
            if not units[0].sets_rate:
                cost = self.pass_cost.token_equivalents(elapsed_s, group_tokens)
            else:
                cost = self.pass_cost.extraction(group_tokens) if computed else float(group_tokens)
            self._note_backend_time([batch[i] for i in at], computed, elapsed_s)
            with self._cond:
                for i, out in zip(at, outs, strict=True):
                    req, unit = batch[i]
                    self._finish(req, unit, out, cost * unit.n_tokens / max(1, group_tokens), requeue)
        if computed_tokens:  # a pass served wholly from the cache ran no forward pass
            self.metrics.inc("eagle3_forward_passes_total")
            self.metrics.observe_fill(computed_tokens / self.max_batch_tokens)
        if requeue:
            with self._cond:
                for req, more in requeue.values():
                    if not (req.closed or req.abort_error is not None):  # closed meanwhile: dropped
                        req.pending.extendleft(reversed(more))
                self._cond.notify_all()

    def _finish(
        self, req: Request, unit: Unit, out: Outcome, cost: float, requeue: dict[int, tuple[Request, list[Unit]]]
    ) -> None:
        """(condition held) Charge ``unit`` and hand its outcome to its request (or note it for requeueing)."""
        self._charge(req.tenant, unit, out, cost)
        if req.closed or req.abort_error is not None:
            req.outstanding_tokens -= unit.n_tokens
            return
        if out.more is not None and out.error is None:  # not finished: its next turn
            req.outstanding_tokens -= unit.n_tokens
            requeue.setdefault(id(req), (req, []))[1].append(out.more)
            return
        with self._lock:
            req.results.append(Result(unit, out.output, out.error))
        req.notify()

    def _note_backend_time(self, group: list[tuple[Request, Unit]], computed: list[Unit], elapsed_s: float) -> None:
        """``eagle3_backend_seconds_total``: the group's backend time, split over the units it computed (cache
        hits took none) by their tokens."""
        ran = {id(u) for u in computed}
        mine = [(req.tenant, unit.n_tokens) for req, unit in group if id(unit) in ran]
        total = sum(n for _, n in mine)
        for tenant, n in mine:
            self.metrics.inc("eagle3_backend_seconds_total", elapsed_s * n / max(1, total), tenant=tenant)

    def _note_rate(self, n_tokens: int, elapsed_s: float) -> None:
        """Retry-After's rate (every extraction pass) and the model of a pass's cost."""
        rate = n_tokens / elapsed_s
        self.throughput_tok_s = 0.8 * self.throughput_tok_s + 0.2 * rate if self.throughput_tok_s else rate
        self.pass_cost.observe(n_tokens, elapsed_s)

    def _charge(self, tenant: str, unit: Unit, out: Outcome, cost: float) -> None:
        """(condition held) The clock keeps what the unit cost, the tokens count what it processed."""
        self.fair.charge(tenant, unit.n_tokens, cost, out.used_tokens)
        for name, amount in out.counters:
            try:
                self.metrics.inc(name, amount, tenant=tenant)
            except KeyError:  # a unit naming a counter /metrics does not declare: never the worker's end
                logger.error("%s counts %r, which server/metrics.py does not declare", type(unit).__name__, name)
