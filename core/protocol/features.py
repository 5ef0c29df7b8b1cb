"""A features directory on disk: written by the SDK (``eagle3 extract``), read by the trainer.

Layout::

    features.json     FeaturesMeta: who made these states (model, layer ids, hidden size, dtype, ...)
    manifest.jsonl    one ShardRecord per line, appended after its shard is renamed into place
    shards/shard-<seq>-<uuid>.safetensors

Each shard is one safetensors file holding many samples, concatenated along the token axis::

    hidden_states   BF16 [T, L, H]   L = len(aux_layer_ids) + 1; the aux taps in order, the final state last
    input_ids       I32  [T]
    loss_mask       U8   [T]         1 = assistant token (supervised)
    sample_offsets  I64  [n + 1]     sample i is rows sample_offsets[i]:sample_offsets[i+1]

and ``__metadata__`` = {"schema_version", "sample_ids" (JSON list), "layer_ids" (JSON list),
"final_norm_applied": "false", "dtype", "codec"}.

Two opt-in variants (``features.json`` ``dtype`` and ``shard_codec``; every manifest line repeats its
shard's, so a directory holding shards of two formats is found and refused, never read as one):

* ``dtype = "float8_e4m3fn"`` (FP8, ``core/fp8.py``): ``hidden_states`` is ``F8_E4M3 [T, L, H]`` and
  ``hidden_scales F32 [T, L]`` follows it (state = e4m3 value x its token's and layer's scale; the
  scale is ``amax / 448`` of that token's layer). Lossy: about half the bytes of bf16.
* ``shard_codec = "zstd+planes"`` (bf16) or ``"zstd"`` (FP8): lossless compression at rest, per
  sample so a sample is read without its neighbours. ``hidden_states`` is replaced by
  ``hidden_states_zstd U8 [B]`` (the samples' states compressed one by one with the wire's codec,
  ``core/codec.py::encode_payload``, concatenated) and ``hidden_states_zstd_offsets I64 [n + 1]``
  (sample ``i``'s bytes); the other tensors stay as they are.

Invariants:

* Layer semantics are vLLM's (docs/architecture.md, "Layer ids"): aux id k is the residual stream entering decoder
  layer k (= HF ``hidden_states[k]``); the final state is the last decoder layer's output *before*
  the final norm, so ``final_norm_applied`` is always false.
* The manifest is the truth. A shard file without a manifest line is an orphan (a crash between
  rename and append) and is ignored and may be deleted; a manifest line whose shard is missing or
  whose checksum differs is corruption and fails loudly. The checksum is ``xxh3_128`` (written since
  the serving path went to GPU speed: ~10x sha256's rate) or, in older manifests, ``sha256``; readers
  accept both.
* Shards are written to a unique ``.tmp`` name, fsynced, renamed, and only then recorded.
* A sample id appears in at most one manifest line; resume requests exactly the ids not yet recorded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3.core.errors import Eagle3Error
from eagle3.core.protocol.model_identity import ModelIdentity

FEATURES_SCHEMA_VERSION = 1
FEATURES_META_FILE = "features.json"
MANIFEST_FILE = "manifest.jsonl"
SHARDS_DIR = "shards"
SHARD_TENSORS = ("hidden_states", "input_ids", "loss_mask", "sample_offsets")
DTYPE_BF16 = "bfloat16"
DTYPE_FP8 = "float8_e4m3fn"
FEATURE_DTYPES = {"bf16": DTYPE_BF16, "fp8": DTYPE_FP8}  # the --feature-dtype choices -> features.json dtype
SHARD_CODECS = {DTYPE_BF16: "zstd+planes", DTYPE_FP8: "zstd"}  # compressed at rest: the codec each dtype gets
CODEC_NONE = "none"


class FeaturesFormatError(Eagle3Error, ValueError):
    """A features directory is missing a file, or a manifest line or shard breaks the invariants."""


@dataclass(frozen=True)
class FeaturesMeta:
    model_id: str  # what the server calls its verifier (a name or a path)
    revision: str  # checkpoint identity by content (core/identity.py::checkpoint_revision), from /v1/info
    aux_layer_ids: tuple[int, ...]  # vLLM semantics; the final state is the extra last layer
    final_layer_id: int  # = number of decoder layers N
    hidden_size: int
    vocab_size: int
    dtype: str  # the states on disk: "bfloat16" (lossless, the default) or "float8_e4m3fn" (FP8, opt-in)
    tokenizer_sha256: str
    prepared_dir: str = ""
    n_samples_total: int = 0  # samples in the prepared dataset this directory is filled from
    final_norm_applied: bool = False
    schema_version: int = FEATURES_SCHEMA_VERSION
    shard_codec: str = CODEC_NONE  # "none", or the lossless compression at rest (SHARD_CODECS)

    def __post_init__(self) -> None:
        if self.dtype not in SHARD_CODECS:
            raise FeaturesFormatError(f"{FEATURES_META_FILE}: dtype {self.dtype!r} is not one of {list(SHARD_CODECS)}")
        if self.shard_codec not in (CODEC_NONE, SHARD_CODECS[self.dtype]):
            raise FeaturesFormatError(
                f"{FEATURES_META_FILE}: shard_codec {self.shard_codec!r} with dtype {self.dtype!r}; expected "
                f"{CODEC_NONE!r} or {SHARD_CODECS[self.dtype]!r}"
            )

    @property
    def feature_format(self) -> str:
        """``dtype/codec``, e.g. ``bfloat16/none``: what a reader must decode, one per directory."""
        return f"{self.dtype}/{self.shard_codec}"

    @property
    def is_fp8(self) -> bool:
        return self.dtype == DTYPE_FP8

    @property
    def n_layers_stored(self) -> int:
        return len(self.aux_layer_ids) + 1

    @property
    def identity(self) -> ModelIdentity:
        return ModelIdentity.of(self)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FeaturesMeta:
        if data.get("schema_version") != FEATURES_SCHEMA_VERSION:
            raise FeaturesFormatError(
                f"features schema version {data.get('schema_version')!r}, expected {FEATURES_SCHEMA_VERSION}"
            )
        try:
            data = dict(data, aux_layer_ids=tuple(data["aux_layer_ids"]))
            return cls(**data)
        except (KeyError, TypeError) as exc:
            raise FeaturesFormatError(f"{FEATURES_META_FILE}: {exc}") from None


@dataclass(frozen=True)
class ShardRecord:
    """One manifest line: a shard that is complete on disk."""

    shard: str  # file name relative to SHARDS_DIR
    sample_ids: tuple[str, ...]
    n_tokens: tuple[int, ...]  # per sample, same order as sample_ids
    bytes: int  # file size
    sha256: str  # of the whole file; "" in shards written since xxh3_128 (older manifests have only this)
    model_id: str
    aux_layer_ids: tuple[int, ...]
    xxh3_128: str = ""  # of the whole file (hex): the digest new shards get (memory speed, xxhash)
    dtype: str = DTYPE_BF16  # the shard's states (FeaturesMeta.dtype); lines of bf16 shards leave it out
    codec: str = CODEC_NONE  # the shard's compression at rest (FeaturesMeta.shard_codec); "none" left out

    @property
    def feature_format(self) -> str:
        return f"{self.dtype}/{self.codec}"

    def __post_init__(self) -> None:
        if len(self.sample_ids) != len(self.n_tokens) or not self.sample_ids:
            raise FeaturesFormatError(f"manifest line for {self.shard}: sample_ids and n_tokens disagree or empty")
        if not self.sha256 and not self.xxh3_128:
            raise FeaturesFormatError(f"manifest line for {self.shard}: no checksum (xxh3_128 or sha256)")

    def to_line(self) -> str:
        defaults = {"sha256": "", "xxh3_128": "", "dtype": DTYPE_BF16, "codec": CODEC_NONE}
        fields = {k: v for k, v in asdict(self).items() if k not in defaults or v != defaults[k]}
        return json.dumps(fields, separators=(",", ":")) + "\n"

    @classmethod
    def from_line(cls, line: str, where: str) -> ShardRecord:
        try:
            data = json.loads(line)
            return cls(
                shard=str(data["shard"]),
                sample_ids=tuple(str(s) for s in data["sample_ids"]),
                n_tokens=tuple(int(n) for n in data["n_tokens"]),
                bytes=int(data["bytes"]),
                sha256=str(data.get("sha256", "")),
                model_id=str(data["model_id"]),
                aux_layer_ids=tuple(int(i) for i in data["aux_layer_ids"]),
                xxh3_128=str(data.get("xxh3_128", "")),
                dtype=str(data.get("dtype", DTYPE_BF16)),
                codec=str(data.get("codec", CODEC_NONE)),
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise FeaturesFormatError(f"{where}: not a manifest record ({exc})") from None


def read_features_meta(features_dir: Path) -> FeaturesMeta:
    path = Path(features_dir) / FEATURES_META_FILE
    if not path.is_file():
        raise FeaturesFormatError(f"{features_dir} is not a features directory (no {FEATURES_META_FILE})")
    return FeaturesMeta.from_dict(json.loads(path.read_text()))


def iter_manifest(features_dir: Path) -> Iterator[ShardRecord]:
    """Records in append order. A torn last line (crash mid-append) is skipped; any other bad line fails."""
    path = Path(features_dir) / MANIFEST_FILE
    if not path.is_file():
        return
    text = path.read_text()
    lines = text.split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        torn_tail = number == len(lines) and not text.endswith("\n")
        try:
            yield ShardRecord.from_line(line, f"{path}:{number}")
        except FeaturesFormatError:
            if torn_tail:
                return
            raise
