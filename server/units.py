"""Units of work: what the scheduler (server/scheduler.py) runs, each kind knowing how it runs.

The scheduler sees a unit only through ``Unit``: how many tokens it reserves (``n_tokens``: admission,
output buffers, packing into a pass), whether the feature cache may answer it (``cacheable``; then
``input_ids`` is its key), which units may share one backend call (``batch_key``), and
``run_batch``, which runs a group of units on the ``Engine`` (the runtime's timed backend calls) and
says per unit what came of it (``Outcome``): an output, an error, or ``more`` (the unit is not
finished: the rest of it goes back to the head of its request's queue, so other work interleaves
between its slices). The scheduler charges every unit by the backend time its group took (the
fairness clock) and counts ``used_tokens``; it never branches on a unit's kind.

Two kinds serve the routes: ``Sample`` (``POST /v1/extract``: one sample's hidden states; packed with
other samples into one ``extract`` call, cached) and ``GenerateUnit`` (``POST /v1/generate``:
server/generation.py). A new kind is a new class with these members (tests/unit/test_units.py
schedules one that is neither).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from eagle3.core.protocol.error_types import error_meta

if TYPE_CHECKING:
    from eagle3.server.backends.base import GenerationRun
    from eagle3.server.generation import GenerateWork


logger = logging.getLogger(__name__)


def sample_error(exc: Exception) -> dict[str, Any]:
    """A SAMPLE_ERROR's ``error`` for the engine's failure on one unit alone: ``invalid_sample``
    (deterministic) when the backend says the input was rejected, else ``backend_error`` (retryable)."""
    type_ = "backend_error" if getattr(exc, "retryable", True) else "invalid_sample"
    return error_meta(type_, f"{type(exc).__name__}: {exc}"[:500])


class Engine(Protocol):
    """The backend calls units run on (``Runtime`` implements it with timing and metrics)."""

    def extract(self, batch: Sequence[Sequence[int]]) -> Sequence[Any]:
        """Hidden states per sample (server/backends/base.py)."""
        ...

    def start_generation(self, work: GenerateWork) -> GenerationRun:
        """A generate request in progress, advanced one bounded slice at a time."""
        ...

    @property
    def generate_slice_tokens(self) -> int:
        """The most new tokens per prompt one slice of a generate request produces."""
        ...


@dataclass(frozen=True)
class Outcome:
    """What came of one unit in one pass. ``more``: not finished, the unit to run next (requeued);
    ``used_tokens``: tokens processed in this pass (None: the reservation); ``counters``: metric
    increments for the unit's tenant (name, amount)."""

    output: Any = None
    error: dict[str, Any] | None = None
    more: Unit | None = None
    used_tokens: int | None = None
    counters: tuple[tuple[str, int], ...] = ()


class Unit(Protocol):
    @property
    def index(self) -> int:
        """Position in its request."""
        ...

    @property
    def sample_id(self) -> str: ...

    @property
    def n_tokens(self) -> int:
        """Tokens reserved for this unit (admission budgets, output buffer, packing)."""
        ...

    @property
    def cacheable(self) -> bool:
        """The feature cache may answer it (keyed by ``input_ids``)."""
        ...

    @property
    def input_ids(self) -> list[int]: ...

    @property
    def batch_key(self) -> Hashable:
        """Units of one pass with equal keys run in one ``run_batch`` call."""
        ...

    @property
    def sets_rate(self) -> bool:
        """Its throughput (tokens per backend second) defines a token-equivalent of backend time."""
        ...

    def run_batch(self, units: Sequence[Any], engine: Engine) -> list[Outcome]:
        """Run ``units`` (this one and the others of its ``batch_key`` in the pass) on ``engine``; one
        ``Outcome`` per unit, in order. An exception fails the whole group (each unit gets the error)."""
        ...


@dataclass(frozen=True)
class Sample:
    """One extraction sample (``POST /v1/extract``): its states come from one packed ``extract`` call."""

    index: int  # position in the request
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]

    cacheable = True
    batch_key = "extract"
    sets_rate = True

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    def run_batch(self, units: Sequence[Any], engine: Engine) -> list[Outcome]:
        """States per sample; when the packed call fails, each sample is retried alone so only the
        sample that fails gets an error."""
        try:
            states = list(engine.extract([s.input_ids for s in units]))
            if len(states) != len(units):
                raise RuntimeError(f"backend returned {len(states)} results for {len(units)} samples")
        except Exception as exc:  # the engine's failure must not kill the worker thread
            if len(units) > 1:
                return [out for s in units for out in self.run_batch([s], engine)]
            logger.exception("backend failed on sample %r", units[0].sample_id)
            return [Outcome(error=sample_error(exc))]
        return [
            Outcome(t, counters=(("eagle3_tokens_extracted_total", s.n_tokens),))
            for s, t in zip(units, states, strict=True)
        ]
