"""TTT attention with memory linear in tokens: per-sample causal step-0 attention + the chain, by LSE.

The math (unchanged from the dense form kept here as ``dense_ttt_attention``, the tests' reference):
the step-``k`` query at packed row ``t`` attends to the step-0 keys of rows ``seg_start[t] .. t`` (its
own sample, causal) and to the step-``1..k`` keys of row ``t`` only (the draft's own chain), in one
softmax. Written as two parts merged by log-sum-exp::

    o0, lse0 = softmax-attention of q over the step-0 keys (sample-causal)   # [T, nh, d], [T, nh]
    s_j      = q . k_j * scale  for j = 1..k                                  # [T, nh, k] (row-wise)
    lse      = logsumexp(lse0, s_1..s_k)
    out      = exp(lse0 - lse) * o0 + sum_j exp(s_j - lse) * v_j

The chain part is elementwise (linear in T). The step-0 part never materialises ``[nh, T, T]``:

* ``flex``: PyTorch's ``flex_attention`` (compiled; the CUDA path) with a block mask built from the
  sample starts, so blocks of other samples and above the diagonal are skipped; it returns the LSE and
  takes its gradient.
* ``blockwise``: a flash-style ``autograd.Function`` (the CPU path, any device): query blocks of at most
  ``block_rows`` rows, each against its keys ``seg_start[first row] .. last row`` only; it saves the
  inputs, the output and the LSE and recomputes the block's probabilities in backward, so memory is
  ``O(T * nh * d)`` saved plus one block's ``[nh, block_rows, span]`` scratch (span <= the longest
  sample). A Python loop runs per query block, never per token or per sample.
* ``dense``: the old ``[nh, T, T]`` form (the reference, and ``bench/train.py --attention dense``).

Invariant: all three return the same values and gradients (fp32, tests/unit/test_ttt_attention.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

IMPLEMENTATIONS = ("auto", "blockwise", "flex", "dense")
SCRATCH_ELEMENTS = 1 << 24  # per-block score scratch of the blockwise path: nh * rows * span <= this
FLEX_BLOCK = 128  # flex_attention's sparse block; rows are padded to a multiple of it


@dataclass
class SampleLayout:
    """The packed batch's sample structure, computed once per batch and shared by the K steps.

    ``seg_start`` [T] int64 is nondecreasing (samples are contiguous); ``blocks`` are the blockwise
    path's query blocks ``(first row, end row, first key row)``."""

    seg_start: torch.Tensor  # [T] int64, first row of each row's sample
    n_heads: int
    blocks: list[tuple[int, int, int]] = field(default_factory=list)
    _flex_mask: Any = None  # BlockMask, built on first use

    @classmethod
    def build(cls, seg_start: torch.Tensor, n_heads: int, scratch_elements: int = SCRATCH_ELEMENTS) -> SampleLayout:
        starts = seg_start.tolist()
        limit = max(1, scratch_elements // n_heads)  # rows * span per block
        blocks, a, n = [], 0, len(starts)
        while a < n:
            lo = starts[a]
            back = a - lo  # keys before the block's first row
            rows = int((math.sqrt(back * back + 4 * limit) - back) / 2)  # rows * (rows + back) <= limit
            b = min(n, a + max(1, rows))
            blocks.append((a, b, lo))
            a = b
        return cls(seg_start, n_heads, blocks)


def dense_ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], seg_start: torch.Tensor
) -> torch.Tensor:
    """The pre-blockwise implementation, verbatim: q [T, nh, d], keys/values k+1 x [T, nh, d] -> [T, nh, d].

    Memory ``O(nh * T^2)`` per step, kept for backward: the reference, not for training at scale."""
    n = q.shape[0]
    rows = torch.arange(n, device=q.device)
    causal = (seg_start[:, None] == seg_start[None, :]) & (rows[None, :] <= rows[:, None])  # [T, T]
    k = len(keys) - 1
    scale = q.shape[-1] ** -0.5
    scores0 = torch.einsum("qhd,khd->hqk", q, keys[0]) * scale  # [nh, T, T]
    scores0 = scores0.masked_fill(~causal[None], float("-inf"))
    if k == 0:
        return torch.einsum("hqk,khd->qhd", scores0.softmax(-1), values[0])  # [T, nh, d]
    diag = torch.stack([(q * kj).sum(-1) for kj in keys[1:]], dim=-1) * scale  # [T, nh, k]
    probs = torch.cat([scores0, diag.permute(1, 0, 2)], dim=-1).softmax(-1)  # [nh, T, T+k]
    out = torch.einsum("hqk,khd->qhd", probs[..., :n], values[0])  # [T, nh, d]
    p_diag = probs[..., n:].permute(1, 0, 2)  # [T, nh, k]
    return out + sum(p_diag[..., j - 1, None] * values[j] for j in range(1, k + 1))


def _block_scores(
    q: torch.Tensor, k0: torch.Tensor, seg: torch.Tensor, a: int, b: int, lo: int, scale: float
) -> torch.Tensor:
    """[nh, b-a, b-lo] fp32 scores of query rows a..b over key rows lo..b, -inf where not visible."""
    s = torch.einsum("qhd,khd->hqk", q[a:b], k0[lo:b]).float() * scale
    keys = torch.arange(lo, b, device=q.device)  # [S]
    rows = torch.arange(a, b, device=q.device)  # [B]
    visible = (keys[None, :] >= seg[a:b, None]) & (keys[None, :] <= rows[:, None])  # [B, S]
    return s.masked_fill(~visible[None], float("-inf"))


class _BlockwiseStep0(torch.autograd.Function):
    """Sample-causal attention over the step-0 keys: (q, k0, v0) -> (out [T, nh, d], lse [T, nh] fp32)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, layout: SampleLayout) -> Any:
        scale = q.shape[-1] ** -0.5
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)  # [T, nh]
        with torch.autocast(q.device.type, enabled=False):
            for a, b, lo in layout.blocks:
                s = _block_scores(q, k0, layout.seg_start, a, b, lo, scale)  # [nh, B, S]
                block_lse = torch.logsumexp(s, -1)  # [nh, B]
                p = torch.exp(s - block_lse[..., None]).to(v0.dtype)
                out[a:b] = torch.einsum("hqk,khd->qhd", p, v0[lo:b])
                lse[a:b] = block_lse.T
        ctx.save_for_backward(q, k0, v0, out, lse)
        ctx.layout = layout
        return out, lse

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor | None, d_lse: torch.Tensor | None) -> Any:
        q, k0, v0, out, lse = ctx.saved_tensors
        layout: SampleLayout = ctx.layout
        scale = q.shape[-1] ** -0.5
        d_out = torch.zeros_like(out) if d_out is None else d_out
        # d lse / d s = p, so dS = p * (dP - D + d_lse) with D = rowsum(dO * O)
        delta = (d_out.float() * out.float()).sum(-1)  # [T, nh]
        if d_lse is not None:
            delta = delta - d_lse.float()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k0, dtype=torch.float32)
        dv = torch.zeros_like(v0, dtype=torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            for a, b, lo in layout.blocks:
                s = _block_scores(q, k0, layout.seg_start, a, b, lo, scale)  # [nh, B, S]
                p = torch.exp(s - lse[a:b].T[..., None])  # [nh, B, S] fp32
                go = d_out[a:b]  # [B, nh, d]
                dv[lo:b] += torch.einsum("hqk,qhd->khd", p.to(go.dtype), go).float()
                dp = torch.einsum("qhd,khd->hqk", go, v0[lo:b].to(go.dtype)).float()  # [nh, B, S]
                ds = p * (dp - delta[a:b].T[..., None]) * scale  # [nh, B, S]
                dq[a:b] = torch.einsum("hqk,khd->qhd", ds.to(k0.dtype), k0[lo:b]).float()
                dk[lo:b] += torch.einsum("hqk,qhd->khd", ds.to(q.dtype), q[a:b]).float()
        return dq.to(q.dtype), dk.to(k0.dtype), dv.to(v0.dtype), None


def sample_causal_block_mask(seg_start: torch.Tensor, padded: int) -> Any:
    """flex_attention's BlockMask for ``padded`` rows (a multiple of FLEX_BLOCK; rows past ``T`` are
    padding, each its own sample): key ``k`` visible to query ``q`` iff same sample and ``k <= q``.

    Built from block-level facts, never from a ``[T, T]`` mask (``create_block_mask`` evaluates one):
    samples are contiguous, so query block ``i`` and key block ``j <= i`` share a sample iff the sample
    of ``j``'s last row is the sample of ``i``'s first row, and every pair of ``j < i`` is visible iff
    ``j``'s first row and ``i``'s last row share a sample. Memory ``O((T / FLEX_BLOCK)^2)`` bytes."""
    from torch.nn.attention.flex_attention import BlockMask

    n, device = seg_start.shape[0], seg_start.device
    sample = torch.cat([seg_start, torch.arange(n, padded, device=device)])  # [Tp]

    def sample_causal(_b: Any, _h: Any, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        return (sample[qi] == sample[ki]) & (ki <= qi)

    first, last = sample[::FLEX_BLOCK], sample[FLEX_BLOCK - 1 :: FLEX_BLOCK]  # [nb] each
    nb = first.shape[0]
    lower = torch.ones(nb, nb, dtype=torch.bool, device=device).tril()  # [nb(q), nb(kv)]
    any_visible = lower & (last[None, :] == first[:, None])
    any_visible |= torch.eye(nb, dtype=torch.bool, device=device)
    full = lower & ~torch.eye(nb, dtype=torch.bool, device=device) & (first[None, :] == last[:, None])
    partial = any_visible & ~full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [nb, nb] -> counts, indices
        count = dense.sum(-1, dtype=torch.int32)[None, None]  # [1, 1, nb]
        index = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return count, index[None, None]  # [1, 1, nb, nb]

    return BlockMask.from_kv_blocks(
        *ordered(partial), *ordered(full), BLOCK_SIZE=FLEX_BLOCK, mask_mod=sample_causal, seq_lengths=(padded, padded)
    )


def _flex_step0(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, layout: SampleLayout) -> tuple[torch.Tensor, ...]:
    """The same via ``flex_attention`` (compiled on CUDA); rows padded to a multiple of FLEX_BLOCK."""
    from torch.nn.attention.flex_attention import AuxRequest

    n = q.shape[0]
    padded = -(-n // FLEX_BLOCK) * FLEX_BLOCK
    if layout._flex_mask is None:
        layout._flex_mask = sample_causal_block_mask(layout.seg_start, padded)

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [T, nh, d] -> [1, nh, Tp, d]
        return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, padded - n)).permute(1, 0, 2)[None]

    out, aux = _flex_kernel(q.device)(
        heads_first(q),
        heads_first(k0),
        heads_first(v0),
        block_mask=layout._flex_mask,
        scale=q.shape[-1] ** -0.5,
        return_aux=AuxRequest(lse=True),
    )
    return out[0].permute(1, 0, 2)[:n], aux.lse[0].T[:n].float()  # [T, nh, d], [T, nh]


_COMPILED: dict[str, Any] = {}


def _flex_kernel(device: torch.device) -> Any:
    """``flex_attention`` compiled on CUDA (the fused kernel). Elsewhere the eager one: PyTorch 2.13
    compiles it on CPU for inference without LSE only, and its eager form is a dense math fallback
    (correct, quadratic; used by the tests to check the block mask and the LSE merge on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention)
    return _COMPILED["flex"]


def resolve_implementation(name: str, device: torch.device) -> str:
    """ "auto" -> "flex" on CUDA, "blockwise" elsewhere; anything else is checked and returned."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {', '.join(IMPLEMENTATIONS)}, got {name!r}")
    if name == "auto":
        return "flex" if device.type == "cuda" else "blockwise"
    return name


class TTTAttention:
    """The training-time-test attention of one packed batch, as ``EagleDraft.step``'s ``attention``: call
    ``k`` (0-based) gets step ``k``'s q, k, v [T, nh, d], keeps its keys and values, and attends over
    steps ``0..k`` (``ttt_attention``). One object per batch; the K steps share its ``SampleLayout``."""

    def __init__(self, layout: SampleLayout, implementation: str) -> None:
        self.layout, self.implementation = layout, implementation
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    @classmethod
    def for_batch(cls, seg_start: torch.Tensor, n_heads: int, implementation: str = "auto") -> TTTAttention:
        """``implementation`` as ``resolve_implementation`` takes it (checked here, once per batch)."""
        return cls(SampleLayout.build(seg_start, n_heads), resolve_implementation(implementation, seg_start.device))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        return ttt_attention(q, self.keys, self.values, self.layout, self.implementation)  # [T, nh, d]


def ttt_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    layout: SampleLayout,
    implementation: str = "auto",
) -> torch.Tensor:
    """q [T, nh, d]; keys/values: step 0..k, each [T, nh, d] -> [T, nh, d] (see the module docstring)."""
    impl = resolve_implementation(implementation, q.device)
    if impl == "dense":
        return dense_ttt_attention(q, keys, values, layout.seg_start)
    step0 = _flex_step0 if impl == "flex" else _BlockwiseStep0.apply
    out0, lse0 = step0(q, keys[0], values[0], layout)  # [T, nh, d], [T, nh] fp32
    if len(keys) == 1:
        return out0
    scale = q.shape[-1] ** -0.5
    chain = torch.stack([(q * kj).sum(-1) for kj in keys[1:]], dim=-1).float() * scale  # [T, nh, k]
    lse = torch.logsumexp(torch.cat([lse0[..., None], chain], dim=-1), dim=-1)  # [T, nh]
    # fp32 weights times bf16 (or fp32) values: type promotion computes in fp32, and autograd keeps a
    # reference to the values, never an fp32 copy per (step, chain key) pair (K(K-1)/2 of them)
    out = torch.exp(lse0 - lse)[..., None] * out0  # [T, nh, d] fp32
    weights = torch.exp(chain - lse[..., None])  # [T, nh, k]
    for j in range(1, len(keys)):
        out = out + weights[..., j - 1, None] * values[j]
    return out.to(q.dtype)
