"""The numpy e4m3fn codec (core/fp8.py) is bit-exact with torch.float8_e4m3fn, and the per-token,
per-layer scale keeps every state within e4m3's relative error of its value."""

from __future__ import annotations

import numpy as np
import torch

from eagle3.core.fp8 import (
    E4M3_MAX,
    decode_e4m3,
    decode_e4m3_into,
    dequantize_states,
    encode_e4m3,
    float32_to_bf16_bits,
    quantize_states,
)


def test_every_code_decodes_as_torch() -> None:
    codes = np.arange(256, dtype=np.uint8)
    want = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    got = decode_e4m3(codes)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    assert np.array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))  # -0.0 included
    assert np.nanmax(got) == E4M3_MAX and np.isnan(got).sum() == 2


def test_every_finite_code_encodes_back_to_itself() -> None:
    codes = np.arange(256, dtype=np.uint8)
    finite = ~np.isnan(decode_e4m3(codes))
    assert np.array_equal(encode_e4m3(decode_e4m3(codes[finite])), codes[finite])


def test_random_values_round_as_torch() -> None:
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.uniform(-E4M3_MAX, E4M3_MAX, 200_000),
            rng.standard_normal(200_000) * 2.0 ** rng.integers(-12, 8, 200_000),  # subnormals to large
            (np.arange(-2048, 2048) + 0.5) * 2.0**-10,  # exact ties between subnormal codes
            decode_e4m3(np.arange(0x7F, dtype=np.uint8)[1:]) * 1.0625,  # ties between normal codes
            [0.0, -0.0, E4M3_MAX, -E4M3_MAX],
        ]
    ).astype(np.float32)
    want = torch.from_numpy(values).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(encode_e4m3(values), want)


def test_per_token_per_layer_scale_round_trip() -> None:
    rng = np.random.default_rng(1)
    states = rng.standard_normal((64, 4, 96)).astype(np.float32)
    states[:, 3] *= 300.0  # a final state far larger than the taps
    states[5, 0, 7] = 2000.0  # one outlier channel in one token
    states[9, 1] = 0.0  # an all-zero layer
    codes, scales = quantize_states(states)
    assert codes.dtype == np.uint8 and codes.shape == states.shape and scales.shape == (64, 4)
    back = dequantize_states(codes, scales)
    assert np.all(back[9, 1] == 0.0)
    amax = np.abs(states).max(axis=-1, keepdims=True)
    # e4m3: 3 mantissa bits (half-ulp 2^-4 relative) for normals; absolute 2^-10 * amax/448 below 2^-6
    bound = np.maximum(np.abs(states) * 2.0**-4, amax / E4M3_MAX * 2.0**-10) * 1.0001
    assert np.all(np.abs(back - states) <= bound)
    assert np.allclose(np.abs(back).max(axis=-1), amax[..., 0], rtol=1e-6)  # each amax maps to 448 exactly


def test_bf16_rounding_matches_torch() -> None:
    values = np.random.default_rng(2).standard_normal(100_000).astype(np.float32) * 1e3
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(float32_to_bf16_bits(values), want)


def test_decoding_two_codes_per_lookup_equals_one() -> None:
    codes = np.random.default_rng(3).integers(0, 256, (5, 4, 6), dtype=np.uint8)
    for view in (codes, codes[:, :-1], codes[:, -1], codes[..., :5], codes[:, ::2]):  # even, odd, strided
        out = np.empty(view.shape, np.float32)
        decode_e4m3_into(view, out)
        assert np.array_equal(out.view(np.uint32), decode_e4m3(view).view(np.uint32))  # NaN codes too
