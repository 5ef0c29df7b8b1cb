"""Payload codec: exact round trips, bounds, and byte-for-byte agreement with the safetensors library."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from eagle3.core.codec import (
    bf16_to_float32,
    build_safetensors,
    decode_payload,
    encode_payload,
    parse_safetensors,
    shuffle_planes,
    unshuffle_planes,
)
from eagle3.core.protocol.frames import Codec, ProtocolError


def sample_blob() -> bytes:
    gen = torch.Generator().manual_seed(0)
    return st_save(
        {
            "hidden_states": (torch.randn(37, 4, 64, generator=gen) * 30).to(torch.bfloat16),
            "input_ids": torch.arange(37, dtype=torch.int32),
            "loss_mask": (torch.arange(37) % 2).to(torch.uint8),
        }
    )


@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000, 1001])
def test_shuffle_round_trip_any_length(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert unshuffle_planes(shuffle_planes(data)) == data
    if n >= 2:
        assert shuffle_planes(data)[0] == data[0] and shuffle_planes(data)[n // 2] == data[1]


@pytest.mark.parametrize("codec", list(Codec))
def test_payload_round_trip_is_exact(codec):
    blob = sample_blob()
    assert decode_payload(encode_payload(blob, codec), codec, len(blob)) == blob


def test_decode_rejects_a_wrong_declared_size_and_garbage():
    blob = sample_blob()
    payload = encode_payload(blob, Codec.ZSTD)
    with pytest.raises(ProtocolError, match="declares"):
        decode_payload(payload, Codec.ZSTD, len(blob) - 1)
    with pytest.raises(ProtocolError):
        decode_payload(b"not zstd at all", Codec.ZSTD, 10)


def test_parse_matches_torch_and_build_matches_safetensors():
    blob = sample_blob()
    tensors, _ = parse_safetensors(blob)
    ref = st_load(blob)
    assert tensors["hidden_states"].shape == (37, 4, 64)
    widened = bf16_to_float32(tensors["hidden_states"].numpy())
    assert np.array_equal(widened, ref["hidden_states"].float().numpy())
    assert np.array_equal(tensors["input_ids"].numpy(), ref["input_ids"].numpy())
    rebuilt = b"".join(build_safetensors(tensors, {"sample_ids": '["a"]'}))
    again = st_load(rebuilt)
    assert torch.equal(again["hidden_states"], ref["hidden_states"])
    assert parse_safetensors(rebuilt)[1] == {"sample_ids": '["a"]'}


def test_parse_bounds_checks_offsets():
    blob = bytearray(sample_blob())
    with pytest.raises(ProtocolError, match="header length"):
        parse_safetensors(b"\xff" * 8 + bytes(blob[8:]))
    with pytest.raises(ProtocolError):
        parse_safetensors(bytes(blob[: len(blob) - 10]))


@pytest.mark.parametrize("n_bytes", [0, 1, 2, 1001])
def test_planes_codec_round_trips_odd_and_empty_blobs(n_bytes):
    blob = (bytes(range(256)) * 4)[:n_bytes]
    assert decode_payload(encode_payload(blob, Codec.ZSTD_PLANES), Codec.ZSTD_PLANES, len(blob)) == blob


def test_planes_codec_is_smaller_than_one_shuffled_frame_on_bf16_states():
    gen = torch.Generator().manual_seed(1)
    states = (torch.randn(512, 4, 64, generator=gen) * 3).to(torch.bfloat16)  # [n, L, H]
    blob = states.view(torch.int16).numpy().tobytes()
    planes = encode_payload(blob, Codec.ZSTD_PLANES)
    assert len(planes) < len(encode_payload(blob, Codec.ZSTD_SHUFFLE))
    assert decode_payload(planes, Codec.ZSTD_PLANES, len(blob)) == blob


def test_planes_codec_rejects_bad_prefix_swapped_sizes_and_truncation():
    blob = sample_blob()
    payload = encode_payload(blob, Codec.ZSTD_PLANES)
    with pytest.raises(ProtocolError, match="shorter than its length prefix"):
        decode_payload(payload[:3], Codec.ZSTD_PLANES, len(blob))
    with pytest.raises(ProtocolError, match="runs past"):
        decode_payload((len(payload)).to_bytes(4, "little") + payload[4:], Codec.ZSTD_PLANES, len(blob))
    with pytest.raises(ProtocolError, match="declares"):
        decode_payload(payload, Codec.ZSTD_PLANES, len(blob) + 2)
    with pytest.raises(ProtocolError):
        decode_payload(payload[:-5], Codec.ZSTD_PLANES, len(blob))
