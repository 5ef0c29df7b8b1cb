"""Self-instruct's other openers (``load_openers``: a file or the built-in task list), its id prefix for a
second prompt set, and the MT-Bench filter on what the verifier writes (a scripted ``generate``; the
tokenizer is the embedded SmolLM2's)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from eagle3.client.chat_turns import user_turn_markers
from eagle3.client.self_instruct import (
    TASK_OPENERS,
    OpenersError,
    SelfInstructConfig,
    load_openers,
    sample_prompts,
    write_prompt_dir,
)
from eagle3.client.self_instruct_cli import id_prefix
from eagle3.core.prompt_sets import mt_bench_first_turns, overlapping_prompts
from eagle3.core.protocol.generate import GeneratedReply
from eagle3.core.protocol.prepared import PreparedMeta, iter_prepared


def test_openers_from_the_dataset_the_task_list_or_a_file(tmp_path: Path) -> None:
    assert load_openers("dataset") is None  # the dataset's own first words
    assert load_openers("task") == list(TASK_OPENERS)
    assert not overlapping_prompts(TASK_OPENERS)  # openers alone are no benchmark question
    path = tmp_path / "openers.txt"
    path.write_text("# weighed by repeats\nWrite\n\n  Explain why  \nWrite\n", encoding="utf-8")
    assert load_openers(str(path)) == ["Write", "Explain why", "Write"]


def test_an_openers_file_that_cannot_steer_is_refused_by_name(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing but a comment\n\n", encoding="utf-8")
    with pytest.raises(OpenersError, match=r"empty\.txt: no opener"):
        load_openers(str(empty))
    with pytest.raises(OpenersError, match=r"missing\.txt: not 'dataset', 'task' or a readable UTF-8 file"):
        load_openers(str(tmp_path / "missing.txt"))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Café\n".encode("latin-1"))
    with pytest.raises(OpenersError, match="latin1.txt"):
        load_openers(str(latin1))


def test_id_prefix_keeps_ids_plain_words() -> None:
    assert id_prefix("task") == "task" and id_prefix("si_2") == "si_2"
    for bad in ("", "a~s1", "a-b", "x" * 33, "a b"):
        with pytest.raises(argparse.ArgumentTypeError):
            id_prefix(bad)


class ScriptedVerifier:
    """``generate`` that writes the given user turns, in order, one per sequence, each ended by the
    template's user-turn end token (the sampling is the server's; what is tested here is what
    ``sample_prompts`` keeps). ``prompts`` and ``stop_token_ids`` record what it was asked."""

    def __init__(self, tokenizer: Any, turns: list[str]) -> None:
        end_id = user_turn_markers(tokenizer, "scripted").end_id
        self.replies = [[*tokenizer(t, add_special_tokens=False)["input_ids"], end_id] for t in turns]
        self.requests = 0
        self.prompts: list[list[int]] = []
        self.stop_token_ids: list[list[int]] = []

    def generate(self, prompts: list[list[int]], **kwargs: Any) -> Any:
        batch, self.replies = self.replies[: len(prompts)], self.replies[len(prompts) :]
        self.requests += 1
        self.prompts += prompts
        self.stop_token_ids.append(list(kwargs["stop_token_ids"]))
        replies = tuple(
            GeneratedReply(id=str(i), prompt_tokens=len(p), output_ids=tuple(r), finish_reason="stop")
            for i, (p, r) in enumerate(zip(prompts, batch, strict=False))
        )
        return type("Answer", (), {"replies": replies})()


def test_a_prompt_the_verifier_writes_that_overlaps_mt_bench_is_never_kept(smollm2_tokenizer: Any) -> None:
    bench = mt_bench_first_turns()
    verbatim = bench[0].text  # a benchmark question written word for word
    containing = f"Please help: {bench[5].text}"  # one that contains a benchmark question
    fine = ["Write a poem about the sea.", "Explain why the sky is blue.", "List three uses of copper."]
    turns = [fine[0], verbatim, fine[1], containing, fine[2]]
    cfg = SelfInstructConfig(n_prompts=5, prompts_per_request=5, max_requests=1, max_tokens=400, seed=0)
    verifier = ScriptedVerifier(smollm2_tokenizer, turns)
    kept = sample_prompts(verifier, smollm2_tokenizer, cfg)  # type: ignore[arg-type]
    assert kept == fine
    assert overlapping_prompts([verbatim, containing]) == [
        (verbatim, bench[0].prompt_id),
        (containing, bench[5].prompt_id),
    ]


def test_a_second_prompt_set_takes_its_own_id_prefix(tmp_path: Path, smollm2_tokenizer: Any, smollm2_dir: Path) -> None:
    meta = PreparedMeta("smollm2", str(smollm2_dir), "0" * 64, "0" * 64, 49152, 2048, "drop", ["chats.jsonl"])
    texts = ["Write a haiku.", "Explain tides.", "List prime numbers."]
    write_prompt_dir(
        texts, tmp_path / "task", smollm2_tokenizer, meta, id_ok=lambda i: i != "task-00001", id_prefix="task"
    )
    assert [(s.sample_id, s.source) for s in iter_prepared(tmp_path / "task")] == [
        ("task-00000", texts[0]),
        ("task-00002", texts[1]),  # the id id_ok rejects is skipped
        ("task-00003", texts[2]),
    ]
