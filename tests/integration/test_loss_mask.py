"""Golden loss masks by render boundary, on SmolLM2's real tokenizer and ChatML template, and on
two other real template shapes (Llama-3 headers, Mistral [INST]) written here."""

from __future__ import annotations

from typing import Any

import pytest

from eagle3.core.conversations import Message, RowError, iter_rows, parse_row
from eagle3.core.masking import ChatTokenizer, TemplateError

pytestmark = pytest.mark.integration

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Mistral-instruct shape: the system prompt is folded into the first user turn; turns end with eos.
MISTRAL_TEMPLATE = (
    "{% set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' %}"
    "{% set first_user = 1 if system else 0 %}"
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}"
    "{{ '[INST] ' + (system + '\n\n' if loop.index0 == first_user and system else '') + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)


def msgs(*pairs: tuple[str, str]) -> list[Message]:
    return [Message(role, content) for role, content in pairs]


def masked_spans(tokenizer: Any, ids: list[int], mask: list[int]) -> list[str]:
    """Decode each maximal run of supervised tokens."""
    spans, run = [], []
    for token, m in zip(ids, mask, strict=True):
        if m:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    if run:
        spans.append(tokenizer.decode(run))
    return spans


def test_smollm2_golden_single_turn(smollm2_tokenizer):
    chat = ChatTokenizer(smollm2_tokenizer)
    out = chat.tokenize(msgs(("user", "Hi"), ("assistant", "Hello!")))
    # Golden ids: SmolLM2's template adds its default system prompt; "Hello" "!" "<|im_end|>" "\n"
    assert out.input_ids == [
        1,
        9690,
        198,
        2683,
        359,
        253,
        5356,
        5646,
        11173,
        3365,
        3511,
        308,
        34519,
        28,
        7018,
        411,
        407,
        19712,
        8182,
        2,
        198,
        1,
        4093,
        198,
        26843,
        2,
        198,
        1,
        520,
        9531,
        198,
        19556,
        17,
        2,
        198,
    ]
    assert out.loss_mask == [0] * 31 + [1, 1, 1, 1]
    assert smollm2_tokenizer.decode(out.input_ids) == (
        SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    )


def test_smollm2_multi_turn_with_system_prompt(smollm2_tokenizer):
    chat = ChatTokenizer(smollm2_tokenizer)
    conv = msgs(
        ("system", "You answer in French."),
        ("user", "Hello"),
        ("assistant", "Bonjour !"),
        ("user", "Thanks"),
        ("assistant", "De rien."),
    )
    out = chat.tokenize(conv)
    text = smollm2_tokenizer.decode(out.input_ids)
    assert text.startswith("<|im_start|>system\nYou answer in French.<|im_end|>\n")  # no default prompt
    assert masked_spans(smollm2_tokenizer, out.input_ids, out.loss_mask) == [
        "Bonjour !<|im_end|>\n",
        "De rien.<|im_end|>\n",
    ]
    # the user turns and the system prompt are never supervised
    unmasked = smollm2_tokenizer.decode([t for t, m in zip(out.input_ids, out.loss_mask, strict=True) if not m])
    assert "Hello" in unmasked and "Thanks" in unmasked and "Bonjour" not in unmasked


def test_llama3_header_template(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))  # fresh copy: we add tokens
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    chat = ChatTokenizer(tokenizer, LLAMA3_TEMPLATE)
    conv = msgs(
        ("system", "Be terse."),
        ("user", "2+2?"),
        ("assistant", "4"),
        ("user", "3+3?"),
        ("assistant", "  6  "),
    )
    out = chat.tokenize(conv)
    assert masked_spans(tokenizer, out.input_ids, out.loss_mask) == ["4<|eot_id|>", "6<|eot_id|>"]
    assert out.input_ids[-1] == eot and out.loss_mask[-1] == 1
    # the headers announcing each assistant turn are prompt, not supervised
    header_positions = [
        i for i, t in enumerate(out.input_ids) if t == tokenizer.convert_tokens_to_ids("<|end_header_id|>")
    ]
    assert all(out.loss_mask[i] == 0 for i in header_positions)


def test_mistral_inst_template(smollm2_tokenizer):
    chat = ChatTokenizer(smollm2_tokenizer, MISTRAL_TEMPLATE)
    conv = msgs(
        ("system", "Be kind."),
        ("user", "Hi"),
        ("assistant", "Hello there."),
        ("user", "Bye"),
        ("assistant", "Goodbye."),
    )
    out = chat.tokenize(conv)
    text = smollm2_tokenizer.decode(out.input_ids)
    assert text == (
        "<|im_start|>[INST] Be kind.\n\nHi [/INST]Hello there.<|im_end|>[INST] Bye [/INST]Goodbye.<|im_end|>"
    )
    assert masked_spans(smollm2_tokenizer, out.input_ids, out.loss_mask) == [
        "Hello there.<|im_end|>",
        "Goodbye.<|im_end|>",
    ]


def test_every_chatterbot_conversation_masks_exactly_its_assistant_turns(smollm2_tokenizer):
    chat = ChatTokenizer(smollm2_tokenizer)
    n, straddled = 0, 0
    for raw in iter_rows("builtin:chatterbot"):
        conv = parse_row(raw.row or {}, raw.location)
        out = chat.tokenize(conv.messages)
        expected = [m.content + "<|im_end|>\n" for m in conv.messages if m.role == "assistant"]
        got = masked_spans(smollm2_tokenizer, out.input_ids, out.loss_mask)
        assert len(got) == len(expected), raw.location
        for span, want in zip(got, expected, strict=True):
            if span != want:
                # A token straddling the boundary ("\n" + a reply that starts with a space merge into
                # one token) is supervised: it carries assistant text. Only the prompt's "\n" may leak.
                assert span == "\n" + want and want[0].isspace(), (raw.location, span, want)
                straddled += 1
        n += 1
    assert n > 2000
    assert straddled < n // 100  # 9 of 2,026 in chatterbot-corpus 1.3.3


def test_slow_tokenizer_fallback_gives_the_same_masks(smollm2_tokenizer):
    """The token-prefix method (for tokenizers without offsets) agrees with the offset method on
    real multi-turn data, boundary-merged tokens included."""
    fast, slow = ChatTokenizer(smollm2_tokenizer), ChatTokenizer(smollm2_tokenizer)
    slow.use_offsets = False
    rows = [parse_row(r.row or {}, r.location) for r in iter_rows("builtin:chatterbot")]
    chained = [sum((c.messages for c in rows[i : i + 4]), ()) for i in range(0, len(rows) - 3, 4)]
    for messages in chained:
        assert fast.tokenize(messages) == slow.tokenize(messages)


def test_template_without_assistant_output_fails_loudly(smollm2_tokenizer):
    only_users = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] + '\n' }}{% endif %}{% endfor %}"
    chat = ChatTokenizer(smollm2_tokenizer, only_users)
    with pytest.raises(TemplateError, match="renders assistant message 1 as nothing"):
        chat.tokenize(msgs(("user", "Hi"), ("assistant", "Hello")))


def test_template_that_rewrites_past_turns_is_rejected(smollm2_tokenizer):
    # like templates that drop earlier reasoning: only the last assistant turn keeps its content
    last_only = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}{{ 'A: ...\n' }}"
        "{% else %}{{ m['role'][0] | upper + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}"
    )
    chat = ChatTokenizer(smollm2_tokenizer, last_only)
    with pytest.raises(TemplateError, match="not prefix-stable at message 1"):
        chat.tokenize(msgs(("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")))


def test_template_exceptions_are_row_errors(smollm2_tokenizer):
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}x"
    chat = ChatTokenizer(smollm2_tokenizer, strict)
    with pytest.raises(RowError, match="first message must be user"):
        chat.tokenize(msgs(("system", "s"), ("user", "u"), ("assistant", "a")))


def test_assistant_first_is_a_row_error(smollm2_tokenizer):
    with pytest.raises(RowError, match="starts with an assistant turn"):
        ChatTokenizer(smollm2_tokenizer).tokenize(msgs(("assistant", "hi"), ("user", "x")))


def test_missing_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    tokenizer.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        ChatTokenizer(tokenizer)
