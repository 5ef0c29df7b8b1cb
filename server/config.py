"""``ServerSettings``: every ``eagle3 serve`` flag in one dataclass (the CLI only fills it in)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.models import DEFAULT_MODEL

KEYS_FILE_ENV = "EAGLE3_API_KEYS_FILE"  # default of --api-keys-file
KEYS_ENV = "EAGLE3_API_KEYS"  # the keys file's text itself (lines 'tenant: key' or JSON)


class SettingsError(ValueError):
    """A serve flag or the API keys file is invalid (a one-line CLI error)."""


@dataclass(frozen=True)
class ServerSettings:
    model: str = DEFAULT_MODEL
    backend: str = "auto"  # auto | hf | vllm
    host: str = "127.0.0.1"
    port: int = 8000
    aux_layer_ids: tuple[int, ...] | None = None  # None: (2, N // 2, N - 3)
    dtype: str = "bfloat16"
    device: str = "auto"
    tensor_parallel_size: int = 1  # vllm only; the CLI default is default_tensor_parallel_size()
    kv_cache_gib: float | None = None  # vllm only: KV cache size (CPU default 2 GiB; CUDA: gpu_memory_utilization)
    gpu_memory_utilization: float | None = None  # vllm on CUDA only (vLLM's default 0.9)
    vllm_compile: bool = False  # vllm only: torch.compile + CUDA graphs instead of eager mode
    max_batch_tokens: int = 8192  # tokens per forward pass
    max_model_len: int | None = None  # None: the model's own
    max_inflight_tokens: int = 1 << 21  # admitted and not yet streamed out, all tenants
    max_tenant_inflight_tokens: int = 1 << 19  # the same, per tenant (over it: 429)
    max_request_tokens: int = 1 << 18  # one request (over it: 400)
    max_body_bytes: int = 64 << 20
    max_payload_bytes: int = 64 << 20  # raw bytes per DATA frame; longer samples are split by tokens
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant name
    drain_timeout_s: float = 30.0
    body_timeout_s: float = 30.0  # the whole request body must arrive within this (else 408)
    max_tenant_connections: int = 64  # open extract requests per tenant, streams included (else 429)
    heartbeat_s: float = 10.0
    log_level: str = "info"
    default_codec: str = "zstd+planes"
    stream_chunk_bytes: int = 2 << 20  # bytes per HTTP body write (research: 1-4 MB is fastest)
    request_buffer_bytes: int = 256 << 20  # states one request may hold unstreamed (server/scheduler.py)

    def __post_init__(self) -> None:
        positive = (
            "max_batch_tokens",
            "max_inflight_tokens",
            "max_tenant_inflight_tokens",
            "max_request_tokens",
            "max_body_bytes",
            "max_payload_bytes",
            "tensor_parallel_size",
            "stream_chunk_bytes",
            "request_buffer_bytes",
            "max_tenant_connections",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise SettingsError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.heartbeat_s <= 0 or self.drain_timeout_s < 0 or self.body_timeout_s <= 0:
            raise SettingsError("--heartbeat-s and --body-timeout-s must be > 0 and --drain-timeout-s >= 0")
        if self.backend not in ("auto", "hf", "vllm"):
            raise SettingsError(f"--backend must be auto, hf or vllm, got {self.backend!r}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise SettingsError(f"--kv-cache-gib must be positive, got {self.kv_cache_gib}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise SettingsError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in ("bfloat16", "float32"):
            raise SettingsError(f"--dtype must be bfloat16 or float32, got {self.dtype!r}")

    @property
    def backend_extra(self) -> dict[str, str]:
        """Backend-specific knobs as ``BackendConfig.extra`` (only the ones set; server/backends/vllm.py)."""
        extra: dict[str, str] = {}
        if self.kv_cache_gib is not None:
            extra["kv_cache_gib"] = str(self.kv_cache_gib)
        if self.gpu_memory_utilization is not None:
            extra["gpu_memory_utilization"] = str(self.gpu_memory_utilization)
        if self.vllm_compile:
            extra["compile"] = "1"
        return extra

    @property
    def request_token_cap(self) -> int:
        """The most tokens one request may carry: it must also fit the in-flight quotas, else it could
        never be admitted (a 400, not an endless 429)."""
        return min(self.max_request_tokens, self.max_tenant_inflight_tokens, self.max_inflight_tokens)


def default_tensor_parallel_size() -> int:
    """All local CUDA GPUs up to 8 (one server per 8-GPU node), 1 without CUDA."""
    import torch

    return max(1, min(8, torch.cuda.device_count())) if torch.cuda.is_available() else 1


def parse_api_keys(keys: list[str], keys_file: str | None, keys_text: str | None = None) -> dict[str, str]:
    """``--api-key`` values (tenants ``key-1``, ``key-2``, ...) plus ``--api-keys-file`` entries and
    ``$EAGLE3_API_KEYS`` (``keys_text``; both lines ``tenant: key`` or a JSON object ``{tenant: key}``)
    -> ``{key: tenant}``. The file and the variable keep keys out of ``ps``; ``--api-key`` does not."""
    pairs = [(f"key-{i}", key) for i, key in enumerate(keys, start=1)]
    if keys_file:
        try:
            text = Path(keys_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise SettingsError(f"API keys file {keys_file}: {exc.strerror or exc}") from None
        pairs += _key_pairs(text, keys_file)
    if keys_text:
        pairs += _key_pairs(keys_text, f"${KEYS_ENV}")
    out: dict[str, str] = {}
    for tenant, key in pairs:
        if not key:
            raise SettingsError(f"API key for tenant {tenant!r} is empty")
        if key in out and out[key] != tenant:
            raise SettingsError(f"the same API key is given to tenants {out[key]!r} and {tenant!r}")
        out[key] = tenant
    return out


def _key_pairs(text: str, keys_file: str) -> list[tuple[str, str]]:
    """``(tenant, key)`` pairs of a keys file's text; ``keys_file`` names it in errors."""
    pairs: list[tuple[str, str]] = []
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SettingsError(f"{keys_file}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(obj, dict) or not all(isinstance(v, str) for v in obj.values()):
            raise SettingsError(f"{keys_file}: expected a JSON object {{tenant: key}}")
        pairs += [(str(t), k) for t, k in obj.items()]
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            tenant, sep, key = line.partition(":")
            if not sep or not tenant.strip() or not key.strip():
                raise SettingsError(f"{keys_file}:{lineno}: expected 'tenant: key'")
            pairs.append((tenant.strip(), key.strip()))
    return pairs
