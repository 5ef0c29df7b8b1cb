"""User-turn markers read from a chat template (``client/chat_turns.py``), so self-instruct works on the
target family: the real SmolLM2 (ChatML) and DeepSeek-V3 tokenizers, Llama-3- and Kimi-K2-style templates
on SmolLM2's vocabulary, and templates that cannot be read, refused with the model named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eagle3.client.chat_turns import ChatTemplateError, user_turn_markers
from eagle3.client.prepare import load_tokenizer
from eagle3.client.self_instruct import SelfInstructConfig, sample_prompts, user_turns, write_prompt_dir
from eagle3.core.prompt_sets import render_user_prompt
from eagle3.core.protocol.prepared import PreparedMeta, iter_prepared
from eagle3.core.tokenizer_probe import probe_tokenizer
from tests.family_models import deepseek_v3_config, require_deepseek_v3_tokenizer_dir
from tests.unit.test_self_instruct_openers import ScriptedVerifier

CONVERSATION = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 + 3, in words?"},
]
# Llama-3.1's shape: a begin token, a default system turn, header tokens around each role, <|eot_id|> after
LLAMA3_TEMPLATE = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023<|eot_id|>"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
    "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Kimi-K2's shape: <|im_ROLE|>ROLE<|im_middle|>CONTENT<|im_end|>, a default system turn first
KIMI_TEMPLATE = (
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
HEADER_TEMPLATES = {
    "llama3": (
        LLAMA3_TEMPLATE,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n",  # never the system's header
        "<|eot_id|>",
    ),
    "kimi-k2": (
        KIMI_TEMPLATE,
        ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"],
        "<|im_end|><|im_user|>user<|im_middle|>",
        "<|im_end|>",
    ),
}


@pytest.fixture(scope="module")
def deepseek_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    found = require_deepseek_v3_tokenizer_dir(tmp_path_factory.mktemp("deepseek-v3-tokenizer"))
    (found / "config.json").write_text(json.dumps(deepseek_v3_config(vocab_size=129280).to_dict()))
    tokenizer = load_tokenizer(found)  # beside its model's config, as in a checkpoint: it round-trips
    probe_tokenizer(tokenizer, found)
    return tokenizer


def with_template(smollm2_dir: Path, template: str, special_tokens: list[str]) -> Any:
    tokenizer = load_tokenizer(smollm2_dir)  # a fresh copy: the session fixture stays ChatML
    tokenizer.add_special_tokens({"additional_special_tokens": special_tokens})
    tokenizer.chat_template = template
    return tokenizer


def rendered_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(str(text), add_special_tokens=False)["input_ids"])


def test_chatml_markers_are_the_ones_self_instruct_always_used(smollm2_tokenizer: Any) -> None:
    markers = user_turn_markers(smollm2_tokenizer, "SmolLM2-135M-Instruct")
    assert markers.prefix.startswith("<|im_start|>system\n") and markers.prefix.endswith("<|im_start|>user\n")
    assert markers.open == "<|im_end|>\n<|im_start|>user\n"
    assert markers.close == "<|im_end|>\n<|im_start|>assistant\n"
    assert markers.end_token == "<|im_end|>"
    assert markers.end_id == smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = rendered_ids(smollm2_tokenizer, CONVERSATION)
    assert user_turns(smollm2_tokenizer, ids) == ["What is 2 + 2?", "And 3 + 3, in words?"]


def test_deepseek_v3_markers_from_its_own_template(deepseek_tokenizer: Any) -> None:
    markers = user_turn_markers(deepseek_tokenizer, "deepseek-v3")
    assert markers.prefix == "<｜begin▁of▁sentence｜><｜User｜>"
    assert markers.open == "<｜User｜>"  # not '▁of▁sentence｜><｜User｜>', the text both turns' openings share
    assert (markers.close, markers.end_token) == ("<｜Assistant｜>", "<｜Assistant｜>")
    assert markers.end_id == deepseek_tokenizer.convert_tokens_to_ids("<｜Assistant｜>")
    ids = rendered_ids(deepseek_tokenizer, CONVERSATION)
    assert user_turns(deepseek_tokenizer, ids, markers) == ["What is 2 + 2?", "And 3 + 3, in words?"]


@pytest.mark.parametrize("name", sorted(HEADER_TEMPLATES))
def test_header_style_templates_read_too(smollm2_dir: Path, name: str) -> None:
    template, special_tokens, open_, end_token = HEADER_TEMPLATES[name]
    tokenizer = with_template(smollm2_dir, template, special_tokens)
    markers = user_turn_markers(tokenizer, name)
    assert markers.prefix.endswith(open_) and markers.open == open_
    assert markers.end_token == end_token
    assert user_turns(tokenizer, rendered_ids(tokenizer, CONVERSATION)) == ["What is 2 + 2?", "And 3 + 3, in words?"]


def test_self_instruct_on_deepseek_v3_asks_after_its_user_token_and_stops_at_assistant(
    tmp_path: Path, deepseek_tokenizer: Any
) -> None:
    """The request a DeepSeek-V3/Kimi-class verifier gets: its own pre-query text and stop token; the
    stored prompts are what ``eagle3 prepare`` renders for that turn."""
    markers = user_turn_markers(deepseek_tokenizer, "deepseek-v3")
    turns = [" an explanation of how tides work.", " a limerick about a cat.", " three prime numbers in words."]
    verifier = ScriptedVerifier(deepseek_tokenizer, turns)
    cfg = SelfInstructConfig(n_prompts=3, prompts_per_request=3, max_requests=1, seed=0)
    kept = sample_prompts(verifier, deepseek_tokenizer, cfg, openers=["Write"])  # type: ignore[arg-type]
    assert kept == [f"Write{t}" for t in turns]  # the scripted verifier writes after the opener
    prefix_ids = list(deepseek_tokenizer(markers.prefix, add_special_tokens=False)["input_ids"])
    write_ids = list(deepseek_tokenizer("Write", add_special_tokens=False)["input_ids"])
    assert verifier.prompts == [prefix_ids + write_ids] * 3
    assert verifier.stop_token_ids == [[markers.end_id]]
    meta = PreparedMeta("deepseek-v3", "unused", "0" * 64, "0" * 64, 129280, 4096, "drop", ["si"])
    out = write_prompt_dir(kept, tmp_path / "si", deepseek_tokenizer, meta)
    for sample, text in zip(iter_prepared(out), kept, strict=True):
        assert sample.input_ids == [*render_user_prompt(deepseek_tokenizer, text), markers.end_id]
        assert user_turns(deepseek_tokenizer, sample.input_ids[: sample.loss_mask.index(1)], markers) == [text]


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:", "one special token"),
        ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n<|im_end|>{% endfor %}", "drops or repeats"),
        ("{{ raise_exception('no such role') }}", "rendering a user turn failed"),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "nothing follows a user turn"),
    ],
)
def test_a_template_it_cannot_read_is_refused_naming_the_model(smollm2_dir: Path, template: str, reason: str) -> None:
    tokenizer = load_tokenizer(smollm2_dir)
    tokenizer.chat_template = template
    with pytest.raises(ChatTemplateError, match=rf"my-verifier: self-instruct cannot read .*{reason}.*eagle3 prepare"):
        user_turn_markers(tokenizer, "my-verifier")
