"""One extracted sample, as ``ExtractionClient.extract`` yields it and ``FeaturesReader`` returns it.

The hidden states stay in their wire/disk form (bf16 bit patterns, ``uint16 [n, L, H]``; for a
reader a memory map) until a float property is read, which widens exactly to float32. FP8 samples
(the opt-in ``float8_e4m3fn`` feature format, ``core/fp8.py``) hold e4m3fn codes ``uint8 [n, L, H]`` in
``states`` and their per-token, per-layer scales in ``fp8_scales`` (float32 ``[n, L]``); their float
properties dequantize, and ``hidden_states_bf16`` rounds that to bf16 (a new array). Layer ``l`` of
``L = len(aux_layer_ids) + 1`` is aux tap ``aux_layer_ids[l]`` for ``l < L - 1`` and the final
pre-norm state (decoder layer ``final_layer_id - 1``'s output) for ``l = L - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from eagle3.core.codec import bf16_to_float32
from eagle3.core.fp8 import decode_e4m3_into, dequantize_states, float32_to_bf16_bits

NDArray = np.ndarray[Any, Any]


@dataclass(frozen=True, eq=False)
class ExtractedSample:
    sample_id: str
    input_ids: NDArray  # int32 [n]
    loss_mask: NDArray  # uint8 [n], 1 = assistant token
    states: NDArray  # uint16 bf16 bits [n, L, H]; FP8: uint8 e4m3fn codes [n, L, H]
    aux_layer_ids: tuple[int, ...]
    final_layer_id: int
    fp8_scales: NDArray | None = None  # FP8 only: float32 [n, L], the scale of each token's each layer

    @property
    def is_fp8(self) -> bool:
        return self.fp8_scales is not None

    @property
    def states_nbytes(self) -> int:
        """Bytes the states take as they are held (with the FP8 scales)."""
        scales = 0 if self.fp8_scales is None else int(self.fp8_scales.nbytes)
        return int(self.states.nbytes) + scales

    @property
    def hidden_states_bf16(self) -> NDArray:
        """uint16 bf16 bits [n, L, H]: the states themselves, or (FP8) their dequantized values rounded to bf16."""
        if self.fp8_scales is None:
            return self.states
        return float32_to_bf16_bits(self.states_float32())

    def states_float32(self, n_tokens: int | None = None) -> NDArray:
        """float32 [n, L, H] of the first ``n_tokens`` tokens (all by default): bf16 widened exactly, or FP8
        dequantized (a new array)."""
        return self._float32(slice(None, n_tokens), slice(None))

    def float32_into(self, aux_out: NDArray, final_out: NDArray) -> None:
        """Write the first ``n`` tokens' states as float32 into ``aux_out`` ``[n, L - 1, H]`` (the aux taps)
        and ``final_out`` ``[n, H]`` (the final state): bf16 widened, FP8 dequantized, in place."""
        n = aux_out.shape[0]
        states = np.asarray(self.states[:n])
        if self.fp8_scales is None:
            for out, bits in ((aux_out, states[:, :-1]), (final_out, states[:, -1])):
                wide = out.view(np.uint32)
                wide[...] = bits  # uint16 -> uint32
                wide <<= 16  # bf16 bits are the high half of float32's
            return
        scales = np.asarray(self.fp8_scales[:n])
        decode_e4m3_into(states[:, :-1], aux_out)
        aux_out *= scales[:, :-1, None]
        decode_e4m3_into(states[:, -1], final_out)
        final_out *= scales[:, -1, None]

    def _float32(self, tokens: slice, layers: slice | int) -> NDArray:
        if self.fp8_scales is None:
            return bf16_to_float32(np.asarray(self.states[tokens, layers]))
        return dequantize_states(np.asarray(self.states[tokens, layers]), np.asarray(self.fp8_scales[tokens, layers]))

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
        return self.states_float32()

    @property
    def aux_hidden_states(self) -> NDArray:
        """float32 [n, len(aux), H]: the aux taps in ``aux_layer_ids`` order."""
        return self._float32(slice(None), slice(None, -1))

    @property
    def final_hidden_state(self) -> NDArray:
        """float32 [n, H]: the last decoder layer's output before the final norm."""
        return self._float32(slice(None), -1)

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
        return self._float32(slice(None), self.layer_ids.index(layer_id))

    def __repr__(self) -> str:
        n, n_layers, hidden = self.states.shape
        return (
            f"ExtractedSample(id={self.sample_id!r}, n_tokens={n}, layers={list(self.layer_ids)}, "
            f"hidden_size={hidden}, {'fp8, ' if self.is_fp8 else ''}"
            f"assistant_tokens={int(np.asarray(self.loss_mask).sum())})"
        )
