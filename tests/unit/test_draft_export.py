"""Export: keys, shapes and config of docs/architecture.md ("On disk", Export), held against vLLM's Eagle3
weight mapping."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.draft_trainer.checkpoint import save_draft
from eagle3.draft_trainer.errors import CheckpointError
from eagle3.draft_trainer.evaluate import load_export_draft
from eagle3.draft_trainer.export import check_export, export_draft, export_target_ids, read_export
from eagle3.draft_trainer.model import DraftConfig, EagleDraft, draft_config_from_target
from eagle3.draft_trainer.vocab import build_draft_vocab

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "vocab_size": 49152, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
           "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}  # fmt: skip


def _export(cfg: DraftConfig, tmp_path: Path, counts: np.ndarray | None = None) -> Path:
    model = EagleDraft(cfg)
    if counts is not None:
        vocab, _ = build_draft_vocab(counts, cfg.draft_vocab_size)
        model.set_vocab(torch.from_numpy(vocab.d2t), torch.from_numpy(vocab.t2d))
    save_draft(model, tmp_path / "run" / "draft")
    return export_draft(tmp_path / "run", tmp_path / "export")


def _contract(h: int, ht: int, nh: int, nkv: int, d: int, inter: int, vd: int, v: int) -> dict[str, tuple[int, ...]]:
    m = "midlayer."
    shapes = {
        "fc.weight": (h, 3 * ht),
        m + "input_layernorm.weight": (h,), m + "hidden_norm.weight": (h,), m + "post_attention_layernorm.weight": (h,),
        m + "self_attn.q_proj.weight": (nh * d, 2 * h), m + "self_attn.k_proj.weight": (nkv * d, 2 * h),
        m + "self_attn.v_proj.weight": (nkv * d, 2 * h), m + "self_attn.o_proj.weight": (h, nh * d),
        m + "mlp.gate_proj.weight": (inter, h), m + "mlp.up_proj.weight": (inter, h),
        m + "mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,), "lm_head.weight": (vd, h), "t2d": (v,),
    }  # fmt: skip
    if vd != v:
        shapes["d2t"] = (vd,)
    return shapes


def test_embedded_verifier_export_matches_contract(tmp_path: Path) -> None:
    cfg = draft_config_from_target(SMOLLM2, 32000, (2, 15, 27))
    rng = np.random.default_rng(0)
    out = _export(cfg, tmp_path, rng.integers(0, 5, size=49152))
    config, tensors = read_export(out)
    assert {k: tuple(t.shape) for k, t in tensors.items()} == _contract(576, 576, 9, 3, 64, 1536, 32000, 49152)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 32000 and config["vocab_size"] == 49152
    assert config["target_hidden_size"] == 576
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 15, 27], "use_aux_hidden_state": True}
    assert config["max_position_embeddings"] == 8192 and config["rope_theta"] == 100000.0
    mapped = check_export(out)
    assert mapped["model.layers.0.self_attn.qkv_proj.weight"] == ((9 + 2 * 3) * 64, 2 * 576)
    assert mapped["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 1536, 576)
    assert mapped["draft_id_to_target_id"] == (32000,)


def test_target_hidden_size_differs_from_draft(tmp_path: Path) -> None:
    cfg = DraftConfig(hidden_size=64, target_hidden_size=96, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, draft_vocab_size=50, target_vocab_size=120,
                      aux_layer_ids=(1, 3, 5))  # fmt: skip
    out = _export(cfg, tmp_path, np.arange(120))
    config, tensors = read_export(out)
    assert {k: tuple(t.shape) for k, t in tensors.items()} == _contract(64, 96, 4, 2, 16, 128, 50, 120)
    assert config["target_hidden_size"] == 96 and config["hidden_size"] == 64
    assert check_export(out)["model.fc.weight"] == (64, 3 * 96)


def test_d2t_round_trip(tmp_path: Path) -> None:
    counts = np.zeros(300, dtype=np.int64)
    counts[[7, 3, 250, 99, 100, 42]] = [5, 9, 1, 7, 7, 2]
    cfg = DraftConfig(hidden_size=32, target_hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=4, head_dim=8, draft_vocab_size=6, target_vocab_size=300,
                      aux_layer_ids=(0, 1, 2))  # fmt: skip
    out = _export(cfg, tmp_path, counts)
    _, tensors = read_export(out)
    target_ids = torch.arange(6) + tensors["d2t"]  # vLLM: target = draft + d2t[draft]
    assert target_ids.tolist() == [3, 7, 42, 99, 100, 250]  # the chosen ids, ascending
    assert tensors["t2d"].nonzero().squeeze(1).tolist() == target_ids.tolist()
    loaded = load_export_draft(out, torch.zeros(300, 32))
    assert loaded.target_ids.tolist() == target_ids.tolist()
    read_ids = export_target_ids(out)  # what eval's outside-vocab share reads
    assert read_ids is not None and read_ids.tolist() == target_ids.tolist()


def test_full_vocab_draft_ships_no_d2t(tmp_path: Path) -> None:
    cfg = DraftConfig(hidden_size=32, target_hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=4, head_dim=8, draft_vocab_size=40, target_vocab_size=40,
                      aux_layer_ids=(0, 1, 2))  # fmt: skip
    out = _export(cfg, tmp_path, np.ones(40, dtype=np.int64))
    _, tensors = read_export(out)
    assert "d2t" not in tensors  # vLLM 0.32 fails to load a full-vocab draft that ships d2t
    assert "draft_id_to_target_id" not in check_export(out)
    assert export_target_ids(out) is None  # every target id: nothing lies outside


def test_target_ids_of_a_checkpoint_that_names_d2t_as_vllm_does(tmp_path: Path) -> None:
    """A speculators-style checkpoint stores ``d2t`` under vLLM's name in its own file name."""
    from safetensors.torch import save_file

    tmp_path.mkdir(exist_ok=True)
    save_file({"draft_id_to_target_id": torch.tensor([0, 4, 8]), "fc.weight": torch.zeros(2, 2)},
              str(tmp_path / "model-00001-of-00001.safetensors"))  # fmt: skip
    read_ids = export_target_ids(tmp_path)
    assert read_ids is not None and read_ids.tolist() == [0, 5, 10]
    assert export_target_ids(tmp_path / "missing") is None


def test_check_export_catches_a_wrong_shape(tmp_path: Path) -> None:
    cfg = DraftConfig(hidden_size=32, target_hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, draft_vocab_size=10, target_vocab_size=40,
                      aux_layer_ids=(0, 1, 2))  # fmt: skip
    out = _export(cfg, tmp_path, np.arange(40))
    config = json.loads((out / "config.json").read_text())
    config["num_key_value_heads"] = 4  # the weights were made for 2
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="qkv_proj"):
        check_export(out)


def test_speculators_export_names_the_verifiers_architectures(tmp_path: Path) -> None:
    """From --verifier when it is local, else from the run's own verifier (a hub id for the serving host);
    refused, naming --verifier, when neither is a local checkpoint."""
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({**SMOLLM2, "architectures": ["LlamaForCausalLM"]}))
    save_draft(EagleDraft(draft_config_from_target(SMOLLM2, 64, (2, 15, 27))), tmp_path / "run" / "draft")
    with pytest.raises(CheckpointError, match="give --verifier as the verifier's local directory"):
        export_draft(tmp_path / "run", tmp_path / "a", format="speculators", verifier="HuggingFaceTB/not-local-xyz")
    out = export_draft(tmp_path / "run", tmp_path / "b", format="speculators", verifier=str(verifier))
    assert read_export(out)[0]["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    (tmp_path / "run" / "config.json").write_text(json.dumps({"model": str(verifier)}))  # the run's TrainConfig
    out = export_draft(tmp_path / "run", tmp_path / "c", format="speculators", verifier="HuggingFaceTB/not-local-xyz")
    config = read_export(out)[0]["speculators_config"]["verifier"]
    assert config == {"name_or_path": "HuggingFaceTB/not-local-xyz", "architectures": ["LlamaForCausalLM"]}
