"""The states of a features shard in each format (``core/protocol/features.py``): how the writer stores a
sample's states and how the reader gets them back.

Four formats, one per directory (``FeaturesMeta.feature_format``): ``bfloat16/none`` (the default,
lossless, memory-mapped as it is), ``bfloat16/zstd+planes`` (lossless, compressed per sample with the
wire's codec), ``float8_e4m3fn/none`` (FP8 codes + per-token, per-layer scales, ``core/fp8.py``) and
``float8_e4m3fn/zstd`` (FP8 codes compressed per sample; the scales stay raw). A compressed sample is
decompressed when it is read (``sample_states``), so a reader holds no more than the samples asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from eagle3.core.codec import RawTensor, decode_payload, encode_payload
from eagle3.core.errors import IncompatibleError
from eagle3.core.fp8 import quantize_states
from eagle3.core.protocol.features import CODEC_NONE, FeaturesFormatError, FeaturesMeta
from eagle3.core.protocol.frames import CODEC_NAMES, ProtocolError
from eagle3.core.sample import ExtractedSample

NDArray = np.ndarray[Any, Any]
Specs = dict[str, tuple[str, tuple[int, ...], list[memoryview]]]
ZSTD_STATES = "hidden_states_zstd"
ZSTD_OFFSETS = "hidden_states_zstd_offsets"


def bytes_per_token(meta: FeaturesMeta) -> int:
    """On-disk bytes per token, uncompressed (the bound a compressed directory stays under): the bf16
    states (FP8: one byte per value and a float32 scale per layer) plus the int32 id and the uint8 mask."""
    if meta.is_fp8:
        return meta.n_layers_stored * (meta.hidden_size + 4) + 4 + 1
    return meta.n_layers_stored * meta.hidden_size * 2 + 4 + 1


def stored_states(meta: FeaturesMeta, sample: ExtractedSample, where: Path) -> tuple[memoryview, memoryview | None]:
    """The sample's states as a directory of ``meta``'s format stores them, and its FP8 scales (None for
    bf16). A bf16 sample is quantized for an FP8 directory; an FP8 sample is refused by a lossless one."""
    scales: memoryview | None = None
    if not meta.is_fp8:
        if sample.is_fp8:
            raise IncompatibleError(
                f"sample {sample.sample_id!r} is FP8 and {where} stores {meta.dtype} (lossless): write FP8 "
                "samples into an FP8 features directory (--feature-dtype fp8)"
            )
        states = raw_bytes(sample.states, "<u2")
    elif sample.fp8_scales is not None:
        states, scales = raw_bytes(sample.states, "u1"), raw_bytes(sample.fp8_scales, "<f4")
    else:
        codes, scale_array = quantize_states(sample.states_float32())
        states, scales = raw_bytes(codes, "u1"), raw_bytes(scale_array, "<f4")
    if meta.shard_codec != CODEC_NONE:
        states = memoryview(encode_payload(bytes(states), CODEC_NAMES[meta.shard_codec]))
    return states, scales


def states_specs(meta: FeaturesMeta, total: int, hidden: list[memoryview], scales: list[memoryview]) -> Specs:
    """The states' tensors of a shard of ``total`` tokens, first in the file (the background writer has
    written ``hidden`` already): the states or their compressed blobs, then FP8 scales, then blob offsets."""
    n_layers = meta.n_layers_stored
    specs: Specs = {}
    if meta.shard_codec != CODEC_NONE:
        sizes = [piece.nbytes for piece in hidden]
        specs[ZSTD_STATES] = ("U8", (sum(sizes),), hidden)  # [B]: one encoded blob per sample
    else:
        dtype = "F8_E4M3" if meta.is_fp8 else "BF16"
        specs["hidden_states"] = (dtype, (total, n_layers, meta.hidden_size), hidden)  # [T, L, H]
    if meta.is_fp8:
        specs["hidden_scales"] = ("F32", (total, n_layers), scales)  # [T, L]
    if meta.shard_codec != CODEC_NONE:
        specs[ZSTD_OFFSETS] = ("I64", (len(hidden) + 1,), [memoryview(i64_bytes(cumulative(sizes)))])
    return specs


def expected_tensors(meta: FeaturesMeta, total: int, n_samples: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype, shape) of the states' tensors a shard of ``meta``'s format must hold (a compressed
    blob's length is checked by its offsets)."""
    n_layers = meta.n_layers_stored
    want: dict[str, tuple[str, tuple[int, ...]]] = {}
    if meta.shard_codec == CODEC_NONE:
        want["hidden_states"] = ("F8_E4M3" if meta.is_fp8 else "BF16", (total, n_layers, meta.hidden_size))
    else:
        want[ZSTD_OFFSETS] = ("I64", (n_samples + 1,))
    if meta.is_fp8:
        want["hidden_scales"] = ("F32", (total, n_layers))
    return want


def check_blob_offsets(meta: FeaturesMeta, path: Path, tensors: dict[str, RawTensor]) -> None:
    """A compressed shard's blob offsets start at 0, never decrease and end at the blobs' length."""
    if meta.shard_codec == CODEC_NONE:
        return
    blobs, offsets = tensors.get(ZSTD_STATES), tensors[ZSTD_OFFSETS].numpy()
    if blobs is None or blobs.dtype != "U8" or len(blobs.shape) != 1:
        raise FeaturesFormatError(f"{path}: {ZSTD_STATES} is not U8 [B]")
    if offsets[0] != 0 or offsets[-1] != blobs.shape[0] or np.any(np.diff(offsets) < 0):
        raise FeaturesFormatError(f"{path}: {ZSTD_OFFSETS} do not cover {ZSTD_STATES}")


def sample_states(
    meta: FeaturesMeta, path: Path, tensors: dict[str, RawTensor], index: int, start: int, end: int
) -> tuple[NDArray, NDArray | None]:
    """Sample ``index`` (token rows ``start:end``) of a shard: its states (a view of the map, or
    decompressed) and FP8 scales."""
    scales = tensors["hidden_scales"].numpy()[start:end] if meta.is_fp8 else None
    dtype = np.uint8 if meta.is_fp8 else np.uint16
    if meta.shard_codec == CODEC_NONE:
        return tensors["hidden_states"].numpy()[start:end], scales
    offsets = tensors[ZSTD_OFFSETS].numpy()
    blob = tensors[ZSTD_STATES].data[int(offsets[index]) : int(offsets[index + 1])]
    shape = (end - start, meta.n_layers_stored, meta.hidden_size)
    raw_size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    try:
        data = decode_payload(blob, CODEC_NAMES[meta.shard_codec], raw_size)
    except ProtocolError as exc:
        raise FeaturesFormatError(f"{path}: sample {index}'s states do not decompress ({exc})") from None
    return np.frombuffer(data, dtype=dtype).reshape(shape), scales


def raw_bytes(array: Any, dtype: str) -> memoryview:
    """The array's bytes in ``dtype`` without a copy when it already is contiguous ``dtype``."""
    return np.ascontiguousarray(array, dtype=dtype).reshape(-1).view(np.uint8).data


def cumulative(sizes: list[int]) -> list[int]:
    """``[0, s0, s0 + s1, ...]``: the offsets of pieces of ``sizes``."""
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return offsets


def i64_bytes(values: list[int]) -> bytes:
    return b"".join(v.to_bytes(8, "little", signed=True) for v in values)
