"""``eagle3 export --format speculators``: vLLM's own speculators reader (the code ``vllm serve DIR``
runs) takes the directory as an eagle3 speculator of the named verifier with k tokens, and rebuilds
the same draft layer config as the flat export (``norm_before_residual`` false, as this draft is)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.cli import main
from eagle3.draft_trainer.checkpoint import save_draft
from eagle3.draft_trainer.export import EAGLE3_KEYS, read_export, vllm_param_shapes
from eagle3.draft_trainer.model import EagleDraft, draft_config_from_target
from eagle3.draft_trainer.vocab import build_draft_vocab
from tests.unit.test_draft_export import SMOLLM2

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def test_vllm_reads_the_speculators_export(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("EAGLE3_REQUIRE_VLLM") == "1":
            pytest.fail("EAGLE3_REQUIRE_VLLM=1 but vllm is not importable")
        pytest.skip("vllm is not installed")
    from vllm.transformers_utils.config import maybe_override_with_speculators
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    draft = EagleDraft(draft_config_from_target(SMOLLM2, 32000, (2, 15, 27)))
    vocab, _ = build_draft_vocab(np.random.default_rng(0).integers(0, 5, size=49152), 32000)
    draft.set_vocab(torch.from_numpy(vocab.d2t), torch.from_numpy(vocab.t2d))
    save_draft(draft, tmp_path / "run" / "draft")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "flat")]) == 0
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "spec"), "--format", "speculators"]) == 1
    verifier = tmp_path / "verifier"  # its config.json gives the export the verifier's architectures
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({**SMOLLM2, "architectures": ["LlamaForCausalLM"]}))
    assert (
        main(
            [
                "export",
                str(tmp_path / "run"),
                "--out",
                str(tmp_path / "spec"),
                "--format",
                "speculators",
                "--verifier",
                str(verifier),
                "--num-speculative-tokens",
                "4",
            ]
        )
        == 0
    )

    model, tokenizer, speculative = maybe_override_with_speculators(str(tmp_path / "spec"), None, False)
    assert (model, tokenizer) == (str(verifier), str(verifier))
    assert speculative == {"method": "eagle3", "num_speculative_tokens": 4, "model": str(tmp_path / "spec")}

    spec_config = json.loads((tmp_path / "spec" / "config.json").read_text())
    layer = SpeculatorsConfig.extract_transformers_pre_trained_config(spec_config)
    flat, flat_tensors = read_export(tmp_path / "flat")
    assert layer["architectures"] == ["Eagle3LlamaForCausalLM"] and layer["norm_before_residual"] is False
    assert layer["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    for key, value in flat.items():
        if key not in EAGLE3_KEYS:
            assert layer[key] == value, key
    assert (layer["draft_vocab_size"], layer["target_hidden_size"]) == (32000, 576)
    _, spec_tensors = read_export(tmp_path / "spec")
    # the same tensors, the decoder layer under speculators' names (layers.0.*), which vLLM loads as they are
    renamed = {k.replace("layers.0.", "midlayer."): v for k, v in spec_tensors.items()}
    assert renamed.keys() == flat_tensors.keys()
    assert all(renamed[k].equal(flat_tensors[k]) for k in flat_tensors)
    assert vllm_param_shapes(spec_tensors) == vllm_param_shapes(flat_tensors)
