"""Engine backends behind one contract: ``hf`` (transformers) and ``vllm`` (production, TP=8).

``make_backend`` imports the chosen engine lazily, so the server starts without vllm installed.
"""

from __future__ import annotations

import importlib.util

from eagle3.server.backends.base import Backend, BackendConfig, BackendError, BackendInfo

__all__ = ["Backend", "BackendConfig", "BackendError", "BackendInfo", "make_backend", "resolve_backend_name"]


def resolve_backend_name(name: str) -> str:
    """``auto`` means vllm when it is importable, else hf."""
    if name == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    if name not in ("hf", "vllm"):
        raise ValueError(f"unknown backend {name!r} (choose auto, hf or vllm)")
    return name


def make_backend(name: str, config: BackendConfig) -> Backend:
    name = resolve_backend_name(name)
    if name == "vllm":
        from eagle3.server.backends.vllm import VllmBackend  # type: ignore[import-not-found,unused-ignore]

        backend: Backend = VllmBackend(config)
        return backend
    from eagle3.server.backends.hf import HfBackend

    return HfBackend(config)
