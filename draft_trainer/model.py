"""The EAGLE-3 draft: one Llama decoder layer over cat(norm(embedding), norm(hidden)) of width 2H.

Parameter names equal the export names of docs/architecture.md ("On disk", Export) (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, buffers ``d2t``/``t2d``), so export is a dtype cast plus a config. The embedding is the
verifier's, frozen, and kept out of the state dict (vLLM shares the verifier's).

One draft step (vLLM ``LlamaForCausalLMEagle3`` semantics)::

    residual = hidden                                   # [T, H]  (fc(aux) on the first step)
    x = cat(input_layernorm(embed(token)), hidden_norm(hidden))            # [T, 2H]
    (norm_before_residual: residual = hidden_norm(hidden))
    h = o_proj(attn(q,k,v from x)) ;  h, residual = post_attention_layernorm(h + residual), h + residual
    out = mlp(h) + residual                              # prenorm: fed back as the next step's hidden
    logits = lm_head(norm(out))                          # [T, Vd] over the draft vocabulary
    (norm_output: norm(out) is fed back; norm_before_fc: fc(input_norm(aux)) on the first step)

The three "Eagle 3.1" norms are each a config key vLLM's ``LlamaForCausalLMEagle3`` and speculators read
(``DraftConfig``; off by default). Callers feed a step's output back through ``feedback``.

``EagleDraft.step`` is that order, written once: training (``ttt.ttt_forward``) and speculation
(``speculate.draft_step``) call it and differ only in the attention they pass (``StepAttention``). Its
rope is ``rope.DraftRope``, built from the verifier's rope settings as vLLM builds the draft's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional

from eagle3.draft_trainer.rope import DraftRope, rope_type

NORM_FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")  # DraftConfig's Eagle-3.1 keys


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int  # H of the draft (= the verifier's, so the embedding can be shared)
    target_hidden_size: int  # Ht of the verifier (fc takes 3*Ht)
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    draft_vocab_size: int
    target_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    # the "Eagle 3.1" norms (vLLM's and speculators' config keys of the same names; all off: EAGLE-3 as published)
    norm_before_fc: bool = False  # an RMSNorm [n_aux * Ht] on the concatenated taps before fc
    norm_before_residual: bool = False  # the residual is hidden_norm(hidden), not the raw hidden
    norm_output: bool = False  # the hidden fed back to the next step is norm(out), not the pre-norm out

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), aux_layer_ids=list(self.aux_layer_ids))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftConfig:
        return cls(**dict(data, aux_layer_ids=tuple(data["aux_layer_ids"])))


def draft_config_from_target(
    target: dict[str, Any],
    draft_vocab_size: int,
    aux_layer_ids: tuple[int, ...],
    rope: str = "verifier",
    norms: dict[str, bool] | None = None,
) -> DraftConfig:
    """A draft the size of one verifier layer, from the verifier's HF ``config.json`` dict. ``rope``:
    "verifier" (its rope scaling, which the export carries to vLLM) or "default" (the plain rope at the
    verifier's theta, trained and exported alike: TrainConfig.draft_rope). ``norms``: the Eagle-3.1 flags
    (``norm_before_fc``, ``norm_before_residual``, ``norm_output``) that are on."""
    params = target.get("rope_parameters") or {}
    theta = float(target.get("rope_theta") or params.get("rope_theta") or 10000.0)
    # the verifier's scaling (rope_type, or the legacy key type), copied whole: DraftRope and vLLM read the same dict
    scaling = target.get("rope_scaling") or (None if rope_type(params) == "default" else dict(params))
    if rope == "default":
        scaling = None
    heads = int(target["num_attention_heads"])
    hidden = int(target["hidden_size"])
    return DraftConfig(
        hidden_size=hidden,
        target_hidden_size=hidden,
        intermediate_size=int(target["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(target.get("num_key_value_heads") or heads),
        head_dim=int(target.get("head_dim") or hidden // heads),
        draft_vocab_size=draft_vocab_size,
        target_vocab_size=int(target["vocab_size"]),
        aux_layer_ids=tuple(aux_layer_ids),
        rms_norm_eps=float(target.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        max_position_embeddings=int(target.get("max_position_embeddings", 8192)),
        rope_scaling=scaling,
        **(norms or {}),
    )


class StepAttention(Protocol):
    """What a draft step attends with: this step's ``q``, ``k``, ``v`` [T, nh, d] (rope applied, kv heads
    repeated) -> [T, nh, d]. The callee keeps whatever keys it needs (the TTT steps' keys, a KV cache)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [T, heads, d]; cos/sin [T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [T, heads, d]
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        in_size = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(in_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x`` [T, 2H] -> q [T, heads, d], k/v [T, heads, d] (kv heads repeated for GQA), rope applied."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.n_heads, self.head_dim)  # [T, nh, d] (bf16 under CUDA autocast)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # rope in the projections' dtype, as transformers' Llama
        q = apply_rope(q, cos, sin)
        k = apply_rope(self.k_proj(x).view(t, self.n_kv, self.head_dim), cos, sin)  # [T, nkv, d]
        v = self.v_proj(x).view(t, self.n_kv, self.head_dim)  # [T, nkv, d]
        rep = self.n_heads // self.n_kv
        return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(functional.silu(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]


class MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)


class EagleDraft(nn.Module):
    """Parameters named as the export. ``embed_tokens`` is a frozen non-persistent buffer."""

    d2t: torch.Tensor  # [Vd] int64 offsets
    t2d: torch.Tensor  # [V] bool
    embed_tokens: torch.Tensor  # [V, H]

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        if cfg.norm_before_fc:  # vLLM's ``input_norm``: only there when the config asks for it
            self.input_norm = RMSNorm(3 * cfg.target_hidden_size, cfg.rms_norm_eps)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rope = DraftRope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.resid_dropout = nn.Dropout(0.0)  # the trainer sets p (TrainConfig.dropout); no weights, not exported
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.target_vocab_size, dtype=torch.bool))
        self.register_buffer(
            "embed_tokens", torch.zeros(cfg.target_vocab_size, cfg.hidden_size), persistent=False
        )  # [V, H]
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    @property
    def target_ids(self) -> torch.Tensor:
        """[Vd] int64: the target id of each draft id."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def project_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """``aux`` [T, 3*Ht] -> [T, H]: the first step's hidden input."""
        if self.cfg.norm_before_fc:
            aux = self.input_norm(aux)
        return self.fc(aux)  # type: ignore[no-any-return]

    def feedback(self, prenorm: torch.Tensor) -> torch.Tensor:
        """A step's pre-norm output [T, H] -> the next step's hidden input (post-norm under ``norm_output``)."""
        return self.norm(prenorm) if self.cfg.norm_output else prenorm

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output [T, nh*d] + residual [T, H] -> prenorm layer output [T, H]."""
        mid = self.midlayer
        # eval, speculation and p = 0: no dropout op at all (the same computation as without the key)
        drop = self.resid_dropout if self.training and self.resid_dropout.p > 0 else _unchanged
        h = drop(mid.self_attn.o_proj(attn_out)) + residual  # [T, H]
        return h + drop(mid.mlp(mid.post_attention_layernorm(h)))

    def step(
        self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attention: StepAttention
    ) -> torch.Tensor:
        """One draft step (the module docstring's order): token ids [T], hidden [T, H] (``fc(aux)`` on the
        first step, else the previous step's output), rope positions [T] -> the pre-norm output [T, H]."""
        cos, sin = self.rope(positions)  # [T, d] each
        mid = self.midlayer
        embeds = functional.embedding(token_ids, self.embed_tokens)  # [T, H]
        normed = mid.hidden_norm(hidden)  # [T, H]
        x = torch.cat([mid.input_layernorm(embeds), normed], dim=-1)  # [T, 2H]
        q, k, v = mid.self_attn.qkv(x, cos, sin)  # [T, nh, d]
        out = attention(q, k, v)  # [T, nh, d]
        return self.finish(out.reshape(out.shape[0], -1), normed if self.cfg.norm_before_residual else hidden)

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(prenorm))  # type: ignore[no-any-return]  # [T, Vd]


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [Tq, nh, d], k/v [Tk, nh, d], mask [Tq, Tk] bool (True = may attend) -> [Tq, nh, d]."""
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])  # [nh, Tq, Tk]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # [Tq, nh, d]
