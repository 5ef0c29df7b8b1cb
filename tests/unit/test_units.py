"""The scheduler's seam (server/units.py): a kind of work that is neither extraction nor generation is
scheduled by the unchanged scheduler, and a unit run in slices (a generate request) interleaves with
other tenants' work, stops within one slice when its client leaves, and is dropped by a drain."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from eagle3.core.protocol.generate import Sampling
from eagle3.server.backends.base import Generation
from eagle3.server.generation import GenerateUnit, GenerateWork
from eagle3.server.scheduler import Scheduler
from eagle3.server.units import Engine, Outcome, Sample
from tests.unit.test_scheduler import drain


@dataclass(frozen=True)
class NormUnit:
    """A third kind: the L2 norm of each token's last state (a scoring request, say). Batched with its
    own kind in one extract call, never cached, charged its tokens; runs in two slices (first half of
    the tokens, then the rest) to show ``more``."""

    index: int
    sample_id: str
    input_ids: list[int]
    done: tuple[float, ...] = ()

    cacheable = False
    batch_key = "norm"
    sets_rate = False

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    def run_batch(self, units: Sequence[Any], engine: Engine) -> list[Outcome]:
        out = []
        for unit in units:
            half = (len(unit.input_ids) + 1) // 2
            todo = unit.input_ids[len(unit.done) :][:half]
            states = engine.extract([unit.input_ids[: len(unit.done) + len(todo)]])[0]
            norms = unit.done + tuple(float(x) for x in torch.as_tensor(states)[len(unit.done) :].float().norm(dim=-1))
            counted = (("eagle3_tokens_extracted_total", len(todo)),)
            if len(norms) < len(unit.input_ids):
                out.append(Outcome(more=replace(unit, done=norms), used_tokens=len(todo), counters=counted))
            else:
                out.append(Outcome(norms, used_tokens=len(todo), counters=counted))
        return out


class Backend:
    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def extract(self, batch: Sequence[Sequence[int]]) -> list[Any]:
        self.calls.append([len(ids) for ids in batch])
        return [torch.tensor([[float(t), 0.0] for t in ids]) for ids in batch]  # [n, 2]: norm = |id|


def test_a_new_kind_of_unit_is_scheduled_without_touching_the_scheduler() -> None:
    backend = Backend()
    sched = Scheduler(backend.extract, max_batch_tokens=64, max_inflight_tokens=1000, max_tenant_inflight_tokens=1000)
    sched.start()

    async def main() -> tuple[list[Any], list[Any]]:
        norms = sched.submit("n", "scorer", [NormUnit(0, "a", [3, 4, 5, 6]), NormUnit(1, "b", [7, 8])])
        ext = sched.submit("e", "other", [Sample(0, "x", [1, 2, 3], [1, 1, 1])])
        got: list[Any] = []
        while len(got) < 2:
            for r in await norms.next_results(5.0):
                got.append(r)
                sched.consumed(norms, r)
        sched.close(norms)
        states: list[Any] = []
        while not states:
            states = await ext.next_results(5.0)
        sched.consumed(ext, states[0])
        sched.close(ext)
        return got, states

    try:
        got, states = asyncio.run(main())
    finally:
        sched.stop(timeout_s=5)
    by_id = {r.sample.sample_id: r.states for r in got}
    assert by_id == {"a": (3.0, 4.0, 5.0, 6.0), "b": (7.0, 8.0)}
    assert states[0].error is None and states[0].states.shape == (3, 2)
    assert sched.fair.served["scorer"] == 6, "tokens processed: each token once over the two slices"
    assert sched.metrics.get("eagle3_tokens_extracted_total", tenant="scorer") == 6
    assert sched.inflight_tokens == 0 and not sched.tenant_inflight


class SlicedRun:
    """A generate request that yields ``step`` tokens per prompt per slice, each slice ``slice_s`` long."""

    def __init__(self, engine: SlicedEngine, work: GenerateWork) -> None:
        self.engine, self.work, self.n = engine, work, 0

    @property
    def generated_tokens(self) -> int:
        return self.n * len(self.work.prompts)

    def advance(self, max_new_tokens: int) -> list[Generation] | None:
        time.sleep(self.engine.slice_s)
        self.engine.log.append("slice")
        self.n = min(self.work.sampling.max_new_tokens, self.n + max_new_tokens)
        if self.n < self.work.sampling.max_new_tokens:
            return None
        return [Generation([5] * self.n, "length") for _ in self.work.prompts]


class SlicedEngine:
    generate_slice_tokens = 4

    def __init__(self, slice_s: float) -> None:
        self.slice_s = slice_s
        self.log: list[str] = []
        self.lock = threading.Lock()

    def extract(self, batch: Sequence[Sequence[int]]) -> list[Any]:
        self.log.append("extract")
        return [list(ids) for ids in batch]

    def start_generation(self, work: GenerateWork) -> SlicedRun:
        return SlicedRun(self, work)


def long_generate(tag: str) -> GenerateUnit:
    return GenerateUnit(0, tag, GenerateWork(("p",), ((1, 2, 3),), Sampling(max_new_tokens=400)))


def test_a_generate_runs_in_slices_other_work_interleaves_and_a_leaving_client_stops_it() -> None:
    engine = SlicedEngine(slice_s=0.01)
    sched = Scheduler(engine, max_batch_tokens=64, max_inflight_tokens=10_000, max_tenant_inflight_tokens=10_000)
    sched.start()

    async def main() -> None:
        gen = sched.submit("g", "writer", [long_generate("g")])
        while engine.log.count("slice") < 3:
            await asyncio.sleep(0.002)
        asked_at = len(engine.log)  # the slice in flight (if any) logs after this
        small = sched.submit("e", "notebook", [Sample(0, "x", [9] * 4, [1] * 4)])
        await drain(sched, small, [])
        after = engine.log[asked_at:]
        assert "extract" in after[:2], f"the small extract waited for more than the slice in flight: {after}"
        sched.close(gen)  # the client left
        slices_at_close = engine.log.count("slice")
        await asyncio.sleep(10 * engine.slice_s)
        assert engine.log.count("slice") <= slices_at_close + 1, "the generate kept running after its client left"
        assert sched.metrics.get("eagle3_cancellations_total") == 1

    try:
        asyncio.run(main())
    finally:
        sched.stop(timeout_s=5)
    assert engine.log.count("slice") < 100, "ran to its 400 tokens (100 slices)"
    assert sched.inflight_tokens == 0


def test_a_drain_drops_a_generate_between_slices() -> None:
    engine = SlicedEngine(slice_s=0.01)
    sched = Scheduler(engine, max_batch_tokens=64, max_inflight_tokens=10_000, max_tenant_inflight_tokens=10_000)
    sched.start()

    async def main() -> None:
        gen = sched.submit("g", "writer", [long_generate("g")])
        while engine.log.count("slice") < 2:
            await asyncio.sleep(0.002)
        sched.abort_all({"type": "unavailable", "message": "draining", "retryable": True})
        at_abort = engine.log.count("slice")
        await asyncio.sleep(10 * engine.slice_s)
        assert engine.log.count("slice") <= at_abort + 1
        assert gen.abort_error is not None and not gen.pending
        sched.close(gen)

    try:
        asyncio.run(main())
    finally:
        sched.stop(timeout_s=5)
