"""``eagle3 export --format speculators`` loads in speculators' own API (issue 30 item 1).

``speculators.SpeculatorModel.from_pretrained`` (speculators 0.9.0, PyPI) reads the export: the config
validates (the verifier's ``architectures``, ``speculators_version``), the model is speculators'
``Eagle3DraftModel``, no exported tensor is unexpected, no draft tensor is missing, and every tensor it
loaded equals the exported one (a decoder layer under the wrong names would be silently initialised
fresh by transformers, so equality is the check, not the absence of an exception).

speculators is not in the dev extra (its unpinned torchvision/torchaudio pull another torch): the test
skips where it is not importable, and runs in a venv that has it (docs/training.md, "Exports").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3.draft_trainer.checkpoint import save_draft
from eagle3.draft_trainer.export import SPECULATORS_VERSION, export_draft, read_export
from eagle3.draft_trainer.model import EagleDraft, draft_config_from_target

pytestmark = pytest.mark.integration

VERIFIER: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 6,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
DRAFT_VOCAB = 128


def _trained_draft(tmp_path: Path) -> tuple[EagleDraft, Path]:
    """A draft with every tensor distinct from any initialisation, saved as a run's draft/."""
    torch.manual_seed(0)
    draft = EagleDraft(draft_config_from_target(VERIFIER, DRAFT_VOCAB, (1, 3, 4)))
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p))
    ids = torch.randperm(VERIFIER["vocab_size"])[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VERIFIER["vocab_size"], dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(DRAFT_VOCAB), t2d)
    save_draft(draft, tmp_path / "run" / "draft")
    return draft, tmp_path / "run"


def test_speculators_loads_the_export_with_its_own_api(tmp_path: Path) -> None:
    speculators = pytest.importorskip("speculators")
    from transformers import LlamaConfig, LlamaForCausalLM

    verifier = tmp_path / "verifier"  # a tiny real verifier: speculators loads its embedding and lm_head
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(**VERIFIER)).save_pretrained(verifier)
    draft, run = _trained_draft(tmp_path)
    out = export_draft(run, tmp_path / "spec", format="speculators", verifier=str(verifier), num_speculative_tokens=4)
    config, exported = read_export(out)
    assert config["speculators_version"] == SPECULATORS_VERSION
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": str(verifier),
        "architectures": ["LlamaForCausalLM"],
    }
    assert not any(name.startswith("midlayer.") for name in exported)

    # (its Eagle3DraftModel.from_pretrained takes no output_loading_info: the name sets below are the check)
    model = speculators.SpeculatorModel.from_pretrained(str(out))
    assert type(model).__name__ == "Eagle3DraftModel"
    loaded = model.state_dict()
    assert not set(exported) - set(loaded), (
        f"exported tensors speculators has no place for: {set(exported) - set(loaded)}"
    )
    assert list(model.config.eagle_aux_hidden_state_layer_ids) == [1, 3, 4]
    assert model.config.draft_vocab_size == DRAFT_VOCAB and model.config.norm_before_residual is False
    assert model.config.speculators_config.verifier.architectures == ["LlamaForCausalLM"]
    # every tensor the export holds equals what speculators loaded ...
    for name, tensor in exported.items():
        assert torch.equal(loaded[name].to(tensor.dtype), tensor), name
    # ... and those are the trained draft's (bf16), so no layer was initialised fresh under another name
    ours = {
        ("layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k: v
        for k, v in draft.state_dict().items()
    }
    for name in (
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.hidden_norm.weight",
        "layers.0.mlp.down_proj.weight",
        "d2t",
        "t2d",
    ):
        want = ours[name].to(torch.bfloat16) if ours[name].is_floating_point() else ours[name]
        assert torch.equal(loaded[name].to(want.dtype), want), name
    from safetensors.torch import load_file

    model.load_verifier_weights()  # speculators' own attach, from the verifier the config names
    loaded = model.state_dict()
    verifier_tensors = load_file(str(verifier / "model.safetensors"))
    # (its embedding is loaded only where NaN, which speculators' uninitialised memory need not be: not checked)
    torch.testing.assert_close(loaded["verifier_norm.weight"].float(), verifier_tensors["model.norm.weight"].float())
    picked = verifier_tensors["lm_head.weight"][draft.t2d]  # the export's t2d picks the draft rows of the verifier head
    torch.testing.assert_close(
        loaded["verifier_lm_head.weight"].float(), picked.to(loaded["verifier_lm_head.weight"].dtype).float()
    )
    draft_tensors = {k for k in loaded if not k.startswith(("embed_tokens.", "verifier_"))}
    assert draft_tensors == set(exported), draft_tensors ^ set(exported)
