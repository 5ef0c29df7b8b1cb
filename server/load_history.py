"""How long the last load of the same verifier took, kept on disk, so ``/readyz`` can say
"elapsed 840 s of about 1,320 s" during a long engine start instead of a progress figure that does
not move (within a long step, such as vLLM reading a 1 TB checkpoint, the engine's phases,
server/backends/vllm_phases.py, stand still).

File: ``<cache>/load-times.json`` (``eagle3.core.models.cache_dir``), ``{key: seconds}``, where the
key names what decides the load time: model, backend, tensor parallel size, dtype. Written atomically
and durably (``eagle3.core.atomic_write``: a temporary file, fsync, rename); an unreadable file counts
as empty (the estimate is a hint, never an error), and a cache directory that cannot be written is
logged and ignored.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eagle3.core.atomic_write import write_text_atomic
from eagle3.core.models import cache_dir

logger = logging.getLogger(__name__)
FILE_NAME = "load-times.json"


def load_key(model: str, backend: str, tensor_parallel_size: int, dtype: str) -> str:
    return f"{model}|{backend}|tp={tensor_parallel_size}|{dtype}"


def _path() -> Path:
    return cache_dir() / FILE_NAME


def _read() -> dict[str, float]:
    try:
        data = json.loads(_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, int | float)} if isinstance(data, dict) else {}


def expected_load_s(key: str) -> float | None:
    """The duration of the last successful load under ``key``, or None."""
    return _read().get(key)


def record_load_s(key: str, seconds: float) -> None:
    data = _read()
    data[key] = round(seconds, 1)
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True))
    except OSError as exc:
        logger.warning("could not record the load time in %s: %s", path, exc)
