"""The trainer's CUDA attention (compiled ``flex_attention`` with the sample-causal block mask and the chain
merged by log-sum-exp) equals the dense ``[nh, T, T]`` form it replaced, forward and gradients, on the GPU.

``tests/unit/test_ttt_attention.py`` checks the flex path's mask and merge eagerly on CPU, forward only
(flex has no CPU backward); this is the compiled kernel the trainer runs on a GPU, backward included.
Random packed batches of several samples with lengths that are not multiples of the 128-row block
(one of length 1), K = 1..7, fp32 with TF32 off, <= 1e-4 relative (the compiled kernel accumulates in
another order than the dense reference). Run by ``bench/device_check.sh`` and ``tests/gpu/run.sh``.
"""

from __future__ import annotations

import pytest
import torch

from eagle3.draft_trainer.ttt_attention import SampleLayout, dense_ttt_attention, ttt_attention
from tests.gpu.conftest import report

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: run on a GPU host (tests/gpu/run.sh)"),
]

NH, D = 8, 64
LENGTHS = [300, 1, 129, 517, 64, 250]  # 1,261 rows: blocks shared by samples, partial last block


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def test_compiled_flex_equals_dense_forward_and_gradients() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda")
    seg = torch.cat([torch.full((m,), sum(LENGTHS[:i])) for i, m in enumerate(LENGTHS)]).to(device)
    layout = SampleLayout.build(seg, NH)
    n = sum(LENGTHS)
    worst = {"forward": 0.0, "gradient": 0.0}
    for k in range(1, 8):
        g = torch.Generator(device=device).manual_seed(k)
        q = torch.randn(n, NH, D, generator=g, device=device).requires_grad_()
        keys = [torch.randn(n, NH, D, generator=g, device=device).requires_grad_() for _ in range(k)]
        values = [torch.randn(n, NH, D, generator=g, device=device).requires_grad_() for _ in range(k)]
        grad_out = torch.randn(n, NH, D, generator=g, device=device)
        ref = dense_ttt_attention(q, keys, values, seg)
        ref_grads = torch.autograd.grad((ref * grad_out).sum(), [q, *keys, *values])
        out = ttt_attention(q, keys, values, layout, "flex")
        grads = torch.autograd.grad((out * grad_out).sum(), [q, *keys, *values])
        worst["forward"] = max(worst["forward"], _rel(out, ref))
        assert _rel(out, ref) <= 1e-4, f"K={k} forward: {_rel(out, ref):.2e}"
        for i, (got, want) in enumerate(zip(grads, ref_grads, strict=True)):
            worst["gradient"] = max(worst["gradient"], _rel(got, want))
            assert _rel(got, want) <= 1e-4, f"K={k} gradient {i}: {_rel(got, want):.2e}"
    report({"check": "flex_vs_dense", "rows": n, "heads": NH, "head_dim": D, "k": "1..7",
            "max_rel_forward": worst["forward"], "max_rel_gradient": worst["gradient"]})  # fmt: skip
