"""The built-in MT-Bench prompt set: the 80 first turns, rendered with the verifier's template, and the
check that a training dataset does not contain them."""

from __future__ import annotations

from typing import Any

import pytest

from eagle3.core.conversations import iter_rows, parse_row
from eagle3.core.prompt_sets import (
    MT_BENCH,
    BenchPrompt,
    mt_bench_first_turns,
    overlapping_prompts,
    prompt_set,
    render_user_prompt,
)


def test_mt_bench_has_its_80_first_turns_in_order() -> None:
    prompts = mt_bench_first_turns()
    assert len(prompts) == 80
    assert [p.prompt_id for p in prompts] == [f"mt-bench/{i}" for i in range(81, 161)]
    assert prompts[0].category == "writing"
    assert prompts[0].text.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert {p.category for p in prompts} == {
        "coding", "extraction", "humanities", "math", "reasoning", "roleplay", "stem", "writing"
    }  # fmt: skip
    assert prompt_set(MT_BENCH) == prompts
    with pytest.raises(ValueError, match="unknown prompt set 'mtbench'; built in: mt-bench"):
        prompt_set("mtbench")


def test_rendered_with_the_verifiers_chat_template(smollm2_tokenizer: Any) -> None:
    text = mt_bench_first_turns()[0].text
    ids = render_user_prompt(smollm2_tokenizer, text)
    decoded = smollm2_tokenizer.decode(ids)
    assert decoded.startswith("<|im_start|>system\n")  # SmolLM2's template adds its default system turn
    assert f"<|im_start|>user\n{text}<|im_end|>\n" in decoded
    assert decoded.endswith("<|im_start|>assistant\n")  # the generation prompt: the reply comes next
    # the same ids as transformers' own tokenizing render (no BOS added twice)
    reference = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(reference)


def test_overlap_is_found_by_normalised_text_and_containment() -> None:
    bench = [BenchPrompt("b/1", "x", "Explain the theory of relativity in simple terms, please.")]
    hits = overlapping_prompts(
        [
            "explain the THEORY of relativity in simple terms please",  # same after normalising
            "Q: Explain the theory of relativity in simple terms, please. Thanks!",  # contains it
            "explain the theory of relativity in simple terms",  # contained, 8 words
            "theory of relativity",  # contained but short: a shared phrase, not the question
            "relativity",
            "Tell me a joke",
        ],
        bench,
    )
    assert [h[0] for h in hits] == [
        "explain the THEORY of relativity in simple terms please",
        "Q: Explain the theory of relativity in simple terms, please. Thanks!",
        "explain the theory of relativity in simple terms",
    ]
    assert {h[1] for h in hits} == {"b/1"}


def test_the_demo_corpus_does_not_contain_mt_bench() -> None:
    """The demo trains on builtin:chatterbot (and prompts the verifier writes, checked at run time):
    none of its user turns is an MT-Bench question."""
    pytest.importorskip("chatterbot_corpus")
    texts = [
        m.content
        for raw in iter_rows("builtin:chatterbot")
        for m in parse_row(raw.row or {}, raw.location).messages
        if m.role == "user"
    ]
    assert len(texts) > 1000
    assert overlapping_prompts(texts) == []
