"""The vllm backend's NaN/inf check of every handed-over sample (``all_finite``: min and max in one
pass) flags a single bad value anywhere, in bf16 and fp32, like ``isfinite(x).all()``."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_vllm_backend import require_vllm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_bad_value_anywhere_is_found(dtype: torch.dtype, bad: float) -> None:
    require_vllm()
    from eagle3.server.backends.vllm import all_finite

    g = torch.Generator().manual_seed(0)
    states = (torch.randn(37, 4, 64, generator=g) * 1e4).to(dtype)  # [T, L, H]
    assert all_finite(states)
    for index in [(0, 0, 0), (36, 3, 63), (18, 2, 5)]:
        broken = states.clone()
        broken[index] = bad
        assert not all_finite(broken) and not bool(torch.isfinite(broken).all())
    assert all_finite(torch.empty(0, 4, 64, dtype=dtype))
