"""``--model dummy:<shape>``: a real architecture of a named shape with random weights (hf backend).

Like vLLM's ``--load-format dummy``: a GPU benchmark of an 8B-shaped verifier needs no checkpoint.
The weights are allocated and initialised directly on the target device (``torch.device`` context),
so no CPU copy of the model is ever made; the init is seeded, so two servers of the same shape and
seed compute the same states. The tokenizer (vocab size, chat template, ``tokenizer_sha256``) is
the embedded SmolLM2's, so ``eagle3 prepare`` with the default model makes datasets it accepts.

Shapes (``DUMMY_SHAPES``): the bodies of Llama-3.1-8B and Llama-3.2-1B, and ``tiny`` for CPU tests.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from eagle3.core.models import ModelNotFoundError

DUMMY_PREFIX = "dummy:"


@dataclass(frozen=True)
class DummyShape:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 131072
    rope_theta: float = 500000.0


DUMMY_SHAPES = {
    "llama-3.1-8b": DummyShape(4096, 32, 14336, 32, 8),
    "llama-3.2-1b": DummyShape(2048, 16, 8192, 32, 8),
    "tiny": DummyShape(64, 8, 128, 4, 2, max_position_embeddings=4096, rope_theta=10000.0),
}


def is_dummy(model: str) -> bool:
    return model.startswith(DUMMY_PREFIX)


def dummy_shape(model: str) -> tuple[str, DummyShape]:
    name = model[len(DUMMY_PREFIX) :].strip().lower()
    if name not in DUMMY_SHAPES:
        raise ModelNotFoundError(
            f"--model {model!r}: unknown dummy shape {name!r} (choose one of {sorted(DUMMY_SHAPES)})"
        )
    return name, DUMMY_SHAPES[name]


def dummy_config(model: str, vocab_size: int) -> Any:
    """A ``LlamaConfig`` of the named shape with ``vocab_size`` embedding rows."""
    from transformers import LlamaConfig

    _, shape = dummy_shape(model)
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=False,
    )


def build_dummy_model(model: str, vocab_size: int, dtype: Any, device: str, seed: int = 0) -> tuple[Any, Any]:
    """``(LlamaModel, config)`` with seeded random weights, allocated on ``device`` in ``dtype``."""
    import torch
    from transformers import LlamaModel

    config = dummy_config(model, vocab_size)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            body = LlamaModel(config)
    finally:
        torch.set_default_dtype(previous)
    return body, config


def dummy_revision(model: str, vocab_size: int, seed: int = 0) -> str:
    name, shape = dummy_shape(model)
    text = json.dumps({"dummy": name, "shape": shape.__dict__, "vocab_size": vocab_size, "seed": seed}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()
