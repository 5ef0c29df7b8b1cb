"""The draft owns its step (issue 28 item 4): ``EagleDraft.step`` is vLLM's LlamaForCausalLMEagle3 order,
written once; training and speculation differ only by the attention they pass, and the rope lives in it."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional

from eagle3.draft_trainer.model import DraftConfig, EagleDraft, apply_rope
from eagle3.draft_trainer.rope import DraftRope
from eagle3.draft_trainer.speculate import DraftCache, draft_step
from eagle3.draft_trainer.ttt import PackedBatch, Teacher, ttt_forward

H, V, HEADS, KV, D = 32, 50, 4, 2, 8


def _draft() -> EagleDraft:
    torch.manual_seed(0)
    cfg = DraftConfig(
        hidden_size=H,
        target_hidden_size=H,
        intermediate_size=64,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=D,
        draft_vocab_size=V,
        target_vocab_size=V,
        aux_layer_ids=(1, 2, 3),
    )
    draft = EagleDraft(cfg)
    draft.set_vocab(torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool))
    draft.embed_tokens.copy_(torch.randn(V, H))
    for norm in (draft.midlayer.input_layernorm, draft.midlayer.hidden_norm, draft.midlayer.post_attention_layernorm):
        norm.weight.data.uniform_(0.5, 1.5)  # not ones: a swapped norm would show
    return draft.eval()


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class SelfOnly:
    """An attention that is neither training's nor the KV cache's: each row sees only itself (output = v)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        assert q.shape == k.shape == v.shape == (q.shape[0], HEADS, D)  # kv heads already repeated
        return v


def test_step_is_vllms_order_with_any_attention() -> None:
    """A hand-written vLLM Eagle3 layer (norms, concat, qkv + rope, o_proj + residual, post-norm, MLP +
    residual) equals ``step`` with an attention passed in."""
    draft = _draft()
    mid = draft.midlayer
    tokens, hidden, positions = torch.randint(0, V, (7,)), torch.randn(7, H), torch.arange(100, 107)
    attention = SelfOnly()
    with torch.no_grad():
        got = draft.step(tokens, hidden, positions, attention)
        x = torch.cat(
            [_rms(draft.embed_tokens[tokens], mid.input_layernorm.weight), _rms(hidden, mid.hidden_norm.weight)], dim=-1
        )
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
        angles = positions.float()[:, None] * inv_freq
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        v = (x @ mid.self_attn.v_proj.weight.T).view(7, KV, D).repeat_interleave(HEADS // KV, dim=1)
        h = v.reshape(7, -1) @ mid.self_attn.o_proj.weight.T + hidden
        normed = _rms(h, mid.post_attention_layernorm.weight)
        mlp = mid.mlp
        want = (
            h
            + (functional.silu(normed @ mlp.gate_proj.weight.T) * (normed @ mlp.up_proj.weight.T))
            @ mlp.down_proj.weight.T
        )
    assert attention.calls == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and q/k were rotated by the draft's rope at those positions (v is not)
    q = (x @ mid.self_attn.q_proj.weight.T).view(7, HEADS, D)
    q_step, _, _ = mid.self_attn.qkv(x, *draft.rope(positions))
    torch.testing.assert_close(q_step, apply_rope(q, cos, sin), rtol=1e-5, atol=1e-5)


def test_training_and_speculation_run_the_drafts_step_and_rope() -> None:
    """ttt_forward makes K calls of ``step``, draft_step one; swapping the draft's rope (one edit) moves both,
    and the training unroll still equals the chained speculative steps with the new rope."""
    draft = _draft()
    with torch.no_grad():  # sharp attention, so the rope's angles matter
        draft.midlayer.self_attn.q_proj.weight.mul_(30)
        draft.midlayer.self_attn.k_proj.weight.mul_(30)
    calls: list[str] = []
    outputs: list[torch.Tensor] = []
    inner = draft.step

    def counted(*args: Any) -> torch.Tensor:
        calls.append(type(args[3]).__name__)
        outputs.append(inner(*args))
        return outputs[-1]

    draft.step = counted  # type: ignore[method-assign,assignment]
    n, k_steps = 10, 3
    g = torch.Generator().manual_seed(1)
    batch = PackedBatch(
        input_ids=torch.randint(0, V, (n,), generator=g),
        aux=torch.randn(n, 3 * H, generator=g),
        final=torch.randn(n, H, generator=g),
        loss_mask=torch.ones(n, dtype=torch.bool),
        positions=torch.arange(n),
        seg_start=torch.zeros(n, dtype=torch.long),
        seg_end=torch.full((n,), n),
    )
    teacher = Teacher(torch.ones(H), torch.randn(V, H, generator=g), 1e-5)

    def unroll_and_chain() -> tuple[torch.Tensor, torch.Tensor]:
        """Step-(K-1) pre-norm at row t: by the training unroll (its K-th step call), and by chained
        speculative steps (the last call)."""
        t = 5
        with torch.no_grad():
            ttt_forward(draft, teacher, batch, k_steps)
            trained = outputs[-1][t]
            hidden = draft.project_aux(batch.aux)
            cache = DraftCache(torch.zeros(0, HEADS, D), torch.zeros(0, HEADS, D))
            pre = draft_step(draft, cache, batch.input_ids[1 : t + 2], hidden[: t + 1], 0)[-1:]
            for j in range(1, k_steps):
                pre = draft_step(draft, cache, batch.input_ids[t + j + 1 : t + j + 2], pre, t + j)
        return trained, pre[0]

    trained, chained = unroll_and_chain()
    assert calls == ["TTTAttention"] * k_steps + ["DraftCache"] * k_steps
    torch.testing.assert_close(trained, chained, rtol=1e-4, atol=1e-5)

    draft.rope = DraftRope(D, 77.0, {"rope_type": "linear", "factor": 3.0}, 8192)  # the one edit
    trained_new, chained_new = unroll_and_chain()
    torch.testing.assert_close(trained_new, chained_new, rtol=1e-4, atol=1e-5)
    assert (trained_new - trained).abs().max() > 1e-2  # both paths moved with the rope
