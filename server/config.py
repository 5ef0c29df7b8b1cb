"""``ServerSettings``: every ``eagle3 serve`` setting, typed, in one place; flags, ``EAGLE3_*``
variables and the ``--config`` file are generated from it (``eagle3.core.knobs``)."""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.core.cli_args import MODEL_CHOICES_TEXT, MODEL_REQUIRED, MissingModelError
from eagle3.core.engine_args import EngineArgsError, parse_engine_args
from eagle3.core.knobs import Knob, KnobError, knob, knob_fields
from eagle3.core.models import DEFAULT_MODEL
from eagle3.core.protocol.wire import REQUEST_CODECS
from eagle3.server.backends.base import SyntheticOptions, VllmOptions

KEYS_FILE_ENV = "EAGLE3_API_KEYS_FILE"  # default of --api-keys-file
KEYS_ENV = "EAGLE3_API_KEYS"  # the keys file's text itself (lines 'tenant: key' or JSON)
RESERVED_TENANT_PREFIX = "_"  # the server's own tenants (the load's warm-up: _warmup)


class SettingsError(KnobError):
    """A serve flag or the API keys file is invalid (a one-line CLI error)."""


CODEC_CHOICES = REQUEST_CODECS


def _layer_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError("expected comma-separated integers like 2,15,27") from None


@dataclass(frozen=True)
class ServerSettings:
    """Every ``eagle3 serve`` setting: flag ``--name-with-dashes``, variable ``EAGLE3_NAME``, or a key
    of the ``--config`` file (``eagle3.core.knobs`` derives all three from these fields)."""

    # the verifier
    model: str | None = knob(
        None, f"the verifier, required unless --backend synthetic: {MODEL_CHOICES_TEXT}", metavar="MODEL"
    )
    backend: str = knob(
        "auto",
        "auto: vllm if importable, else hf; synthetic: no model, deterministic random "
        "states, for benchmarks and tests only",
        choices=("auto", "hf", "vllm", "synthetic"),
    )
    aux_layer_ids: tuple[int, ...] | None = knob(
        None, "comma-separated; default 2,N//2,N-3 (N <= 6: 1,N//2,N-1)", parse=_layer_ids
    )
    dtype: str = knob("bfloat16", "dtype of the forward pass", choices=("bfloat16", "float32"))
    device: str = knob("auto", "where the verifier runs", choices=("auto", "cpu", "cuda"))
    trust_remote_code: bool = knob(False, "run the checkpoint's own modelling code (transformers and vLLM)")
    max_model_len: int | None = knob(None, "longest sample in tokens; default: the model's context")
    # vllm backend
    tensor_parallel_size: int | None = knob(None, "vllm: GPUs per engine; default all CUDA GPUs up to 8, 1 on CPU")
    kv_cache_gib: float | None = knob(None, "vllm: KV cache size in GiB (CPU default 2)")
    gpu_memory_utilization: float | None = knob(None, "vllm on CUDA: share of GPU memory (vLLM's default 0.9)")
    vllm_compile: bool = knob(False, "vllm: torch.compile + CUDA graphs instead of eager mode")
    engine_arg: tuple[str, ...] = knob(
        (), "vllm: any vllm EngineArgs field, KEY=VALUE (JSON value), repeatable", repeat=True, metavar="KEY=VALUE"
    )
    engine_args_json: str | None = knob(None, "vllm: a JSON object of EngineArgs fields (--engine-arg wins)")
    # scheduling and limits
    max_batch_tokens: int = knob(8192, "tokens per forward pass")
    max_inflight_tokens: int = knob(1 << 21, "tokens admitted and not yet streamed out, all tenants (over: 503)")
    max_tenant_inflight_tokens: int = knob(1 << 19, "the same per tenant (over: 429)")
    max_request_tokens: int = knob(1 << 18, "tokens in one request (over: 400)")
    max_body_bytes: int = knob(64 << 20, "largest request body in MiB (over: 413)", flag="--max-body-mb", scale=2**20)
    max_payload_bytes: int = knob(
        64 << 20,
        "raw MiB per DATA frame; longer samples are split by token range",
        flag="--max-payload-mb",
        scale=2**20,
    )
    request_buffer_bytes: int = knob(
        256 << 20,
        "MiB of states one request may hold computed but unsent (a slow reader pauses only itself)",
        flag="--request-buffer-mb",
        scale=2**20,
    )
    default_codec: str = knob(
        "auto",
        "payload codec when a request names none; auto: none to a client on this "
        "host, zstd+planes when the encoders outrun --link-mb-s",
        choices=CODEC_CHOICES,
    )
    link_mb_s: float = knob(1250.0, "codec auto: the network's MB/s (10 Gb/s); server/codec_choice.py")
    encoder_threads: int | None = knob(None, "threads that encode frames; default one per CPU core")
    stream_chunk_bytes: int = knob(2 << 20, "MiB per HTTP body write", flag="--stream-chunk-mb", scale=2**20)
    # feature cache (server/feature_cache.py) and the interactive lane (server/lanes.py)
    cache_memory_bytes: int = knob(
        1 << 30,
        "MiB of extracted samples kept in memory for repeats (0: no memory tier)",
        flag="--cache-memory-mb",
        scale=2**20,
    )
    # --feature-cache-dir / EAGLE3_FEATURE_CACHE_DIR: not EAGLE3_CACHE_DIR, which is the model cache's root only
    cache_dir: str | None = knob(
        None,
        "directory of the feature cache's disk tier (survives restarts; may be shared by several servers)",
        flag="--feature-cache-dir",
    )
    cache_disk_bytes: int = knob(
        16 << 30, "GiB the disk tier may hold (least recently used entries go first)", flag="--cache-gb", scale=2**30
    )
    cache_scope: str = knob(
        "shared",
        "shared: one cache for every tenant (a hit, and its latency, tells any "
        "tenant that someone extracted that text); tenant: each tenant hits only its own "
        "entries (docs/reliability.md, Isolation)",
        choices=("shared", "tenant"),
    )
    interactive_max_tokens: int = knob(
        2048,
        "requests of at most this many tokens go to the interactive lane, "
        "a forward pass of their own ahead of bulk work (0: no lane)",
    )
    # synthetic backend (benchmarks and tests only)
    synthetic_hidden_size: int = knob(4096, "synthetic backend: the states' hidden size")
    synthetic_num_hidden_layers: int = knob(
        32, "synthetic backend: N (aux ids default to 2, N//2, N-3)", flag="--synthetic-num-layers"
    )
    synthetic_tokens_per_s: float | None = knob(
        None, "synthetic backend: a simulated forward pass of this many tokens per second (default: memory speed)"
    )
    # network, keys, lifecycle
    host: str = knob("127.0.0.1", "address to bind")
    port: int = knob(8000, "0 picks a free port (printed on stderr)")
    api_key: tuple[str, ...] = field(
        default=(),
        repr=False,
        metadata={
            "knob": Knob(
                "an API key (tenants key-1, key-2, ...), repeatable; prefer EAGLE3_API_KEY or a keys file: "
                "flags show in ps",
                repeat=True,
                secret=True,
                metavar="KEY",
            )
        },
    )
    api_keys_file: str | None = knob(None, "lines 'tenant: key' or a JSON object {tenant: key}")
    header_timeout_s: float = knob(
        10.0,
        "seconds a client may take to send a request's headers (then the "
        "connection is closed; slow-header clients hold no socket longer)",
    )
    drain_timeout_s: float = knob(30.0, "seconds open streams get to finish after SIGTERM")
    body_timeout_s: float = knob(30.0, "seconds the whole request body may take to arrive (else 408)")
    max_tenant_connections: int = knob(64, "open extract requests per tenant, streams included (else 429)")
    heartbeat_s: float = knob(10.0, "seconds between HEARTBEAT frames of an idle stream")
    log_level: str = knob("info", "server log level", choices=("debug", "info", "warning", "error"))
    log_format: str = knob("text", "log lines as text, or one JSON object per line (k8s)", choices=("text", "json"))
    # who may see what without a key
    allow_anonymous: bool = knob(
        False, "serve without API keys on a non-loopback --host (anyone who reaches the port can extract)"
    )
    public_metrics: bool = knob(False, "serve /metrics without an API key (a Prometheus scraper is not a tenant)")
    public_status: bool = knob(
        False,
        "serve the status page (/ and /v1/status) without an API key: every "
        "tenant's rows, error messages and request ids redacted",
    )
    public_openapi: bool = knob(False, "serve /openapi.json without an API key")
    admin_tenant: tuple[str, ...] = knob(
        (),
        "a tenant of the keys whose key sees every tenant's rows, errors and the "
        "cache counters (other keys see their own tenant's), repeatable",
        repeat=True,
        metavar="TENANT",
    )
    max_anonymous_tenants: int = knob(
        64,
        "without keys: distinct X-Eagle3-Tenant names kept (the least recently "
        "seen idle one is forgotten; all busy: 429)",
    )
    # $EAGLE3_API_KEYS: the keys file's text itself (keeps keys out of ps and off disk); not a flag
    api_keys_text: str | None = field(default=None, repr=False)
    # derived: key -> tenant, from api_key, api_keys_file and api_keys_text (or given directly)
    api_keys: dict[str, str] = field(default_factory=dict, repr=False)
    # where each setting not left at its default came from (flag, --set, variable, --config): the start-up log
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.api_key or self.api_keys_file or self.api_keys_text:
            keys = parse_api_keys(self.api_key, self.api_keys_file, self.api_keys_text)
            object.__setattr__(self, "api_keys", {**self.api_keys, **keys})
        if self.tensor_parallel_size is None:
            object.__setattr__(self, "tensor_parallel_size", 1)
        self.vllm_options  # noqa: B018 (validates --engine-arg / --engine-args-json now, not at load)
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
            "max_anonymous_tenants",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise SettingsError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.heartbeat_s <= 0 or self.drain_timeout_s < 0 or self.body_timeout_s <= 0 or self.header_timeout_s <= 0:
            raise SettingsError(
                "--heartbeat-s, --body-timeout-s and --header-timeout-s must be > 0 and --drain-timeout-s >= 0"
            )
        tenants = set(self.api_keys.values())
        if unknown := [t for t in self.admin_tenant if t not in tenants]:
            raise SettingsError(
                f"--admin-tenant {', '.join(map(repr, unknown))}: no API key names that tenant "
                f"(tenants: {', '.join(map(repr, sorted(tenants))) or 'none, the server has no keys'})"
            )
        if self.backend not in ("auto", "hf", "vllm", "synthetic"):
            raise SettingsError(f"--backend must be auto, hf, vllm or synthetic, got {self.backend!r}")
        if self.encoder_threads is not None and self.encoder_threads <= 0:
            raise SettingsError(f"--encoder-threads must be positive, got {self.encoder_threads}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise SettingsError(f"--kv-cache-gib must be positive, got {self.kv_cache_gib}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise SettingsError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cache_memory_bytes < 0 or self.cache_disk_bytes <= 0 or self.interactive_max_tokens < 0:
            raise SettingsError(
                f"--cache-memory-mb and --interactive-max-tokens must be >= 0 and --cache-gb > 0, got "
                f"{self.cache_memory_bytes / 2**20:g}, {self.interactive_max_tokens}, {self.cache_disk_bytes / 2**30:g}"
            )
        if self.synthetic_tokens_per_s is not None and self.synthetic_tokens_per_s <= 0:
            raise SettingsError(f"--synthetic-tokens-per-s must be positive, got {self.synthetic_tokens_per_s}")
        if self.link_mb_s <= 0:
            raise SettingsError(f"--link-mb-s must be positive, got {self.link_mb_s}")
        if self.dtype not in ("bfloat16", "float32"):
            raise SettingsError(f"--dtype must be bfloat16 or float32, got {self.dtype!r}")
        if not self.api_keys and not self.allow_anonymous and not is_loopback(self.host):
            raise SettingsError(
                f"--host {self.host} is reachable from other machines and no API key is set: anyone could use "
                "the server. Give keys (--api-keys-file FILE or EAGLE3_API_KEY), or pass --allow-anonymous "
                "if the network itself is private."
            )

    @property
    def vllm_options(self) -> VllmOptions:
        """The vllm backend's typed options (pass-through engine arguments checked against vLLM at load)."""
        try:
            engine_args = parse_engine_args(self.engine_arg, self.engine_args_json)
        except EngineArgsError as exc:
            raise SettingsError(str(exc)) from None
        return VllmOptions(
            kv_cache_gib=self.kv_cache_gib,
            gpu_memory_utilization=self.gpu_memory_utilization,
            compile=self.vllm_compile,
            engine_args=engine_args,
        )

    def check_model(self) -> None:
        """``MissingModelError`` unless a model is set or the backend needs none (synthetic). Checked by
        ``eagle3 serve`` (after flags, variables and ``--config``) and by a ``Runtime`` that loads its own
        backend; a test that injects a backend needs no model."""
        if self.model is None and self.backend != "synthetic":
            raise MissingModelError(f"{MODEL_REQUIRED} (or $EAGLE3_MODEL, or the key model of --config)")

    @property
    def backend_model(self) -> str:
        """What the backend loads: ``model``. Without one (``--backend synthetic``, or an injected backend)
        the embedded demo model, whose tokenizer and vocabulary the synthetic states then claim."""
        return self.model if self.model is not None else DEFAULT_MODEL

    @property
    def synthetic_options(self) -> SyntheticOptions:
        return SyntheticOptions(
            self.synthetic_hidden_size, self.synthetic_num_hidden_layers, tokens_per_s=self.synthetic_tokens_per_s
        )

    @property
    def cache_on(self) -> bool:
        """The feature cache is on when either tier has room."""
        return self.cache_memory_bytes > 0 or self.cache_dir is not None

    def effective(self) -> dict[str, str]:
        """``{name: "value (source)"}`` of every setting given by a flag, ``--set``, a variable or ``--config``
        (vLLM logs its non-default args the same way); secrets as ``***``, API keys as their tenant count."""
        out = {}
        for f in knob_fields(type(self)):
            if f.name in self.sources:
                value = "***" if f.metadata["knob"].secret else repr(getattr(self, f.name))
                out[f.name] = f"{value} ({self.sources[f.name]})"
        if self.api_keys:
            out["api_keys"] = f"{len(set(self.api_keys.values()))} tenant(s)"
        return out

    @property
    def request_token_cap(self) -> int:
        """The most tokens one request may carry: it must also fit the in-flight quotas, else it could
        never be admitted (a 400, not an endless 429)."""
        return min(self.max_request_tokens, self.max_tenant_inflight_tokens, self.max_inflight_tokens)


def is_loopback(host: str) -> bool:
    """True for addresses only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def default_tensor_parallel_size() -> int:
    """All local CUDA GPUs up to 8 (one server per 8-GPU node), 1 without CUDA."""
    import torch

    return max(1, min(8, torch.cuda.device_count())) if torch.cuda.is_available() else 1


def parse_api_keys(
    keys: tuple[str, ...] | list[str], keys_file: str | None, keys_text: str | None = None
) -> dict[str, str]:
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
        if tenant.startswith(RESERVED_TENANT_PREFIX):
            raise SettingsError(f"tenant {tenant!r}: names starting with '_' are reserved for the server's own work")
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
