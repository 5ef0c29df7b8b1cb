"""FP8 (e4m3fn) feature states in numpy, no torch: the client writes and reads them without it.

The opt-in FP8 feature format stores each hidden state as one e4m3fn byte (1 sign, 4 exponent bits
with bias 7, 3 mantissa bits; no infinities, NaN = ``0x7F``/``0xFF``, largest finite 448) with one
float32 scale per token and per stored layer: ``scale = amax / 448`` over the layer's ``H`` values of
that token, so every token's every layer uses the whole e4m3 range. Per layer matters because the
layers differ by orders of magnitude (the final pre-norm state, the target of the draft's loss,
carries the residual stream's large outliers; an early tap does not); per token because a few tokens
(the first, separators) are much larger than the rest. e4m3 keeps 3 mantissa bits (relative error
<= 2^-4) over ``2^-6 .. 448`` (subnormals down to ``2^-9``), which covers every value within a factor
of ``2^15`` of its token's amax, so outlier channels cost the others no precision.

``encode_e4m3``/``decode_e4m3`` are bit-exact with ``torch.float8_e4m3fn`` (round to nearest even;
``tests/unit/test_fp8.py`` checks all 256 codes and random data); ``quantize_states`` /
``dequantize_states`` add the per-token, per-layer scale.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

NDArray = np.ndarray[Any, Any]

E4M3_MAX = 448.0
E4M3_NAN = 0x7F
_MIN_NORMAL = 2.0**-6
_SUBNORMAL_STEP = 2.0**-9


def _decode_table() -> NDArray:
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = mantissa / 8.0 * 2.0**-6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(codes & 0x7F) == E4M3_NAN] = np.nan
    table: NDArray = values.astype(np.float32)
    return table


E4M3_TO_FLOAT32 = _decode_table()  # float32 [256]: the value of every e4m3fn code


def _pair_table() -> NDArray:
    """uint64 [65536]: the two float32 values of two codes read as one little-endian uint16 (low byte
    first), so a lookup decodes two codes at once (about twice the rate of one-byte lookups)."""
    low, high = np.meshgrid(E4M3_TO_FLOAT32, E4M3_TO_FLOAT32, indexing="xy")  # [high, low]
    pairs: NDArray = np.stack([low, high], axis=-1).astype(np.float32).reshape(65536, 2).view(np.uint64)[:, 0]
    return pairs


_E4M3_PAIRS = _pair_table()


def decode_e4m3(codes: NDArray) -> NDArray:
    """float32 values of e4m3fn codes (uint8, any shape); a new array."""
    return E4M3_TO_FLOAT32[np.asarray(codes, dtype=np.uint8)]


def decode_e4m3_into(codes: NDArray, out: NDArray) -> None:
    """``out[...] = decode_e4m3(codes)`` without a temporary (``out`` float32 of ``codes``' shape), two
    codes per lookup when the last axis allows it (even, contiguous, a little-endian machine)."""
    codes = np.asarray(codes)
    if (
        sys.byteorder == "little"
        and codes.ndim
        and codes.shape[-1] % 2 == 0
        and codes.strides[-1] == 1
        and out.strides[-1] == 4
    ):
        np.take(_E4M3_PAIRS, codes.view(np.uint16), out=out.view(np.uint64))
    else:
        np.take(E4M3_TO_FLOAT32, codes, out=out)


def encode_e4m3(values: NDArray) -> NDArray:
    """uint8 e4m3fn codes of float32 ``values`` (any shape), rounded to nearest even as
    ``torch.Tensor.to(torch.float8_e4m3fn)`` does; magnitudes above 448 saturate to 448 (the scaled
    states never reach them), NaN becomes ``0x7F``."""
    x = np.asarray(values, dtype=np.float32)
    bits = x.view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    # normal range: round the float32 mantissa to 3 bits (nearest even), then rebias 127 -> 7
    rounded = (magnitude + np.uint32(0x7FFFF) + ((magnitude >> 20) & 1)) >> 20
    normal = rounded.astype(np.int64) - ((127 - 7) << 3)
    # below 2^-6: multiples of 2^-9 (np.rint rounds half to even); 8 steps = 2^-6 = the first normal code
    absolute = magnitude.view(np.float32)
    subnormal = np.rint(absolute / np.float32(_SUBNORMAL_STEP)).astype(np.int64)
    code = np.where(absolute < np.float32(_MIN_NORMAL), subnormal, normal)
    code = np.minimum(code, 0x7E)  # saturate at 448
    code = np.where(np.isnan(x), E4M3_NAN, code).astype(np.uint8)
    return code | sign


def state_scales(states: NDArray) -> NDArray:
    """float32 [n, L]: ``amax / 448`` of each token's each layer of float32 states ``[n, L, H]`` (1 where
    a layer is all zeros, so its codes are zeros)."""
    amax = np.max(np.abs(states), axis=-1)
    return np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)


def quantize_states(states: NDArray) -> tuple[NDArray, NDArray]:
    """float32 states ``[n, L, H]`` -> (e4m3fn codes uint8 ``[n, L, H]``, float32 scales ``[n, L]``)."""
    x = np.asarray(states, dtype=np.float32)
    scales = state_scales(x)
    return encode_e4m3(x / scales[..., None]), scales


def dequantize_states(codes: NDArray, scales: NDArray) -> NDArray:
    """float32 ``[n, L, H]`` = value of each code times its token's and layer's scale."""
    out = np.empty(np.shape(codes), np.float32)
    decode_e4m3_into(codes, out)
    out *= np.asarray(scales, dtype=np.float32)[..., None]
    return out


def float32_to_bf16_bits(values: NDArray) -> NDArray:
    """uint16 bf16 bit patterns of float32 ``values``, rounded to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16
    return np.where(np.isnan(values), np.uint32(0x7FC0), rounded).astype(np.uint16)
