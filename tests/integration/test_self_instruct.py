"""Self-instruct prompts sampled from the embedded verifier: filtered, deterministic, stored as prepared data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from eagle3.core.protocol.prepared import iter_prepared, read_meta
from eagle3.draft_trainer.distill import prompt_of
from eagle3.draft_trainer.self_instruct import (
    IM_END,
    SelfInstructConfig,
    is_acceptable,
    normalize,
    render_prompt,
    sample_prompts,
    user_prefix_text,
    write_prompt_dir,
)

pytestmark = pytest.mark.integration

CFG = SelfInstructConfig(n_prompts=8, batch_size=8, max_batches=1, max_tokens=24, seed=7, threads=1)


def test_filters() -> None:
    assert normalize("  What IS   a Cat?! ") == "what is a cat"
    assert is_acceptable([1, 2, 3, 4], "What is it", 4, 40)
    assert not is_acceptable([1, 2, 3], "What is", 4, 40)  # too short
    assert not is_acceptable(list(range(41)), "x" * 41, 4, 40)  # too long
    assert not is_acceptable([5, 5, 5, 5, 6], "hi hi hi hi ho", 4, 40)  # degenerate repeat
    assert not is_acceptable([1, 2, 3, 4], "1 2 3 4", 4, 40)  # no letters


def test_prefix_is_the_user_turn_start(smollm2_tokenizer: Any) -> None:
    prefix = user_prefix_text(smollm2_tokenizer)
    assert prefix.endswith("<|im_start|>user\n")
    assert "<|im_start|>system\n" in prefix  # the template's default system turn comes first


def test_sampled_prompts_deterministic_filtered_and_excluded(smollm2_dir: Path, smollm2_tokenizer: Any) -> None:
    first = sample_prompts(smollm2_dir, CFG)
    assert 1 <= len(first) <= CFG.n_prompts
    assert len({normalize(t) for t in first}) == len(first)
    for text in first:
        content = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert CFG.min_tokens - 1 <= len(content) <= CFG.max_tokens + 1  # re-tokenizing a stripped decode may shift 1
        assert IM_END not in text
    # same seed -> the same samples; excluding the first kept prompt leaves exactly the others
    assert sample_prompts(smollm2_dir, CFG, exclude=[first[0].upper() + "!"]) == first[1:]


def test_write_prompt_dir_round_trip(tmp_path: Path, smollm2_dir: Path, smollm2_tokenizer: Any) -> None:
    texts = ["What is the tallest mountain on Earth?", "Write a haiku about rain."]
    meta_src = tmp_path / "meta_src"
    meta_src.mkdir()
    from eagle3.core.protocol.prepared import META_FILE, PreparedMeta

    meta = PreparedMeta("smollm2", str(smollm2_dir), "t" * 64, "c" * 64, 49152, 8192, "drop", ["self-instruct"])
    (meta_src / META_FILE).write_text(meta.to_json())
    out = write_prompt_dir(texts, tmp_path / "si", smollm2_dir, read_meta(meta_src))
    samples = list(iter_prepared(out))
    assert [s.sample_id for s in samples] == ["si-00000", "si-00001"]
    for sample, text in zip(samples, texts, strict=True):
        prompt = prompt_of(sample)
        assert prompt == render_prompt(smollm2_tokenizer, text)
        assert smollm2_tokenizer.decode(prompt).endswith(f"{text}<|im_end|>\n<|im_start|>assistant\n")
        assert sample.loss_mask.count(1) == 1
