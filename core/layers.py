"""Which verifier layers are tapped, and which module's output each layer id is (vLLM's semantics).

For ``N`` decoder layers, layer id ``k`` in ``[0, N)`` is the residual stream *entering* decoder
layer ``k`` (HF ``output_hidden_states[k]``): the embedding's output for ``k = 0``, decoder layer
``k - 1``'s output otherwise. Id ``N`` is the last decoder layer's output before the final norm (what
vLLM's EAGLE-3 drafter consumes). The server's hf backend and the trainer's speculative decoding both
hook ``tap_module(model, k)``, so the two cannot disagree. No torch import: it works on any module
with ``get_input_embeddings()`` and ``layers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def default_aux_layer_ids(num_hidden_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice: one low, one middle and one high layer, ``(2, N // 2, N - 3)`` (vLLM's and the
    public drafts' default). Where those repeat (``N <= 6``: ``[2, 3, 3]`` for 6) the distinct ids among
    ``(1, N // 2, N - 1)`` instead; never id 0 unless ``N == 1`` (vLLM's DeepSeek backbone cannot tap the
    embedding output, server/backends/family.py)."""
    n = num_hidden_layers
    if n < 1:
        raise ValueError(f"a model needs at least one decoder layer, not {n}")
    eagle3 = (2, n // 2, n - 3)
    if len(set(eagle3)) == 3 and min(eagle3) >= 1:
        return eagle3
    return tuple(sorted({i for i in (1, n // 2, n - 1) if 1 <= i < n} or {0}))


def check_aux_layer_ids(ids: Sequence[int], num_hidden_layers: int) -> tuple[int, ...]:
    out = tuple(int(i) for i in ids)
    if not out or any(not 0 <= i < num_hidden_layers for i in out):
        raise ValueError(f"aux layer ids {list(out)} must be non-empty and in [0, {num_hidden_layers})")
    if len(set(out)) != len(out):
        raise ValueError(f"aux layer ids {list(out)} repeat")
    return out


def tap_module(base_model: Any, layer_id: int) -> Any:
    """The module whose forward output is layer id ``layer_id`` of ``base_model`` (an HF base model such
    as ``LlamaModel``: ``get_input_embeddings()`` and ``layers``); ids as in the module docstring."""
    layers = base_model.layers
    if not 0 <= layer_id <= len(layers):
        raise ValueError(f"layer id {layer_id} outside [0, {len(layers)}]")
    return base_model.get_input_embeddings() if layer_id == 0 else layers[layer_id - 1]
