"""What a target family needs before an engine starts: checks on a checkpoint's text config (a plain
dict, ``core.identity.model_config``), no torch, no vllm.

DeepSeek family (``DeepseekV2/V3ForCausalLM``: DeepSeek-V2/V3/R1, Kimi-K2 and the text backbone of
Kimi-K2.5), two traps that load without an error and give wrong states or a dead engine
(docs/targets.md, "Traps"):

* routing: vLLM reads ``scoring_func`` (default ``softmax``) and ``topk_method`` from config.json;
  transformers' ``DeepseekV3`` always routes with sigmoid plus ``e_score_correction_bias``
  (``noaux_tc``) and its config writes neither key. A V3-style config without them loads in vLLM and
  routes MoE layers with softmax (states 10-14 % off), or fails on ``e_score_correction_bias``.
  ``missing_routing_keys`` names what to add; the vllm backend refuses such a checkpoint.
* aux id 0 (the embedding's output): vLLM 0.32's DeepSeek backbone adds a ``None`` residual before
  layer 0 (``Tensor + NoneType``) and the engine dies in warm-up. ``check_vllm_aux_layer_ids`` refuses it
  before the engine starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

DEEPSEEK_V3_MODEL_TYPES = frozenset({"deepseek_v3", "deepseek_v32", "kimi_k2"})
DEEPSEEK_MODEL_TYPES = DEEPSEEK_V3_MODEL_TYPES | {"deepseek_v2"}
# what DeepSeek-V3, R1 and Kimi-K2 ship in config.json (and what transformers' DeepseekV3 computes)
V3_ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def _architectures(config: Mapping[str, Any]) -> list[str]:
    return [str(a) for a in config.get("architectures") or ()]


def is_deepseek(config: Mapping[str, Any]) -> bool:
    """A DeepSeek-V2/V3-style backbone (MLA, DeepSeek MoE), by ``model_type`` or architecture."""
    return config.get("model_type") in DEEPSEEK_MODEL_TYPES or any(
        a.startswith(("DeepseekV2", "DeepseekV3", "DeepseekV32")) for a in _architectures(config)
    )


def is_deepseek_v3(config: Mapping[str, Any]) -> bool:
    """V3-style routing (sigmoid, ``noaux_tc``): V3, V3.2, R1, Kimi-K2; not V2 (softmax)."""
    return config.get("model_type") in DEEPSEEK_V3_MODEL_TYPES or any(
        a.startswith(("DeepseekV3", "DeepseekV32")) for a in _architectures(config)
    )


def missing_routing_keys(config: Mapping[str, Any]) -> dict[str, str]:
    """The routing keys a DeepSeek-V3-style text config lacks, with the values to add ({} otherwise)."""
    if not is_deepseek_v3(config):
        return {}
    return {key: value for key, value in V3_ROUTING.items() if key not in config}


def routing_keys_error(config: Mapping[str, Any], where: str) -> str | None:
    """The message refusing a config that lacks routing keys (``where``: the config file), or None."""
    missing = missing_routing_keys(config)
    if not missing:
        return None
    keys = ", ".join(missing)
    return (
        f"{where}: a DeepSeek-V3-style config ({config.get('model_type')}) without {keys}. vLLM defaults to "
        "softmax routing (or fails on e_score_correction_bias without topk_method), while the weights route "
        "with sigmoid + e_score_correction_bias (noaux_tc), which transformers' DeepseekV3 always computes and "
        f"its DeepseekV3Config does not write. Add {json.dumps(missing)[1:-1]} to the config (its text_config "
        "for a wrapper such as Kimi-K2.5), as DeepSeek-V3 and Kimi-K2 ship them"
    )


def check_vllm_aux_layer_ids(config: Mapping[str, Any], aux_layer_ids: Sequence[int]) -> None:
    """Raise ``ValueError`` for aux id 0 on a DeepSeek backbone in vLLM (module docstring)."""
    if 0 in aux_layer_ids and is_deepseek(config):
        raise ValueError(
            f"aux layer id 0 (the embedding's output) with a DeepSeek-family model "
            f"({config.get('model_type')}): vLLM's DeepSeek backbone cannot tap it (its engine dies in warm-up "
            f"on 'Tensor + NoneType'); use ids >= 1, e.g. {[i for i in aux_layer_ids if i] or [1]} or the default"
        )
