"""Engine backends behind one contract: ``hf`` (transformers) and ``vllm`` (production, TP=8), plus
``synthetic`` (no model: deterministic states at memory speed, for benchmarks and tests only; never
picked by ``auto``).

``make_backend`` imports the chosen engine lazily, so the server starts without vllm installed.
"""

from __future__ import annotations

import importlib.util

from eagle3.server.backends.base import Backend, BackendConfig, BackendConfigError, BackendError, BackendInfo

__all__ = [
    "Backend",
    "BackendConfig",
    "BackendConfigError",
    "BackendError",
    "BACKEND_NAMES",
    "BackendInfo",
    "make_backend",
    "resolve_backend_name",
]


BACKEND_NAMES = ("hf", "vllm", "synthetic")


def resolve_backend_name(name: str) -> str:
    """``auto`` means vllm when it is importable, else hf."""
    if name == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r} (choose auto, {', '.join(BACKEND_NAMES)})")
    return name


def make_backend(name: str, config: BackendConfig) -> Backend:
    name = resolve_backend_name(name)
    if name == "vllm":
        from eagle3.server.backends.vllm import VllmBackend  # type: ignore[import-not-found,unused-ignore]

        backend: Backend = VllmBackend(config)
        return backend
    if name == "synthetic":
        from eagle3.server.backends.synthetic import SyntheticBackend

        return SyntheticBackend(config)
    from eagle3.server.backends.hf import HfBackend

    return HfBackend(config)
