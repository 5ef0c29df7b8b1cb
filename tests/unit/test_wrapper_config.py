"""Kimi-K2.5's shape without its weights: the DeepSeek text backbone wrapped in a multimodal config
(``text_config``) whose class is the checkpoint's own code, loaded with ``trust_remote_code``. eagle3 reads
layers, sizes and the family's keys from the text part (core/identity.model_config,
server/backends/identity.open_checkpoint), so the first real run is not the first run of that code.
The custom tokenizer class through ``trust_remote_code``: tests/unit/test_tokenizer_probe.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.core.identity import model_config
from eagle3.server.backends import BackendConfig, BackendError
from eagle3.server.backends.identity import backend_info, open_checkpoint
from eagle3.server.backends.vllm_family import check_vllm_target
from tests.family_models import DEEPSEEK_ROUTING, deepseek_v3_config

CONFIG_CODE = '''
from transformers import DeepseekV3Config, PretrainedConfig


class KimiStandInConfig(PretrainedConfig):
    """A multimodal wrapper: the language model's settings under text_config (Kimi-K2.5's layout)."""

    model_type = "kimi_standin"
    sub_configs = {"text_config": DeepseekV3Config}

    def __init__(self, text_config=None, vision_config=None, **kwargs):
        if isinstance(text_config, dict):
            text_config = DeepseekV3Config(**text_config)
        self.text_config = text_config if text_config is not None else DeepseekV3Config()
        self.vision_config = vision_config or {"hidden_size": 64}
        super().__init__(**kwargs)
'''


def wrapper_dir(root: Path, routing_keys: bool = True) -> Path:
    root.mkdir()
    (root / "configuration_standin.py").write_text(CONFIG_CODE)
    text = deepseek_v3_config().to_dict()
    if routing_keys:
        text.update(DEEPSEEK_ROUTING)
    config = {"model_type": "kimi_standin", "architectures": ["KimiStandInForConditionalGeneration"],
              "auto_map": {"AutoConfig": "configuration_standin.KimiStandInConfig"}, "text_config": text,
              "vision_config": {"hidden_size": 64}}  # fmt: skip
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_a_wrapper_config_loads_through_trust_remote_code_and_reads_its_text_part(tmp_path: Path) -> None:
    model_dir = wrapper_dir(tmp_path / "kimi-standin")
    with pytest.raises(Exception, match="trust_remote_code"):  # transformers' own refusal, not ours
        open_checkpoint(BackendConfig(model=str(model_dir)), lambda _p, _f: None)
    config = BackendConfig(model=str(model_dir), trust_remote_code=True, dtype="bfloat16")
    ckpt = open_checkpoint(config, lambda _p, _f: None)
    assert type(ckpt.hf_config).__name__ == "KimiStandInConfig"
    assert (ckpt.num_hidden_layers, ckpt.aux_layer_ids, ckpt.max_model_len) == (6, (1, 3, 5), 8192)
    info = backend_info(ckpt, config, "vllm", "cpu")
    assert (info.hidden_size, info.vocab_size, info.final_layer_id) == (256, 512, 6)
    assert model_config(model_dir)["kv_lora_rank"] == 512
    check_vllm_target(ckpt)  # the routing keys are where vLLM reads them: the text config


def test_the_family_checks_see_through_the_wrapper(tmp_path: Path) -> None:
    model_dir = wrapper_dir(tmp_path / "kimi-standin", routing_keys=False)
    ckpt = open_checkpoint(BackendConfig(model=str(model_dir), trust_remote_code=True), lambda _p, _f: None)
    with pytest.raises(BackendError, match="text_config for a wrapper"):
        check_vllm_target(ckpt)
    model_dir = wrapper_dir(tmp_path / "kimi-standin-2")
    config = BackendConfig(model=str(model_dir), trust_remote_code=True, aux_layer_ids=(0, 3))
    with pytest.raises(BackendError, match="aux layer id 0"):
        check_vllm_target(open_checkpoint(config, lambda _p, _f: None))
