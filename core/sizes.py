"""Sizes an operator sees before paying for them: feature bytes per token and per 1k samples (on
``/v1/info`` and in ``eagle3 extract``'s preflight) and the verifier's KV cache per token (``serve``).

Features: every extracted token stores ``len(aux) + 1`` hidden states of ``hidden_size`` values in the
on-disk dtype, bf16 (Kimi-K2 / DeepSeek-V3: 4 taps x 7168 x 2 B = 56 KiB per token, 117 GB per 1,000 samples
of 2,048 tokens). KV cache: what vLLM holds per token of context for one sequence on one rank: MLA
keeps one latent of ``kv_lora_rank + qk_rope_head_dim`` values per layer, replicated on every rank
(DeepSeek-V3: 576 x 61 layers x 2 B = 68.6 KiB); other attention keeps K and V for its KV heads,
split across tensor-parallel ranks. Stdlib only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}  # FP8 features: + 4 B of scale per tap
SAMPLE_TOKENS, SAMPLES = 2048, 1000  # the reference dataset the per-1k figure is for
DISK_DTYPE = "bfloat16"  # what eagle3 extract stores, whatever the server's dtype (client/extract.py)
KIB, GIB = 1 << 10, 1 << 30


@dataclass(frozen=True)
class FeatureSizes:
    n_taps: int  # aux layers + the final layer
    hidden_size: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        return self.n_taps * self.hidden_size * self.dtype_bytes

    @property
    def bytes_per_1k_samples(self) -> int:
        """1,000 samples of 2,048 tokens."""
        return self.bytes_per_token * SAMPLE_TOKENS * SAMPLES

    def as_dict(self) -> dict[str, int]:
        """``/v1/info``'s ``feature_bytes``."""
        return {"per_token": self.bytes_per_token, "per_1k_samples_of_2k_tokens": self.bytes_per_1k_samples}

    def describe(self) -> str:
        return (
            f"{self.n_taps} taps x {self.hidden_size} x {self.dtype_bytes} B = "
            f"{self.bytes_per_token / KIB:,.1f} KiB/token, {self.bytes_per_1k_samples / 1e9:,.1f} GB per "
            f"1k samples of {SAMPLE_TOKENS} tokens"
        )


def feature_sizes(n_taps: int, hidden_size: int, dtype: str = DISK_DTYPE) -> FeatureSizes:
    return FeatureSizes(n_taps, hidden_size, DTYPE_BYTES.get(dtype, 4))


def preflight_line(sizes: FeatureSizes, n_samples: int, n_tokens: int) -> str:
    """``eagle3 extract``'s preflight: what the samples still to extract will take on disk (uncompressed)."""
    return (
        f"features: {sizes.describe()}; these {n_samples:,} samples ({n_tokens:,} tokens) take "
        f"{sizes.bytes_per_token * n_tokens / 1e9:,.2f} GB"
    )


def kv_bytes_per_token(text: Mapping[str, Any], dtype: str, tensor_parallel_size: int = 1) -> int | None:
    """KV cache bytes per token of context on one rank (module docstring); None where the attention
    shape is not one of the two computed here (sliding windows, hybrid layers, missing fields)."""
    n_layers = int(text.get("num_hidden_layers") or 0)
    if not n_layers or text.get("layer_types") or text.get("sliding_window") and text.get("use_sliding_window"):
        return None
    size = DTYPE_BYTES.get(dtype, 4)
    if text.get("kv_lora_rank"):
        return (int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim") or 0)) * n_layers * size
    heads = int(text.get("num_attention_heads") or 0)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or (int(text.get("hidden_size") or 0) // heads if heads else 0))
    if not kv_heads or not head_dim:
        return None
    return 2 * math.ceil(kv_heads / max(1, tensor_parallel_size)) * head_dim * n_layers * size


def kv_fit_error(
    text: Mapping[str, Any], dtype: str, tensor_parallel_size: int, max_model_len: int, kv_cache_bytes: int
) -> str | None:
    """None when one sequence of ``max_model_len`` tokens fits ``kv_cache_bytes`` (per rank), else what to
    pass instead: the longest context that fits, or the KV size the full context needs."""
    per_token = kv_bytes_per_token(text, dtype, tensor_parallel_size)
    if per_token is None or per_token * max_model_len <= kv_cache_bytes:
        return None
    fits = kv_cache_bytes // per_token
    need_gib = math.ceil(per_token * max_model_len / GIB * 10) / 10
    return (
        f"a {max_model_len:,}-token context needs {per_token * max_model_len / GIB:,.2f} GiB of KV cache per "
        f"sequence ({per_token / KIB:,.1f} KiB/token per rank), more than the {kv_cache_bytes / GIB:,.2f} GiB "
        f"given. Pass --max-model-len {fits:,} or less (a capture-only server needs only the longest sample "
        f"you extract: prepare's --max-length), or --kv-cache-gib {need_gib:g} or more"
    )
