"""The vLLM engine's settings, pure: ``vllm.LLM`` keyword arguments for a ``BackendConfig``, the fields
this backend owns, the handover root, the package path its spawned processes import the connector from,
and the CPU worker binding for tensor parallel on one NUMA node. Nothing here starts an engine (vllm
comes in with the connector's names, which the engine arguments carry). Used by
``eagle3.server.backends.vllm`` and bench/extract.py; the engine arguments are checked against a real
vLLM in tests/integration/test_vllm_backend.py.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

from eagle3.core.engine_args import EngineArgsError, check_engine_args
from eagle3.server.backends.base import BackendConfig, BackendConfigError
from eagle3.server.backends.vllm_connector import CONNECTOR_MODULE, CONNECTOR_NAME

CPU_KV_CACHE_GIB = 2.0
MAX_NUM_SEQS = 256
# the directory holding the ``eagle3`` package (site-packages, or the checkout)
PACKAGE_ROOT = Path(importlib.util.find_spec("eagle3").origin or ".").parent.parent  # type: ignore[union-attr]
SHM_DIR = "/dev/shm"  # noqa: S108 (only a parent: the handover dir is a private mkdtemp, mode 0700)


# EngineArgs this backend sets itself: overriding them would break extraction (or its handover)
OWNED_ENGINE_ARGS = (
    "model",
    "skip_tokenizer_init",
    "speculative_config",
    "kv_transfer_config",
    "enable_prefix_caching",
    "max_num_batched_tokens",
)


def kv_cache_bytes(config: BackendConfig, device: str) -> int | None:
    """The KV cache size this backend gives vLLM: ``kv_cache_gib`` if set, else 2 GiB on CPU; None on CUDA
    (sized by ``gpu_memory_utilization``). The fit check before the engine uses the same figure."""
    gib = config.vllm.kv_cache_gib
    if gib is None and device == "cpu":
        gib = CPU_KV_CACHE_GIB
    return None if gib is None else int(gib * 2**30)


def engine_kwargs(
    config: BackendConfig,
    model_dir: Path,
    layer_ids: list[int],
    max_model_len: int,
    device: str,
    store_dir: str,
    known_fields: set[str] | None = None,
    server: str = "",
) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for this config (pure: no engine is started). ``known_fields``:
    the names vLLM's ``EngineArgs`` accepts (pass-through arguments are checked against them); ``server``
    is the ``engine_guard.ServerIdentity`` that arms the orphan watchdog in the engine's spawned processes."""
    opts = config.vllm
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "dtype": config.dtype,
        "max_model_len": max_model_len,
        "tensor_parallel_size": config.tensor_parallel_size,
        "trust_remote_code": config.trust_remote_code,
        "enforce_eager": not opts.compile,
        "enable_prefix_caching": False,
        "enable_chunked_prefill": True,
        # vLLM's own engine series (vllm:kv_cache_usage_perc, vllm:num_requests_running/waiting, prompt
        # tokens, ...) in this process's default prometheus registry, which /metrics exposes (server/metrics.py)
        "disable_log_stats": False,
        "max_num_batched_tokens": config.max_batch_tokens,
        "max_num_seqs": min(MAX_NUM_SEQS, config.max_batch_tokens),
        "seed": 0,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": store_dir, "eagle3_server": server},
        },
    }
    kv_bytes = kv_cache_bytes(config, device)
    if kv_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_bytes
    if opts.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = opts.gpu_memory_utilization
    try:
        check_engine_args(
            opts.engine_args, opts.engine_args if known_fields is None else known_fields, OWNED_ENGINE_ARGS
        )
    except EngineArgsError as exc:
        raise BackendConfigError(str(exc)) from None
    kwargs.update(opts.engine_args)
    return kwargs


def engine_arg_fields() -> set[str]:
    """The field names of this vLLM's ``EngineArgs`` (imports vllm)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def handover_root(config: BackendConfig) -> str:
    """tmpfs when there is one (the handover never touches a disk), else the temp dir."""
    wanted = config.vllm.hidden_states_dir
    if wanted:
        return wanted
    return SHM_DIR if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else tempfile.gettempdir()


def export_package_root() -> None:
    """vLLM's spawned engine and worker processes import the connector by module path: make sure
    they find this checkout's ``eagle3`` package (a no-op for an installed package)."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(PACKAGE_ROOT) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), *parts])


def bind_cpu_workers(tensor_parallel_size: int) -> None:
    """vLLM binds each CPU worker to its own NUMA node and refuses TP > the number of nodes; on a
    one-node box split the allowed cores into ``tensor_parallel_size`` contiguous groups instead
    (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``0|1``). A value the operator set is kept."""
    if tensor_parallel_size <= 1 or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return
    if len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) >= tensor_parallel_size:
        return  # vLLM's own NUMA binding applies
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tensor_parallel_size:
        raise BackendConfigError(
            f"tensor parallel {tensor_parallel_size} on CPU needs as many cores; {len(cores)} allowed"
        )
    per_rank = len(cores) // tensor_parallel_size
    groups = [cores[r * per_rank : (r + 1) * per_rank] for r in range(tensor_parallel_size)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups)
