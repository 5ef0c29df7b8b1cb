"""Fixtures for the GPU-host checks (``tests/gpu/run.sh``). Every test here is marked ``gpu`` and skips
where torch sees no CUDA device, so ``make test`` (``-m "not gpu"``) never runs them on CPU machines.

Models are made here or come from the embedded verifier (``eagle3.core.models``): a GPU host needs no hub
access either. ``EAGLE3_GPU_TP`` overrides the tensor-parallel size (default: the largest power of two
<= the visible GPUs, at most 8, that divides the model's attention and KV heads).
``EAGLE3_GPU_JSON`` names a JSONL file the tests append their figures to (default: stdout only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

TINY_HEADS = 8  # attention heads of the tiny Llama: TP 1, 2, 4, 8 all divide it
TINY_KV_HEADS = 8


def require_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: tests/gpu runs on a GPU host (tests/gpu/run.sh)")


def tp_size_for(n_heads: int, n_kv_heads: int) -> int:
    """``EAGLE3_GPU_TP`` if set, else the largest power of two <= min(GPUs, 8) dividing both head counts."""
    if os.environ.get("EAGLE3_GPU_TP"):
        return int(os.environ["EAGLE3_GPU_TP"])
    tp = 1
    while tp * 2 <= min(torch.cuda.device_count(), 8) and n_heads % (tp * 2) == 0 and n_kv_heads % (tp * 2) == 0:
        tp *= 2
    return tp


def report(record: dict[str, Any]) -> None:
    """One JSON line to stdout (run.sh passes ``-s``) and to ``EAGLE3_GPU_JSON`` when set."""
    line = json.dumps(record, sort_keys=True)
    print(line)
    path = os.environ.get("EAGLE3_GPU_JSON")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")


@pytest.fixture(scope="session")
def tiny_llama_gpu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random bf16 Llama (hidden 512, 8 heads of 64, 8 layers) with SmolLM2's tokenizer files."""
    require_cuda()
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir
    from tests.e2e.live_server import TOKENIZER_FILES

    root = tmp_path_factory.mktemp("tiny-llama-gpu")
    source = resolve_model_dir(DEFAULT_MODEL)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            (root / name).write_bytes((source / name).read_bytes())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(AutoTokenizer.from_pretrained(str(source))),
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_KV_HEADS,
        max_position_embeddings=2048,
    )
    model: Any = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(root)
    return root
