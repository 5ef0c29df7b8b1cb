"""The draft's rope in training equals the rope vLLM builds for the exported draft, at every position up to
the verifier's context (issue 29's draft-RoPE trap).

The reference is vLLM's own: the export's ``config.json`` read by ``vllm.transformers_utils.config.get_config``
(as ``vllm serve`` reads a draft) and ``vllm.model_executor.layers.rotary_embedding.get_rope`` with the
arguments ``LlamaAttention`` passes. The trainer's side is captured where it is used: the cos/sin handed to
the draft's q/k projection in a training forward (``ttt_forward``) and in a speculative step
(``speculate.draft_step``), so a rope computed anywhere else would not pass.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3.draft_trainer.export import export_config
from eagle3.draft_trainer.model import EagleDraft, apply_rope, draft_config_from_target
from eagle3.draft_trainer.speculate import DraftCache, draft_step
from eagle3.draft_trainer.ttt import PackedBatch, Teacher, ttt_forward

pytest.importorskip("vllm")

H, HEADS, HEAD_DIM, V = 64, 4, 32, 96
KIMI_YARN = {
    "type": "yarn",
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _deepseek_target(rope_scaling: dict[str, Any], max_position: int) -> dict[str, Any]:
    """A tiny DeepSeek-V3 (Kimi-K2 shaped rope) config.json dict, as transformers writes it."""
    from transformers import DeepseekV3Config

    legacy: dict[str, Any] = {"rope_theta": 50000.0, "rope_scaling": dict(rope_scaling)}  # as Kimi-K2's config.json
    return DeepseekV3Config(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        num_hidden_layers=6,
        vocab_size=V,
        intermediate_size=128,
        max_position_embeddings=max_position,
        qk_rope_head_dim=HEAD_DIM,
        qk_nope_head_dim=32,
        v_head_dim=32,
        kv_lora_rank=64,
        q_lora_rank=32,
        **legacy,
    ).to_dict()


def _llama_target(rope_parameters: dict[str, Any], max_position: int) -> dict[str, Any]:
    return {
        "hidden_size": H,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
        "intermediate_size": 128,
        "vocab_size": V,
        "max_position_embeddings": max_position,
        "rope_parameters": {"rope_theta": 500000.0, **rope_parameters},
    }


# (target config, the context to check up to); Llama-3.1's llama3, Qwen3's YaRN (no mscale: attention
# factor 0.1 ln 4 + 1), linear and vLLM's dynamic NTK beside the Kimi-K2 / DeepSeek-V3 YaRN
TARGETS = {
    "kimi_k2_yarn": (_deepseek_target(KIMI_YARN, 131072), 131072),
    "deepseek_v3_yarn_mscale": (_deepseek_target({**KIMI_YARN, "factor": 40.0, "mscale": 0.707}, 163840), 163840),
    "qwen3_yarn": (
        _llama_target({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
        131072,
    ),
    "llama3": (
        _llama_target(
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            131072,
        ),
        131072,
    ),
    "linear": (_llama_target({"rope_type": "linear", "factor": 2.0}, 16384), 16384),
    "dynamic": (_llama_target({"rope_type": "dynamic", "factor": 2.0, "max_trained_positions": 4096}, 8192), 8192),
    # rope_parameters with only the legacy key "type" (old configs): still YaRN on both sides
    "legacy_type_yarn": (
        _llama_target({"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096}, 32768),
        32768,
    ),
    "default": (_llama_target({"rope_type": "default"}, 8192), 8192),
}


KINDS = {
    "kimi_k2_yarn": "yarn",
    "deepseek_v3_yarn_mscale": "yarn",
    "qwen3_yarn": "yarn",
    "llama3": "llama3",
    "linear": "linear",
    "dynamic": "dynamic",
    "legacy_type_yarn": "yarn",
    "default": "default",
}


def _labelled(label: str) -> Callable[[str], str]:
    return lambda message: f"{label}: {message}"


def _positions(context: int) -> torch.Tensor:
    """Every position below 300, then 200 spread up to the last one (context - 1)."""
    spread = torch.linspace(300, context - 1, 200).round().long()
    positions: torch.Tensor = torch.unique(
        torch.cat([torch.arange(300), spread, torch.tensor([1023, 4095, context - 1])])
    )
    return positions


def _vllm_rope(export_dir: Path) -> tuple[Any, int]:
    """vLLM's rotary embedding for the exported draft, as LlamaAttention builds it."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import get_config

    config = get_config(str(export_dir), trust_remote_code=False)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    with set_current_vllm_config(VllmConfig()):  # a CustomOp reads the current config when built
        rope = get_rope(
            head_dim,
            max_position=config.max_position_embeddings,
            is_neox_style=True,
            rope_parameters=getattr(config, "rope_parameters", None),
            dtype=torch.float32,
        )
    return rope, head_dim


def _draft(target: dict[str, Any]) -> EagleDraft:
    torch.manual_seed(0)
    draft = EagleDraft(draft_config_from_target(target, V, (1, 2, 3)))
    draft.embed_tokens.copy_(torch.randn(V, H))
    draft.set_vocab(torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool))
    draft.eval()
    return draft


class _CosSinRecorder:
    """Wraps the draft's q/k/v projection and keeps the cos/sin of every call."""

    def __init__(self, draft: EagleDraft) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        attn = draft.midlayer.self_attn
        inner = attn.qkv

        def qkv(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
            self.calls.append((cos.detach().clone(), sin.detach().clone()))
            return inner(x, cos, sin)

        attn.qkv = qkv  # type: ignore[method-assign]


def _training_cos_sin(draft: EagleDraft, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of a one-step training forward whose rows sit at ``positions``."""
    n = positions.shape[0]
    batch = PackedBatch(
        input_ids=torch.randint(0, V, (n,)),
        aux=torch.randn(n, 3 * H),
        final=torch.randn(n, H),
        loss_mask=torch.ones(n, dtype=torch.bool),
        positions=positions,
        seg_start=torch.zeros(n, dtype=torch.long),
        seg_end=torch.full((n,), n),
    )
    recorder = _CosSinRecorder(draft)
    with torch.no_grad():
        ttt_forward(draft, Teacher(torch.ones(H), torch.randn(V, H), 1e-5), batch, 1)
    return recorder.calls[0]


def _speculation_cos_sin(draft: EagleDraft, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of chained one-row speculative steps at ``positions``."""
    recorder = _CosSinRecorder(draft)
    cache = DraftCache(torch.zeros(0, HEADS, HEAD_DIM), torch.zeros(0, HEADS, HEAD_DIM))
    with torch.no_grad():
        for p in positions:
            draft_step(draft, cache, torch.tensor([p % V]), torch.randn(1, H), p)
    return torch.cat([c for c, _ in recorder.calls]), torch.cat([s for _, s in recorder.calls])


@pytest.mark.parametrize("name", list(TARGETS))
def test_training_rope_equals_vllms_draft_rope(name: str, tmp_path: Path) -> None:
    target, context = TARGETS[name]
    draft = _draft(target)
    assert draft.rope.kind == KINDS[name]  # the scaling reached the draft (a dropped one would also "match")
    (tmp_path / "config.json").write_text(json.dumps(export_config(draft)))
    rope, head_dim = _vllm_rope(tmp_path)
    assert head_dim == draft.cfg.head_dim == HEAD_DIM  # the draft's own head_dim, as vLLM's Llama layer takes it
    positions = _positions(context)
    want = rope.cos_sin_cache[positions]  # [n, d]: cos (d/2) then sin (d/2), the attention factor included
    want_cos = torch.cat([want[:, : head_dim // 2]] * 2, dim=-1)  # neox: both halves rotate by the same angle
    want_sin = torch.cat([want[:, head_dim // 2 :]] * 2, dim=-1)
    for where, (cos, sin) in {
        "training": _training_cos_sin(draft, positions),
        "speculation": _speculation_cos_sin(draft, positions[::7].tolist()),
    }.items():
        rows = positions if where == "training" else positions[::7]
        index = torch.searchsorted(positions, rows)
        torch.testing.assert_close(cos, want_cos[index], rtol=0, atol=0, msg=_labelled(f"{where} cos"))
        torch.testing.assert_close(sin, want_sin[index], rtol=0, atol=0, msg=_labelled(f"{where} sin"))

    # the rotation itself, with the attention factor (q and k both carry it), as vLLM applies it
    q = torch.randn(positions.shape[0], HEADS * HEAD_DIM)
    k = torch.randn(positions.shape[0], HEADS * HEAD_DIM)
    q_vllm, k_vllm = rope.forward_native(positions, q.clone(), k.clone())
    cos, sin = draft.rope(positions)
    q_ours = apply_rope(q.view(-1, HEADS, HEAD_DIM), cos, sin).reshape(q.shape)
    k_ours = apply_rope(k.view(-1, HEADS, HEAD_DIM), cos, sin).reshape(k.shape)
    torch.testing.assert_close(q_ours, q_vllm, rtol=0, atol=2e-5)
    torch.testing.assert_close(k_ours, k_vllm, rtol=0, atol=2e-5)


def test_yarn_attention_factor_is_vllms() -> None:
    """Qwen3's YaRN without mscale keys scales cos/sin by 0.1 ln(factor) + 1 (the logits by its square);
    with mscale == mscale_all_dim (Kimi-K2) the factor is 1."""
    qwen = _draft(TARGETS["qwen3_yarn"][0])
    cos, sin = qwen.rope(torch.tensor([0]))
    assert float(cos[0, 0]) == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
    assert float(sin[0, 0]) == 0.0
    kimi = _draft(TARGETS["kimi_k2_yarn"][0])
    assert float(kimi.rope(torch.tensor([0]))[0][0, 0]) == 1.0


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 16,
            "long_factor": [2.0] * 16,
            "original_max_position_embeddings": 4096,
        },
        {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
    ],
)
def test_unreproduced_rope_is_refused_when_the_draft_is_built(rope_parameters: dict[str, Any]) -> None:
    from eagle3.draft_trainer.rope import RopeError

    with pytest.raises(RopeError, match=r"(not reproduced|not one the draft trainer reproduces).*draft_rope=default"):
        _draft(_llama_target(rope_parameters, 8192))


def test_draft_rope_default_trains_and_exports_the_plain_rope(tmp_path: Path) -> None:
    """The way out for such a verifier (TrainConfig.draft_rope = "default"): no scaling in the draft's config,
    and vLLM builds the same plain rope the trainer uses."""
    target = _llama_target(
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 16,
            "long_factor": [2.0] * 16,
            "original_max_position_embeddings": 4096,
        },
        8192,
    )
    torch.manual_seed(0)
    draft = EagleDraft(draft_config_from_target(target, V, (1, 2, 3), rope="default"))
    draft.embed_tokens.copy_(torch.randn(V, H))
    draft.set_vocab(torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool))
    config = export_config(draft)
    assert config["rope_scaling"] is None and config["rope_theta"] == 500000.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    rope, head_dim = _vllm_rope(tmp_path)
    positions = _positions(8192)
    cos, sin = _training_cos_sin(draft, positions)
    want = rope.cos_sin_cache[positions]
    torch.testing.assert_close(cos, torch.cat([want[:, : head_dim // 2]] * 2, dim=-1), rtol=0, atol=0)
    torch.testing.assert_close(sin, torch.cat([want[:, head_dim // 2 :]] * 2, dim=-1), rtol=0, atol=0)
