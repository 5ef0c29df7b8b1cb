"""Reading prompts (client/reading_prompts.py): passages from the training split's first replies of a
distilled dataset, each once, with one instruction before or after it; deterministic; never an MT-Bench
question; written by ``eagle3 reading-prompts`` as prompts ``eagle3 distill`` answers. The SmolLM2
tokenizer and chat template are the real ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eagle3.cli import main
from eagle3.client.chat_turns import user_turn_markers
from eagle3.client.distill import ID_SUFFIX
from eagle3.client.reading_prompts import INSTRUCTIONS, ReadingConfig, cut_passage, passages, reading_prompts
from eagle3.core.identity import tokenizer_sha256
from eagle3.core.prompt_sets import mt_bench_first_turns
from eagle3.core.prompt_sets import render_user_prompt as render_prompt
from eagle3.core.protocol.prepared import (
    PreparedMeta,
    PreparedSample,
    is_heldout,
    iter_prepared,
    variant_id,
    write_prepared,
)

HELDOUT = 0.3
TOPICS = ["rivers", "bread", "comets", "violins", "glaciers", "bees", "lighthouses", "chess", "tides", "moss"]


def reply_text(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return (
        f"Reply {i} is about {topic}. People have studied {topic} for a long time, and there is much to say. "
        f"The first thing to know about {topic} is that they change with the seasons! "
        f"The second thing is that nobody agrees on why"  # stops mid-sentence: the distill token limit
    )


def distilled_dir(root: Path, tokenizer: Any, model_dir: Path, replies: dict[str, str]) -> Path:
    """A distilled dataset: one chat turn per sample, the reply supervised."""
    end_id = user_turn_markers(tokenizer, "SmolLM2").end_id
    samples = []
    for sample_id, reply in replies.items():
        prompt = render_prompt(tokenizer, f"Tell me something ({sample_id})")
        answer = [*tokenizer(reply, add_special_tokens=False)["input_ids"], end_id]
        samples.append(PreparedSample(sample_id, prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    meta = PreparedMeta(
        "SmolLM2-135M-Instruct", str(model_dir), tokenizer_sha256(model_dir), "0" * 64, 49152, 4096, "drop", ["x"]
    )
    write_prepared(root, samples, meta, {})
    return root


@pytest.fixture
def dataset(tmp_path: Path, smollm2_tokenizer: Any, smollm2_dir: Path) -> tuple[Path, dict[str, str]]:
    replies = {f"q-{i:03d}{ID_SUFFIX}": reply_text(i) for i in range(40)}
    replies[variant_id(f"q-000{ID_SUFFIX}", 1)] = "An extra sampled reply. " * 12  # repeats q-000's prompt
    return distilled_dir(tmp_path / "distilled", smollm2_tokenizer, smollm2_dir, replies), replies


def test_a_passage_ends_at_a_sentence_end_within_its_limit(smollm2_tokenizer: Any) -> None:
    text = reply_text(3)
    whole = cut_passage(text, smollm2_tokenizer, 5, 200)
    assert whole == text[: text.index("!") + 1]  # the reply's cut-off tail goes, however short the reply
    short = cut_passage(text, smollm2_tokenizer, 5, 20)  # the limit falls in the second sentence
    assert short == text[: text.index(".") + 1]
    assert cut_passage(text, smollm2_tokenizer, 30, 20) is None  # what is left is under the minimum
    assert cut_passage("no sentence end at all in this reply", smollm2_tokenizer, 1, 100) is None


def test_passages_are_the_training_splits_first_replies(
    dataset: tuple[Path, dict[str, str]], smollm2_tokenizer: Any
) -> None:
    root, replies = dataset
    got = passages(smollm2_tokenizer, root, HELDOUT, ReadingConfig(min_passage_tokens=5))
    trained = [sid for sid in replies if "~" not in sid and not is_heldout(sid, HELDOUT)]
    held = [sid for sid in replies if "~" not in sid and is_heldout(sid, HELDOUT)]
    assert held and trained, "the split must have both sides for this test to mean anything"
    assert got == [cut_passage(replies[sid], smollm2_tokenizer, 5, 160) for sid in trained]
    assert not any("extra sampled reply" in p for p in got)
    for sid in held:  # no held-out reply lends a passage
        assert not any(p.startswith(f"Reply {int(sid[2:5])} is") for p in got)


def test_prompts_pair_each_passage_once_with_an_instruction_deterministically() -> None:
    texts = [f"Passage {i} talks about {TOPICS[i % 10]} at some length. It ends here." for i in range(30)]
    config = ReadingConfig(n_prompts=20, seed=3)
    first = reading_prompts(texts, config)
    assert first == reading_prompts(texts, config)  # the same seed, the same prompts
    assert first != reading_prompts(texts, ReadingConfig(n_prompts=20, seed=4))
    assert len(first) == 20
    used = []
    for prompt in first:
        head, tail = prompt.split("\n\n")
        instruction, passage = (head, tail) if head in INSTRUCTIONS else (tail, head)
        assert instruction in INSTRUCTIONS and passage in texts
        used.append(passage)
    assert len(set(used)) == len(used)
    forms = {prompt.split("\n\n")[0] in INSTRUCTIONS for prompt in first}
    assert forms == {True, False}  # the instruction comes first in some prompts and last in others


def test_no_prompt_holds_an_mt_bench_question() -> None:
    question = mt_bench_first_turns()[0].text
    texts = [question, "A harmless passage about moss. It grows on stones."]
    prompts = reading_prompts(texts, ReadingConfig(n_prompts=10))
    assert len(prompts) == 1 and "moss" in prompts[0]


def test_the_command_writes_prompts_that_distill_answers_and_that_train(
    dataset: tuple[Path, dict[str, str]], tmp_path: Path, smollm2_tokenizer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = dataset
    out = tmp_path / "rd"
    args = ["reading-prompts", str(root), "--out", str(out), "--min-passage-tokens", "5"]
    assert main([*args, "--heldout-fraction", str(HELDOUT), "--prompts", "8"]) == 0
    assert "8 reading prompts" in capsys.readouterr().out
    end_id = user_turn_markers(smollm2_tokenizer, "SmolLM2").end_id
    samples = list(iter_prepared(out))
    assert len(samples) == 8
    for sample in samples:
        assert sample.sample_id.startswith("rd-")
        assert not is_heldout(sample.sample_id + ID_SUFFIX, HELDOUT)  # its distilled answer trains
        assert sample.input_ids == [*render_prompt(smollm2_tokenizer, sample.source), end_id]
        assert sample.loss_mask == [0] * (len(sample.input_ids) - 1) + [1]
    assert json.loads((out / "stats.json").read_text())["source"] == "reading"
    # the prompts themselves are no distilled dataset (one placeholder token supervised): refused, named
    assert main(["reading-prompts", str(out), "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "eagle3 distill output" in err and not (tmp_path / "again").exists()
    assert main([*args, "--min-passage-tokens", "50", "--max-passage-tokens", "10"]) == 2  # refused, named
    assert "min_passage_tokens <= max_passage_tokens" in capsys.readouterr().err
