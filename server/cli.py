"""``eagle3 serve``: parse flags into ``ServerSettings`` and run uvicorn with our own drain on SIGTERM.

The port is bound at once (probes answer while the model loads in the background); the line
``eagle3 serve: listening on http://HOST:PORT`` goes to stderr as soon as it is. SIGTERM or SIGINT:
``/readyz`` turns 503 draining, new extracts get 503, open streams finish for up to
``--drain-timeout-s`` (then get an ERROR frame), and the process exits 0. A second signal forces exit.
Heavy imports (uvicorn, fastapi, torch) happen only when the command runs.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from eagle3.models import DEFAULT_MODEL, is_embedded_name, resolve_model_dir
from server.config import (
    KEYS_ENV,
    KEYS_FILE_ENV,
    ServerSettings,
    SettingsError,
    default_tensor_parallel_size,
    parse_api_keys,
)


def add_serve_command(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run the resident hidden-state extraction server",
        description="Load the verifier once and serve /v1/extract to every user.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="local HF checkpoint dir or the embedded default's name")
    p.add_argument("--backend", choices=("auto", "hf", "vllm"), default="auto", help="auto: vllm if importable")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on stderr)")
    p.add_argument("--aux-layer-ids", default=None, help="comma-separated, default 2,N//2,N-3")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=None, help="vllm: default all CUDA GPUs up to 8, 1 on CPU"
    )
    p.add_argument("--kv-cache-gib", type=float, default=None, help="vllm: KV cache size (CPU default 2)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="vllm on CUDA (default 0.9)")
    p.add_argument("--vllm-compile", action="store_true", help="vllm: torch.compile + CUDA graphs instead of eager")
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="tokens per forward pass")
    p.add_argument("--max-model-len", type=int, default=None, help="longest sample (default: the model's)")
    p.add_argument("--max-inflight-tokens", type=int, default=ServerSettings.max_inflight_tokens)
    p.add_argument("--max-tenant-inflight-tokens", type=int, default=ServerSettings.max_tenant_inflight_tokens)
    p.add_argument("--max-request-tokens", type=int, default=ServerSettings.max_request_tokens)
    p.add_argument("--max-body-mb", type=float, default=ServerSettings.max_body_bytes / 2**20)
    p.add_argument(
        "--max-payload-mb",
        type=float,
        default=ServerSettings.max_payload_bytes / 2**20,
        help="raw bytes per DATA frame; longer samples are split by token range",
    )
    p.add_argument(
        "--request-buffer-mb",
        type=float,
        default=ServerSettings.request_buffer_bytes / 2**20,
        help="hidden states one request may hold computed but unsent (a slow reader pauses only itself)",
    )
    p.add_argument(
        "--default-codec", choices=("zstd+planes", "zstd+shuffle", "zstd", "none"), default=ServerSettings.default_codec
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="repeatable; tenant names key-1, key-2, ... (visible in ps: prefer --api-keys-file or $EAGLE3_API_KEYS)",
    )
    p.add_argument(
        "--api-keys-file",
        default=os.environ.get(KEYS_FILE_ENV),
        help=f"lines 'tenant: key' or a JSON object {{tenant: key}} (default ${KEYS_FILE_ENV}); "
        f"${KEYS_ENV} may hold the same text",
    )
    p.add_argument("--drain-timeout-s", type=float, default=30.0)
    p.add_argument(
        "--body-timeout-s", type=float, default=ServerSettings.body_timeout_s, help="request body deadline (408)"
    )
    p.add_argument(
        "--max-tenant-connections",
        type=int,
        default=ServerSettings.max_tenant_connections,
        help="open extract requests per tenant, streams included (429 over it)",
    )
    p.add_argument("--heartbeat-s", type=float, default=10.0)
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    p.set_defaults(func=run_serve)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    aux = None
    if args.aux_layer_ids:
        try:
            aux = tuple(int(x) for x in args.aux_layer_ids.split(","))
        except ValueError:
            raise SettingsError(f"--aux-layer-ids {args.aux_layer_ids!r}: expected integers like 2,15,27") from None
    tensor_parallel_size = args.tensor_parallel_size
    if tensor_parallel_size is None:  # counting GPUs imports torch: only when vllm may run
        tensor_parallel_size = 1 if args.backend == "hf" else default_tensor_parallel_size()
    return ServerSettings(
        model=args.model,
        backend=args.backend,
        host=args.host,
        port=args.port,
        aux_layer_ids=aux,
        dtype=args.dtype,
        device=args.device,
        tensor_parallel_size=tensor_parallel_size,
        kv_cache_gib=args.kv_cache_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        vllm_compile=args.vllm_compile,
        max_batch_tokens=args.max_batch_tokens,
        max_model_len=args.max_model_len,
        max_inflight_tokens=args.max_inflight_tokens,
        max_tenant_inflight_tokens=args.max_tenant_inflight_tokens,
        max_request_tokens=args.max_request_tokens,
        max_body_bytes=int(args.max_body_mb * 2**20),
        max_payload_bytes=int(args.max_payload_mb * 2**20),
        request_buffer_bytes=int(args.request_buffer_mb * 2**20),
        api_keys=parse_api_keys(args.api_key, args.api_keys_file, os.environ.get(KEYS_ENV)),
        drain_timeout_s=args.drain_timeout_s,
        body_timeout_s=args.body_timeout_s,
        max_tenant_connections=args.max_tenant_connections,
        heartbeat_s=args.heartbeat_s,
        log_level=args.log_level,
        default_codec=args.default_codec,
    )


# Kernel caches keyed by tensor shape: PyTorch's ideep LRU and oneDNN's primitive cache, 1,024 entries each
# by default. Packed batches bring new shapes all the time, so at the defaults the server's RSS grows with
# every distinct batch shape seen (measured: +330 MB over 160k tokens of chat samples); 16 entries keep it
# flat at no measurable cost in tokens/s (docs/performance.md, "Extraction"). Both are read at the first
# forward pass, so setting them here (before the backend loads; vLLM's workers inherit them) is in time.
KERNEL_CACHE_ENV = {"LRU_CACHE_CAPACITY": "16", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"}


def run_serve(args: argparse.Namespace) -> int:
    for name, value in KERNEL_CACHE_ENV.items():
        os.environ.setdefault(name, value)  # the operator's own setting wins
    settings = settings_from_args(args)
    if not is_embedded_name(settings.model):
        resolve_model_dir(settings.model)  # fail fast on a bad --model (the embedded one converts in the background)
    from server.serve import serve

    serve(settings)
    return 0
