"""``eagle3 export``: the flat vLLM EAGLE-3 format (config.json + model.safetensors; docs/architecture.md,
"On disk", Export).

Invariants:

* ``config.json`` is flat: ``architectures == ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers == 1``,
  ``draft_vocab_size``, ``target_hidden_size``, the aux ids at top level *and* in ``eagle_config``
  (``use_aux_hidden_state: true``), and the verifier's ``max_position_embeddings`` and rope settings.
* tensors: ``fc``, ``midlayer.*``, ``norm``, ``lm_head`` in bf16, ``t2d`` bool, and ``d2t`` int64
  only when the draft vocab is smaller than the target's (vLLM 0.32 rejects it otherwise).
* ``vllm_param_shapes`` replays vLLM's weight mapping (``midlayer.`` -> ``model.layers.0.``, q/k/v
  and gate/up stacked, ``d2t`` -> ``draft_id_to_target_id``, ``t2d`` dropped) so a test holds the
  export against the shapes vLLM allocates from the config alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.draft_trainer.checkpoint import load_draft, resolve_draft_dir, write_text_atomic
from eagle3.draft_trainer.errors import CheckpointError
from eagle3.draft_trainer.model import EagleDraft

EXPORT_WEIGHTS = "model.safetensors"
EXPORT_CONFIG = "config.json"


def new_file_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask (0644 under the usual 022)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def export_config(model: EagleDraft) -> dict[str, Any]:
    cfg = model.cfg
    ids = list(cfg.aux_layer_ids)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.target_vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        # vLLM's LlamaForCausalLMEagle3 reads these three at the top level (norm_before_fc also from
        # eagle_config); all false is EAGLE-3 as published and what a config without them means
        "norm_before_fc": cfg.norm_before_fc,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_output": cfg.norm_output,
    }
    return config


# What vLLM's speculators reader (vllm/transformers_utils/configs/speculators) needs: no top-level
# model_type (vLLM detects the format by ``speculators_config``), ``speculators_model_type``, the draft
# layer's own config under ``transformer_layer_config``, and the verifier plus k under
# ``speculators_config``. ``norm_before_residual`` defaults to true there, false in the flat format: the
# three norm flags are written explicitly. What speculators' own
# ``SpeculatorModel.from_pretrained`` needs besides (tests/integration/test_export_speculators.py loads it
# with speculators 0.9.0): ``speculators_version``, the verifier's ``architectures``, and the decoder layer's
# tensors under ``layers.0.`` (the names of its ``Eagle3DraftModel``; vLLM maps ``midlayer.`` there too).
EAGLE3_KEYS = (
    "architectures",
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "eagle_config",
)
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format this writes (and the test loads)
SPECULATORS_LAYER_PREFIX = "layers.0."


def speculators_config(
    model: EagleDraft, verifier: str, num_speculative_tokens: int, verifier_architectures: list[str]
) -> dict[str, Any]:
    """``config.json`` in speculators' format: ``vllm serve DIR`` loads the verifier it names with this
    draft and k speculative tokens, no ``--speculative-config`` needed."""
    flat = export_config(model)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": {k: v for k, v in flat.items() if k not in EAGLE3_KEYS},
        "draft_vocab_size": flat["draft_vocab_size"],
        "target_hidden_size": flat["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": flat["eagle_aux_hidden_state_layer_ids"],
        "norm_before_residual": flat["norm_before_residual"],
        "norm_before_fc": flat["norm_before_fc"],
        "norm_output": flat["norm_output"],
        "torch_dtype": "bfloat16",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }


def verifier_architectures(verifier: str, draft_dir: str | Path) -> list[str]:
    """The verifier's ``architectures`` (speculators requires them): from ``verifier``'s ``config.json``
    when eagle3 finds it locally, else from the training run's verifier (the ``model`` of the run's
    ``config.json``; the same model by another name, e.g. the hub id the serving host loads)."""
    from eagle3.core.models import ModelNotFoundError, resolve_model_dir

    run_config = resolve_draft_dir(draft_dir).parent / "config.json"
    trained_on = json.loads(run_config.read_text()).get("model") if run_config.is_file() else None
    for candidate in (verifier, trained_on):
        if not candidate:
            continue
        try:
            config = json.loads((resolve_model_dir(str(candidate)) / "config.json").read_text())
        except (ModelNotFoundError, OSError, ValueError):  # not local (or no JSON): try the next name
            continue
        if config.get("architectures"):
            return [str(a) for a in config["architectures"]]
    raise CheckpointError(
        f"--format speculators needs the verifier's architectures (speculators refuses a config without them): "
        f"neither --verifier {verifier!r} nor the run's verifier {trained_on!r} is a local checkpoint directory "
        "whose config.json names them; give --verifier as the verifier's local directory"
    )


def export_tensors(model: EagleDraft, layer_prefix: str = "midlayer.") -> dict[str, torch.Tensor]:
    """The exported tensors; ``layer_prefix`` renames ``midlayer.`` (speculators: ``layers.0.``)."""
    out: dict[str, torch.Tensor] = {}
    for state_name, tensor in model.state_dict().items():
        name = layer_prefix + state_name.removeprefix("midlayer.") if state_name.startswith("midlayer.") else state_name
        if name == "d2t":
            if model.cfg.draft_vocab_size != model.cfg.target_vocab_size:
                out[name] = tensor.to(torch.int64).contiguous()
        elif name == "t2d":
            out[name] = tensor.to(torch.bool).contiguous()
        else:
            out[name] = tensor.detach().to(torch.bfloat16).contiguous()
    return out


def export_draft(
    draft_dir: str | Path,
    export_dir: str | Path,
    *,
    format: str = "vllm",
    verifier: str | None = None,
    num_speculative_tokens: int = 3,
) -> Path:
    """Write ``export_dir`` from a run's ``draft/`` (or the run directory itself). ``format="speculators"``
    needs ``verifier`` (the path or hub id ``vllm serve`` will load as the target)."""
    if format not in ("vllm", "speculators"):
        raise CheckpointError(f"export format {format!r} is not supported (supported: vllm, speculators)")
    if format == "speculators" and not verifier:
        raise CheckpointError("--format speculators needs --verifier (the target model vllm serve loads)")
    if num_speculative_tokens < 1:
        raise CheckpointError(f"--num-speculative-tokens must be >= 1, got {num_speculative_tokens}")
    model = load_draft(draft_dir)
    speculators = format == "speculators"
    if speculators:
        architectures = verifier_architectures(str(verifier), draft_dir)
        config = speculators_config(model, str(verifier), num_speculative_tokens, architectures)
    else:
        config = export_config(model)
    out = Path(export_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{EXPORT_WEIGHTS}.tmp"
    tensors = export_tensors(model, SPECULATORS_LAYER_PREFIX if speculators else "midlayer.")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, new_file_mode())  # safetensors 0.8 writes 0600: a vLLM running as another user could not read it
    tmp.replace(out / EXPORT_WEIGHTS)
    write_text_atomic(out / EXPORT_CONFIG, json.dumps(config, indent=2) + "\n")
    return out


def read_export(export_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    export_dir = Path(export_dir)
    if not (export_dir / EXPORT_CONFIG).is_file() or not (export_dir / EXPORT_WEIGHTS).is_file():
        raise CheckpointError(f"{export_dir}: not an export (needs {EXPORT_CONFIG} and {EXPORT_WEIGHTS})")
    config = json.loads((export_dir / EXPORT_CONFIG).read_text())
    with safe_open(str(export_dir / EXPORT_WEIGHTS), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    return config, tensors


def export_target_ids(export_dir: str | Path) -> np.ndarray | None:
    """(K,) int64: the target ids an exported draft can propose, from its ``d2t`` (eagle3's name, or vLLM's
    ``draft_id_to_target_id``) in any ``*.safetensors`` of ``export_dir`` (eagle3's export or a speculators
    checkpoint); None when none is stored: a draft over the whole target vocabulary (eagle3 writes no
    ``d2t`` then) or a checkpoint that keeps it elsewhere."""
    for path in sorted(Path(export_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            names = set(fh.keys())
            for name in ("d2t", "draft_id_to_target_id"):
                if name in names:
                    d2t = fh.get_tensor(name).to(torch.int64)
                    ids: np.ndarray = (torch.arange(d2t.shape[0], dtype=torch.int64) + d2t).numpy()
                    return ids
    return None


def expected_vllm_shapes(config: dict[str, Any], target_vocab_size: int) -> dict[str, tuple[int, ...]]:
    """What vLLM 0.32's ``Eagle3LlamaForCausalLM`` allocates for this config (names after mapping)."""
    h, ht = config["hidden_size"], config["target_hidden_size"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // nh
    inter, vd = config["intermediate_size"], config["draft_vocab_size"]
    n_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    p = "model.layers.0."
    shapes: dict[str, tuple[int, ...]] = {
        "model.fc.weight": (h, n_aux * ht),
        p + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * d, 2 * h),
        p + "self_attn.o_proj.weight": (h, nh * d),
        p + "mlp.gate_up_proj.weight": (2 * inter, h),
        p + "mlp.down_proj.weight": (h, inter),
        p + "input_layernorm.weight": (h,),
        p + "hidden_norm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        "model.norm.weight": (h,),
        "lm_head.weight": (vd, h),
    }
    if config.get("norm_before_fc") or config["eagle_config"].get("norm_before_fc"):
        shapes["model.input_norm.weight"] = (n_aux * ht,)
    if vd != target_vocab_size:
        shapes["draft_id_to_target_id"] = (vd,)
    return shapes


def vllm_param_shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Replay vLLM's load_weights mapping on exported tensors: parameter name -> loaded shape."""
    stacked = {
        ".q_proj": ".qkv_proj",
        ".k_proj": ".qkv_proj",
        ".v_proj": ".qkv_proj",
        ".gate_proj": ".gate_up_proj",
        ".up_proj": ".gate_up_proj",
    }
    out: dict[str, list[int]] = {}
    for name, tensor in tensors.items():
        if "t2d" in name:
            continue
        if name == "d2t":
            out["draft_id_to_target_id"] = list(tensor.shape)
            continue
        mapped = name if "lm_head" in name else "model." + name.replace("midlayer.", "layers.0.")
        for old, new in stacked.items():
            if old in mapped:
                mapped = mapped.replace(old, new)
                if mapped in out:
                    out[mapped][0] += int(tensor.shape[0])  # stacked along the output dim
                    if list(out[mapped][1:]) != list(tensor.shape[1:]):
                        raise CheckpointError(f"{name}: input dim {tensor.shape[1:]} differs from its stack")
                    break
                out[mapped] = list(tensor.shape)
                break
        else:
            if mapped in out:
                raise CheckpointError(f"{name}: maps to {mapped} twice")
            out[mapped] = list(tensor.shape)
    return {k: tuple(v) for k, v in out.items()}


def check_export(export_dir: str | Path, target_vocab_size: int | None = None) -> dict[str, tuple[int, ...]]:
    """Raise ``CheckpointError`` unless the export loads into vLLM's shapes; returns the mapped shapes."""
    config, tensors = read_export(export_dir)
    vocab = int(target_vocab_size or config["vocab_size"])
    got, want = vllm_param_shapes(tensors), expected_vllm_shapes(config, vocab)
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))
        raise CheckpointError(f"{export_dir}: tensors do not match vLLM's parameters: {diff}")
    if config["eagle_aux_hidden_state_layer_ids"] != config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]:
        raise CheckpointError(f"{export_dir}: top-level aux ids differ from eagle_config's")
    if "t2d" in tensors and int(tensors["t2d"].sum()) != config["draft_vocab_size"]:
        raise CheckpointError(f"{export_dir}: t2d marks {int(tensors['t2d'].sum())} ids, not draft_vocab_size")
    return got
