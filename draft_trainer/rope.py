"""The draft's rotary embedding: the one vLLM builds for ``LlamaForCausalLMEagle3`` from the exported config.

The export copies the verifier's rope settings (``rope_theta``, ``rope_scaling``) into the draft's
``config.json``; vLLM 0.32 reads them into ``rope_parameters`` and builds the draft's rotary embedding
with ``vllm.model_executor.layers.rotary_embedding.get_rope(head_dim, max_position_embeddings,
rope_parameters=...)`` (``LlamaAttention._init_rotary_emb``; neox style, the draft's own ``head_dim``,
never a verifier's ``qk_rope_head_dim``). Training must rotate by the same angles, so this module
computes what those classes compute, in the same float32 order:

* ``default``: ``inv_freq = 1 / theta ** (arange(0, d, 2) / d)``;
* ``linear``: positions divided by ``factor`` (``LinearScalingRotaryEmbedding``);
* ``llama3``: the wavelength-banded ``inv_freq`` of ``Llama3RotaryEmbedding``;
* ``dynamic`` (with ``factor``): ``DynamicNTKScalingRotaryEmbedding``'s fixed base, scaled by
  ``(factor * max_position / max_trained_positions - (factor - 1)) ** (d / (d - 2))`` (vLLM applies it
  at every position; ``max_trained_positions`` defaults to ``max_position``, i.e. the plain base);
* ``yarn``: ``YaRNScalingRotaryEmbedding``: interpolated and extrapolated ``inv_freq`` blended by the
  ramp between the ``beta_fast``/``beta_slow`` correction dims of ``original_max_position_embeddings``,
  and cos/sin multiplied by the attention factor (``attention_factor``, else
  ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else
  ``0.1 ln(factor) + 1``); q and k both carry it, so the logits are scaled by its square.

Any other type (``longrope``, ``ntk``, m-rope, a partial rotary factor, ...) is refused with
``RopeError`` when the draft is built: training it with another rope than vLLM's would ruin the draft
silently. ``TrainConfig.draft_rope = "default"`` is the way out: the draft is trained and exported
with the plain rope (no ``rope_scaling`` in its config), so vLLM builds that one.
tests/unit/test_draft_rope.py holds each type against vLLM's own ``get_rope``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from eagle3.draft_trainer.errors import ConfigError

SUPPORTED = ("default", "linear", "llama3", "dynamic", "yarn")


class RopeError(ConfigError):
    """The verifier's rope settings name a scaling the draft trainer does not reproduce."""


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The scaling's type (``rope_type``, or the legacy ``type`` key); ``default`` for none."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # [d/2]


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(base: float, dim: int, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = float(scaling["factor"])
    original = int(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as vLLM: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low), 0, 1)  # [d/2]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation_mask = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_mask) + (1.0 / pos_freqs) * extrapolation_mask
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is not None:
        factor_out = float(attention_factor)
    elif mscale and mscale_all_dim:
        factor_out = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    else:
        factor_out = float(_yarn_mscale(factor))
    return inv_freq, factor_out


def _llama3_inv_freq(base: float, dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = _base_inv_freq(base, dim)
    factor, low, high = float(scaling["factor"]), scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wave_len = 2 * math.pi / inv_freq
    smooth: Any = (original / wave_len - low) / (high - low) if low != high else 0
    return torch.where(
        wave_len < original / high,
        inv_freq,
        torch.where(wave_len > original / low, inv_freq / factor, (1 - smooth) * inv_freq / factor + smooth * inv_freq),
    )


class DraftRope(torch.nn.Module):
    """cos/sin [T, d] (Llama's rotate-half layout, already times the attention factor) at any positions.

    ``inv_freq`` is a non-persistent buffer: it follows the draft to its device, never into a checkpoint."""

    inv_freq: torch.Tensor  # [d/2] float32

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int) -> None:
        super().__init__()
        kind = rope_type(scaling)
        params = dict(scaling or {})
        if kind not in SUPPORTED:
            raise RopeError(
                f"the verifier's rope_scaling type {kind!r} is not one the draft trainer reproduces "
                f"(supported: {', '.join(SUPPORTED)}); vLLM would build that rope for the exported "
                "draft and a draft trained with another would be silently wrong. Pass --set draft_rope=default "
                "to train and export the draft with the plain rope instead (vLLM then builds that one too)"
            )
        partial = float(params.get("partial_rotary_factor", 1.0))
        if partial != 1.0 or "rope_dim" in params or "mrope_section" in params:
            raise RopeError(
                f"rope settings {params}: a partial or multimodal rotary embedding is not reproduced by "
                "the draft trainer (its draft rotates the whole head_dim); pass --set draft_rope=default to train "
                "and export the draft with the plain rope instead"
            )
        self.kind, self.position_divisor, self.attention_factor = kind, 1.0, 1.0
        base = float(theta)
        if kind == "linear":
            inv_freq, self.position_divisor = _base_inv_freq(base, head_dim), float(params["factor"])
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(base, head_dim, params)
        elif kind == "dynamic":
            if "factor" not in params:
                raise RopeError(f"dynamic rope scaling {params} without 'factor' is not reproduced (alpha-NTK)")
            factor = float(params["factor"])
            trained = params.get("max_trained_positions", max_position)
            scaled = base * ((factor * max_position / trained) - (factor - 1)) ** (head_dim / (head_dim - 2))
            inv_freq = _base_inv_freq(scaled, head_dim)
        elif kind == "yarn":
            inv_freq, self.attention_factor = _yarn_inv_freq(base, head_dim, params)
        else:
            inv_freq = _base_inv_freq(base, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` [T] int -> cos, sin [T, d] float32."""
        t = positions.float()
        if self.position_divisor != 1.0:
            t = t / self.position_divisor
        freqs = t[:, None] * self.inv_freq[None, :]  # [T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, d]
        if self.attention_factor != 1.0:
            return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return emb.cos(), emb.sin()
