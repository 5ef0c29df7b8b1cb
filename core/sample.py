"""One extracted sample, as ``ExtractionClient.extract`` yields it and ``FeaturesReader`` returns it.

The hidden states stay in their wire/disk form (bf16 bit patterns, ``uint16 [n, L, H]``; for a
reader a memory map) until a float property is read, which widens exactly to float32. Layer ``l`` of
``L = len(aux_layer_ids) + 1`` is aux tap ``aux_layer_ids[l]`` for ``l < L - 1`` and the final
pre-norm state (decoder layer ``final_layer_id - 1``'s output) for ``l = L - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from eagle3.core.codec import bf16_to_float32

NDArray = np.ndarray[Any, Any]


@dataclass(frozen=True, eq=False)
class ExtractedSample:
    sample_id: str
    input_ids: NDArray  # int32 [n]
    loss_mask: NDArray  # uint8 [n], 1 = assistant token
    hidden_states_bf16: NDArray  # uint16 bf16 bits [n, L, H]
    aux_layer_ids: tuple[int, ...]
    final_layer_id: int

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """What each of the L stored layers is: the aux ids, then ``final_layer_id``."""
        return (*self.aux_layer_ids, self.final_layer_id)

    @property
    def hidden_states(self) -> NDArray:
        """float32 [n, L, H]: every stored layer, widened exactly from bf16 (a new array per access)."""
        return bf16_to_float32(np.asarray(self.hidden_states_bf16))

    @property
    def aux_hidden_states(self) -> NDArray:
        """float32 [n, len(aux), H]: the aux taps in ``aux_layer_ids`` order."""
        return bf16_to_float32(np.asarray(self.hidden_states_bf16[:, :-1]))

    @property
    def final_hidden_state(self) -> NDArray:
        """float32 [n, H]: the last decoder layer's output before the final norm."""
        return bf16_to_float32(np.asarray(self.hidden_states_bf16[:, -1]))

    def as_torch(self) -> Any:
        """``torch.bfloat16 [n, L, H]`` sharing memory with ``hidden_states_bf16`` (no copy, no widening;
        read-only when the array is, e.g. a ``FeaturesReader`` memory map: do not write to it)."""
        import warnings

        import torch

        bits = np.asarray(self.hidden_states_bf16)
        if not bits.flags.c_contiguous:
            bits = np.ascontiguousarray(bits)
        with warnings.catch_warnings():  # torch warns on non-writable arrays; the view is for reading
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)

    def as_bfloat16(self) -> NDArray:
        """numpy ``ml_dtypes.bfloat16 [n, L, H]`` sharing memory with ``hidden_states_bf16`` (no copy):
        real bf16 numbers in numpy, for code that has no torch (``.astype(np.float32)`` widens exactly)."""
        import ml_dtypes

        return np.asarray(self.hidden_states_bf16).view(ml_dtypes.bfloat16)

    def layer(self, layer_id: int) -> NDArray:
        """float32 [n, H] of one stored layer, by its id (an aux id or ``final_layer_id``)."""
        if layer_id not in self.layer_ids:
            raise KeyError(f"layer {layer_id} is not stored (stored: {list(self.layer_ids)})")
        return bf16_to_float32(np.asarray(self.hidden_states_bf16[:, self.layer_ids.index(layer_id)]))

    def __repr__(self) -> str:
        n, n_layers, hidden = self.hidden_states_bf16.shape
        return (
            f"ExtractedSample(id={self.sample_id!r}, n_tokens={n}, layers={list(self.layer_ids)}, "
            f"hidden_size={hidden}, assistant_tokens={int(np.asarray(self.loss_mask).sum())})"
        )
