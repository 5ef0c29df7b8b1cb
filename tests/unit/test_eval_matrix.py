"""``eagle3 eval --prompt-set mt-bench --prompt-set heldout -k 3,5,7`` (issue 32): one baseline engine per
prompt set, one speculative engine per k, τ from vLLM's counters per cell, the matrix printed; MT-Bench's
80 first turns rendered with the verifier's chat template. The engines are faked at ``run_engine`` (the
real-engine path is tests/integration/test_vllm_speculative.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eagle3.cli import main
from eagle3.core.prompt_sets import mt_bench_first_turns, render_user_prompt


def _fake_vllm(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int | None, int]]:
    """Engines that copy the prompt's first token; the draft accepts k // 2 tokens per draft. Returns the
    (k or None for the baseline, number of prompts) of every engine run."""
    from eagle3.draft_trainer import evaluate_vllm

    runs: list[tuple[int | None, int]] = []

    def run_engine(llm: dict[str, Any], prompt_ids: list[list[int]], *_a: object, **_k: object) -> Any:
        spec = llm.get("speculative_config")
        k = spec["num_speculative_tokens"] if spec else None
        runs.append((k, len(prompt_ids)))
        tokens = tuple((p[0], p[0]) for p in prompt_ids)
        counters: dict[str, Any] = {}
        if k is not None:
            drafts = 10 * len(prompt_ids)
            per_pos = [drafts if i < k // 2 else 0 for i in range(k)]
            counters = {
                evaluate_vllm.METRIC_DRAFTS: drafts,
                evaluate_vllm.METRIC_DRAFT_TOKENS: drafts * k,
                evaluate_vllm.METRIC_ACCEPTED: sum(per_pos),
                evaluate_vllm.METRIC_ACCEPTED_PER_POS: per_pos,
            }
        return evaluate_vllm.EngineRun(1.0, 1.0, 2 * len(prompt_ids), tokens, counters)

    monkeypatch.setattr(evaluate_vllm, "check_export_dir", lambda _p: None)
    monkeypatch.setattr(evaluate_vllm, "check_eval_engine_args", lambda _a: None)
    monkeypatch.setattr(evaluate_vllm, "run_engine", run_engine)
    return runs


def test_mt_bench_and_heldout_at_three_ks_in_one_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], smollm2_tokenizer: Any
) -> None:
    from eagle3.draft_trainer import evaluate

    runs = _fake_vllm(monkeypatch)
    heldout = [[1, 2, 3], [4, 5]]
    monkeypatch.setattr(evaluate, "heldout_prompts", lambda *_a, **_k: heldout)
    args = ["eval", str(tmp_path / "export"), "--model", "SmolLM2-135M-Instruct", "--engine", "vllm", "-k", "3,5,7",
            "--prompt-set", "mt-bench", "--prompt-set", "heldout", "--prepared", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    # one baseline per set, then one engine per k
    assert runs == [(None, 80), (3, 80), (5, 80), (7, 80), (None, 2), (3, 2), (5, 2), (7, 2)]
    out = capsys.readouterr().out
    assert out.count("[mt-bench]") == 3 and out.count("[heldout]") == 3
    matrix = out[out.index("tau (mean tokens per verifier step, engine vllm)") :].splitlines()
    assert matrix[1].split() == ["k=3", "k=5", "k=7"]
    assert matrix[2].split() == ["mt-bench", "2.000", "3.000", "4.000"]  # 1 + k // 2 accepted per draft
    assert matrix[3].split() == ["heldout", "2.000", "3.000", "4.000"]

    assert main([*args, "--json"]) == 0
    cells = json.loads(capsys.readouterr().out)["matrix"]
    assert [(c["prompt_set"], c["k"], c["mean_acceptance_length"]) for c in cells] == [
        ("mt-bench", 3, 2.0), ("mt-bench", 5, 3.0), ("mt-bench", 7, 4.0),
        ("heldout", 3, 2.0), ("heldout", 5, 3.0), ("heldout", 7, 4.0),
    ]  # fmt: skip
    first = render_user_prompt(smollm2_tokenizer, mt_bench_first_turns()[0].text)
    assert cells[0]["n_prompt_tokens"] > 80 * 20 and cells[0]["n_prompts"] == 80
    assert cells[0]["n_prompt_tokens"] == sum(
        len(render_user_prompt(smollm2_tokenizer, p.text)) for p in mt_bench_first_turns()
    )
    assert len(first) > 20


def test_the_matrix_says_what_share_of_the_verifiers_tokens_the_draft_vocabulary_lacks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fake verifier writes each prompt's first token twice; with a real export whose vocabulary holds the
    first token of one of the two held-out prompts, half the generated tokens lie outside it."""
    import numpy as np
    import torch

    from eagle3.draft_trainer import evaluate
    from eagle3.draft_trainer.checkpoint import save_draft
    from eagle3.draft_trainer.export import export_draft
    from eagle3.draft_trainer.model import DraftConfig, EagleDraft
    from eagle3.draft_trainer.vocab import build_draft_vocab

    cfg = DraftConfig(hidden_size=32, target_hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=4, head_dim=8, draft_vocab_size=2, target_vocab_size=49152,
                      aux_layer_ids=(0, 1, 2))  # fmt: skip
    counts = np.zeros(49152, dtype=np.int64)
    counts[[1, 9]] = [5, 3]  # the vocabulary: ids 1 and 9
    draft = EagleDraft(cfg)
    vocab, _ = build_draft_vocab(counts, 2)
    draft.set_vocab(torch.from_numpy(vocab.d2t), torch.from_numpy(vocab.t2d))
    save_draft(draft, tmp_path / "run" / "draft")
    export = export_draft(tmp_path / "run", tmp_path / "export")
    _fake_vllm(monkeypatch)
    monkeypatch.setattr(evaluate, "heldout_prompts", lambda *_a, **_k: [[1, 2, 3], [4, 5]])
    args = ["eval", str(export), "--model", "SmolLM2-135M-Instruct", "--engine", "vllm", "-k", "3,5",
            "--prompt-set", "heldout", "--prepared", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "outside the vocab 50.0% of the verifier's tokens" in out
    matrix = out[out.index("tau (mean tokens per verifier step, engine vllm)") :].splitlines()
    assert matrix[1].split() == ["k=3", "k=5", "outside", "vocab"]
    assert matrix[2].split() == ["heldout", "2.000", "3.000", "50.0%"]
    assert main([*args, "--json"]) == 0
    cells = json.loads(capsys.readouterr().out)["matrix"]
    assert [c["outside_vocab_share"] for c in cells] == [0.5, 0.5]


def test_one_set_one_k_prints_the_report_as_before(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_vllm(monkeypatch)
    args = ["eval", str(tmp_path / "export"), "--model", "SmolLM2-135M-Instruct", "--engine", "vllm",
            "--prompt-set", "mt-bench", "--json"]  # fmt: skip
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["k"] == 4 and report["n_prompts"] == 80 and report["mean_acceptance_length"] == 3.0


def test_heldout_without_prepared_says_what_to_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", str(tmp_path / "export"), "--model", "SmolLM2-135M-Instruct"]) != 0
    err = capsys.readouterr().err
    assert "needs --prepared" in err and "--prompt-set mt-bench" in err


def test_k_list_is_checked_by_argparse(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["eval", str(tmp_path), "--model", "SmolLM2-135M-Instruct", "-k", "3,3"])
    assert exc.value.code == 2 and "distinct positive integers" in capsys.readouterr().err
