"""The state dtypes a backend loads its engine in and returns, by ``--dtype`` name (hf and vllm share it,
so neither backend imports the other)."""

from __future__ import annotations

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
