"""The ``synthetic`` backend (deterministic states at memory speed; never ``auto``; ``/v1/info`` says so)
and ``--model dummy:<shape>`` on the hf backend (random weights of a named shape, no checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from eagle3.core.codec import decode_payload, parse_safetensors
from eagle3.core.protocol.frames import FrameDecoder, FrameType
from eagle3.core.sample import ExtractedSample
from eagle3.server.app import create_app
from eagle3.server.backends import BackendConfig, make_backend, resolve_backend_name
from eagle3.server.backends.base import SyntheticOptions
from eagle3.server.backends.dummy_model import DUMMY_SHAPES, dummy_shape
from eagle3.server.backends.hf import HfBackend
from eagle3.server.backends.synthetic import POOL_ROWS, SyntheticBackend
from eagle3.server.config import ServerSettings, SettingsError


def loaded_synthetic(smollm2_dir: Path, hidden: int = 32, layers: int = 8) -> SyntheticBackend:
    config = BackendConfig(
        model=str(smollm2_dir), synthetic=SyntheticOptions(hidden_size=hidden, num_hidden_layers=layers)
    )
    backend = SyntheticBackend(config)
    backend.load(lambda _p, _f: None)
    return backend


def test_synthetic_states_are_deterministic_batched_equals_single_and_position_dependent(smollm2_dir: Path) -> None:
    backend = loaded_synthetic(smollm2_dir)
    assert backend.info is not None and backend.info.aux_layer_ids == (2, 4, 5)
    a, b = [5, 6, 7, 5, 5], list(range(100, 300))
    packed = backend.extract([a, b])
    alone = [backend.extract([a])[0], backend.extract([b])[0]]
    for got, want, ids in zip(packed, alone, (a, b), strict=True):
        assert got.dtype == torch.bfloat16 and got.is_contiguous() and tuple(got.shape) == (len(ids), 4, 32)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # the same token at other positions gets other rows; another load with the same seed: the same bits
    assert not torch.equal(packed[0][0], packed[0][3])
    again = loaded_synthetic(smollm2_dir)
    assert torch.equal(again.extract([b])[0].view(torch.int16), packed[1].view(torch.int16))
    # realistic activations for the codecs: finite, spread like N(0, 3)
    values = backend.pool.float() if backend.pool is not None else torch.zeros(1)
    assert values.shape[0] == POOL_ROWS and torch.isfinite(values).all() and 2.5 < values.std().item() < 3.5


def test_synthetic_is_never_auto_and_rejects_bad_shapes(smollm2_dir: Path) -> None:
    assert resolve_backend_name("auto") in ("hf", "vllm")
    assert make_backend("synthetic", BackendConfig(model=str(smollm2_dir))).name == "synthetic"
    with pytest.raises(Exception, match="hidden_size must be positive"):
        SyntheticBackend(BackendConfig(model=str(smollm2_dir), synthetic=SyntheticOptions(hidden_size=0)))
    with pytest.raises(SettingsError, match="synthetic"):
        ServerSettings(backend="nope")


def test_synthetic_server_info_says_benchmark_only_and_streams_its_exact_states(smollm2_dir: Path) -> None:
    settings = ServerSettings(
        model=str(smollm2_dir),
        backend="synthetic",
        synthetic_hidden_size=64,
        synthetic_num_hidden_layers=8,
        max_batch_tokens=512,
        heartbeat_s=0.2,
    )
    reference = loaded_synthetic(smollm2_dir, hidden=64, layers=8)
    ids = [[1, 2, 3, 4], list(range(7, 300))]
    with TestClient(create_app(settings)) as client:
        for _ in range(600):
            if client.get("/readyz").status_code == 200:
                break
            import time

            time.sleep(0.05)
        info = client.get("/v1/info").json()
        assert info["backend"] == "synthetic" and info["benchmark_only"] is True
        assert info["hidden_size"] == 64 and info["num_hidden_layers"] == 8
        body = {"samples": [{"id": str(i), "input_ids": s} for i, s in enumerate(ids)], "codec": "zstd+planes"}
        resp = client.post("/v1/extract", json=body)
        frames = FrameDecoder().feed(resp.content)
    data = [f for f in frames if f.type == FrameType.DATA]
    assert frames[-1].type == FrameType.END and len(data) == 2
    for frame in data:
        raw = decode_payload(frame.payload, frame.codec, frame.meta["raw_bytes"])
        hidden = parse_safetensors(raw)[0]["hidden_states"].numpy()
        want = reference.extract([ids[int(frame.meta["sample_id"])]])[0].view(torch.int16).numpy()
        assert (hidden.view("<i2") == want).all()


def test_dummy_model_builds_a_named_shape_with_seeded_random_weights(smollm2_dir: Path) -> None:
    assert dummy_shape("dummy:llama-3.1-8b")[1] == DUMMY_SHAPES["llama-3.1-8b"]
    with pytest.raises(ValueError, match="unknown dummy shape"):
        dummy_shape("dummy:gpt-9")
    config = BackendConfig(model="dummy:tiny", max_batch_tokens=256, device="cpu")
    one, two = HfBackend(config), HfBackend(config)
    info = one.load(lambda _p, _f: None)
    two.load(lambda _p, _f: None)
    assert info.model_id == "dummy:tiny" and info.hidden_size == 64 and info.num_hidden_layers == 8
    assert info.vocab_size == 49152 and info.model_dir == str(smollm2_dir)  # SmolLM2's tokenizer
    assert {p.dtype for p in one.model.parameters()} == {torch.bfloat16}
    states = one.extract([[1, 2, 3], list(range(50))])
    assert [tuple(s.shape) for s in states] == [(3, 4, 64), (50, 4, 64)]
    assert torch.equal(states[1], two.extract([list(range(50))])[0])  # same seed: same weights


def test_parallel_encoding_keeps_frame_order_across_split_samples(smollm2_dir: Path) -> None:
    """A pass's samples are encoded at once on the pool and each splits into several frames; the stream
    must still number them +1 each and every sample must reassemble to its exact states."""
    from eagle3.client.stream import StreamAssembler

    settings = ServerSettings(
        model=str(smollm2_dir),
        backend="synthetic",
        synthetic_hidden_size=64,
        synthetic_num_hidden_layers=8,
        max_batch_tokens=4096,
        max_payload_bytes=20_000,  # ~38 tokens per frame at 4 x 64 x 2 B per token
        encoder_threads=4,
        heartbeat_s=0.2,
    )
    reference = loaded_synthetic(smollm2_dir, hidden=64, layers=8)
    ids = [[(7 * i + j) % 49152 for j in range(40 + 37 * i)] for i in range(12)]
    requests: list[dict[str, Any]] = [{"id": f"s{i}", "input_ids": s} for i, s in enumerate(ids)]
    with TestClient(create_app(settings)) as client:
        for _ in range(600):
            if client.get("/readyz").status_code == 200:
                break
            import time

            time.sleep(0.05)
        for codec in ("none", "zstd+planes"):
            resp = client.post("/v1/extract", json={"samples": requests, "codec": codec})
            decoder = FrameDecoder()
            assembler = StreamAssembler("test", requests, decoder)
            frames = decoder.feed(resp.content)  # raises on any seq gap
            decoder.close()
            assert sum(f.type == FrameType.DATA for f in frames) > 2 * len(ids)  # samples were split
            got = {s.sample_id: s for f in frames for s in assembler.handle(f) if isinstance(s, ExtractedSample)}
            assert sorted(got) == sorted(str(r["id"]) for r in requests)
            for i, s in enumerate(ids):
                want = reference.extract([s])[0].view(torch.int16).numpy().view("<u2")
                sample = got[f"s{i}"]
                assert isinstance(sample, ExtractedSample)
                assert (sample.hidden_states_bf16 == want).all()
