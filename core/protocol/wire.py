"""The JSON of the wire, typed: each frame type's meta and the ``/v1/info`` body (stdlib only).

The server builds these objects and sends ``to_dict()``; the SDK reads them back with
``from_dict()``, which checks every field's type and raises ``ProtocolError`` naming the object and
the field (a malformed answer from a buggy server is the SDK's typed error, never a bare
``KeyError``/``TypeError``). Unknown keys are ignored, so a newer server may add fields; a field is
removed or retyped only with a new ``PROTOCOL_VERSION`` (``frames.py``), the one schema version of the
wire. docs/protocol.md documents every field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from eagle3.core.protocol.frames import CODEC_NAMES, PROTOCOL_VERSION, ProtocolError
from eagle3.core.protocol.model_identity import ModelIdentity

T = TypeVar("T", bound="WireObject")


class WireObject:
    """Base of the wire dataclasses: ``to_dict`` (tuples as lists, nested objects as dicts) and a
    checking ``from_dict``."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.metadata.get("local"):
                continue
            out[f.name] = _plain(getattr(self, f.name))
        return out

    @classmethod
    def from_dict(cls: type[T], data: Any) -> T:
        name = cls.__name__
        if not isinstance(data, dict):
            raise ProtocolError(f"{name}: expected a JSON object, got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.metadata.get("local"):
                continue
            if f.name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ProtocolError(f"{name}: field {f.name!r} is missing")
                continue
            values[f.name] = _check(data[f.name], hints[f.name], f"{name}.{f.name}")
        return cls(**values)


def _plain(value: Any) -> Any:
    if isinstance(value, WireObject):
        return value.to_dict()
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _check(value: Any, hint: Any, where: str) -> Any:
    """``value`` as the type ``hint`` says, or ``ProtocolError`` (no coercion of strings to numbers)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        return _check(value, next(a for a in args if a is not type(None)), where)
    if isinstance(hint, type) and issubclass(hint, WireObject):
        try:
            return hint.from_dict(value)
        except ProtocolError as exc:
            raise ProtocolError(f"{where}: {exc}") from None
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        return tuple(_check(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected an object, got {type(value).__name__}")
        return {str(k): _check(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where}: expected true/false, got {value!r:.40}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected an integer, got {value!r:.40}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(f"{where}: expected a number, got {value!r:.40}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected a string, got {value!r:.40}")
        return value
    return value  # Any


def _nonneg(where: str, **values: int) -> None:
    for key, value in values.items():
        if value < 0:
            raise ProtocolError(f"{where}: {key} is negative ({value})")


@dataclass(frozen=True)
class ErrorInfo(WireObject):
    """An error as the server reports it (in ERROR and SAMPLE_ERROR frames); ``retryable`` says
    whether sending the same thing again can succeed."""

    type: str
    message: str
    retryable: bool = False
    reason: str | None = None


@dataclass(frozen=True)
class StreamHeader(WireObject):
    """HEADER: what every DATA frame of the stream holds."""

    request_id: str
    model_id: str
    revision: str
    aux_layer_ids: tuple[int, ...]
    final_layer_id: int
    hidden_size: int
    vocab_size: int
    tokenizer_sha256: str
    n_samples: int
    n_tokens: int
    max_payload_bytes: int
    dtype: str = "bfloat16"
    final_norm_applied: bool = False
    protocol: int = PROTOCOL_VERSION
    codec: str | None = None  # the codec this stream's DATA frames use (codec auto decides per request)

    def __post_init__(self) -> None:
        _nonneg("StreamHeader", hidden_size=self.hidden_size, n_samples=self.n_samples, n_tokens=self.n_tokens)
        if not self.aux_layer_ids or self.hidden_size == 0 or self.max_payload_bytes <= 0:
            raise ProtocolError("StreamHeader: empty aux_layer_ids, zero hidden_size or max_payload_bytes <= 0")

    @property
    def n_layers_out(self) -> int:
        return len(self.aux_layer_ids) + 1

    @property
    def identity(self) -> ModelIdentity:
        return ModelIdentity.of(self)


@dataclass(frozen=True)
class DataMeta(WireObject):
    """DATA: one token range ``[token_start, token_end)`` of sample ``sample_id`` (``n_tokens`` long);
    ``raw_bytes`` is the decoded payload's size; ``final`` marks the sample's last range."""

    sample_id: str
    sample_index: int
    token_start: int
    token_end: int
    n_tokens: int
    final: bool
    raw_bytes: int

    def __post_init__(self) -> None:
        _nonneg("DataMeta", sample_index=self.sample_index, token_start=self.token_start, raw_bytes=self.raw_bytes)


@dataclass(frozen=True)
class SampleErrorMeta(WireObject):
    """SAMPLE_ERROR: one sample failed; the stream goes on."""

    sample_id: str
    sample_index: int
    error: ErrorInfo


@dataclass(frozen=True)
class AbortMeta(WireObject):
    """ERROR (terminal): the stream ends early; ``completed_sample_ids`` were delivered before it."""

    error: ErrorInfo
    completed_sample_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class EndMeta(WireObject):
    """END (terminal): the stream's own counts, checked by the SDK against what it received."""

    n_frames: int
    n_samples: int
    n_failed: int
    n_tokens: int
    payload_bytes: int
    raw_bytes: int

    def __post_init__(self) -> None:
        _nonneg("EndMeta", **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


@dataclass(frozen=True)
class ServerInfo(WireObject):
    """``GET /v1/info``: what the server extracts and its limits."""

    model_id: str
    revision: str
    backend: str
    device: str
    dtype: str
    num_hidden_layers: int
    aux_layer_ids: tuple[int, ...]
    final_layer_id: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    tokenizer_sha256: str
    codecs: tuple[str, ...]
    default_codec: str
    limits: dict[str, int]
    chat_template: bool = False
    final_norm_applied: bool = False
    protocol_version: int = PROTOCOL_VERSION
    benchmark_only: bool = False  # the synthetic backend: states that no model computed
    codec_auto: dict[str, float] = field(default_factory=dict)  # how codec auto decides (encode rate, link)
    feature_cache: dict[str, int] = field(default_factory=dict)  # empty: no cache; else its tiers' byte limits
    interactive_max_tokens: int = 0  # requests up to this many tokens use the interactive lane (0: no lane)
    can_generate: bool = False  # POST /v1/generate is served (core/protocol/generate.py)
    stop_token_ids: tuple[int, ...] = ()  # /v1/generate's default end of turn
    # what extract stores (bf16): per_token, per_1k_samples_of_2k_tokens (core/sizes.py); empty: an older server
    feature_bytes: dict[str, int] = field(default_factory=dict)
    url: str = field(default="", metadata={"local": True})  # where the SDK asked; not on the wire

    @property
    def identity(self) -> ModelIdentity:
        return ModelIdentity.of(self)

    @property
    def cache_on(self) -> bool:
        """The server keeps a feature cache (a repeated sample is served without a forward pass)."""
        return bool(self.feature_cache)

    def limit(self, name: str, default: int) -> int:
        value = self.limits.get(name)
        return default if value is None or value <= 0 else value


CODECS = tuple(CODEC_NAMES)  # the one list of codec names (frames.Codec holds their ids)
AUTO_CODEC = "auto"  # a request (or the server's default) may leave the choice to the server
REQUEST_CODECS = (AUTO_CODEC, *CODECS)
CACHE_MODES = ("use", "bypass")  # a request's "cache": served from the server's feature cache, or always computed
