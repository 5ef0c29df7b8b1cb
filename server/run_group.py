"""Running one group of units (one ``batch_key``) on the engine, the feature cache consulted first: the
scheduler's worker calls ``run_cached`` once per group of each forward pass (server/scheduler.py)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from eagle3.server.feature_cache import FeatureCache, compute_with_cache
from eagle3.server.units import Engine, Outcome, Unit, sample_error

logger = logging.getLogger("eagle3.server.scheduler")  # the worker's log, as before this module


def run_cached(
    cache: FeatureCache | None, engine: Engine, units: list[Unit], use_cache: list[bool], tenants: list[str]
) -> tuple[list[Outcome], list[Unit]]:
    """The group's outcomes, the cacheable ones looked up first (server/feature_cache.py; ``tenants``: the
    key's tenant part under ``--cache-scope tenant``), and the units the backend ran. A unit answered by the
    cache, or by its twin in the pass, counts nothing."""
    ran: dict[int, Outcome] = {}

    def compute(todo: list[Unit]) -> list[tuple[Any, dict[str, Any] | None]]:
        outs = run_group(todo, engine)
        ran.update((id(u), o) for u, o in zip(todo, outs, strict=True))
        return [(o.output, o.error) for o in outs]

    pairs, computed = compute_with_cache(cache, units, use_cache, compute, tenants)
    outcomes = [
        dataclasses.replace(ran.get(id(u), Outcome()), output=output, error=error)
        for u, (output, error) in zip(units, pairs, strict=True)
    ]
    return outcomes, computed


def run_group(units: list[Unit], engine: Engine) -> list[Outcome]:
    """One group's outcomes in order; the engine's failure fails the group, never the worker."""
    try:
        outs = units[0].run_batch(units, engine)
        if len(outs) != len(units):
            raise RuntimeError(f"{type(units[0]).__name__}.run_batch gave {len(outs)} outcomes for {len(units)}")
        return outs
    except Exception as exc:
        logger.exception("backend failed on %r", units[0].sample_id)
        return [Outcome(error=sample_error(exc)) for _ in units]
