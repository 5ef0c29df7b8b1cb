"""Self-instruct prompts sampled from the embedded verifier through a live ``eagle3 serve`` (hf, SmolLM2,
fp32): filtered, deterministic, steered by openers, stored as prepared data that ``eagle3 distill`` answers."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.distill_inprocess import prompt_of
from eagle3.client.chat_turns import user_turn_markers
from eagle3.client.distill import DistillConfig, distill_dataset
from eagle3.client.sdk import ExtractionClient
from eagle3.client.self_instruct import (
    SelfInstructConfig,
    is_acceptable,
    openers_and_turns,
    sample_prompts,
    user_turns,
    write_prompt_dir,
)
from eagle3.core.prompt_sets import normalize
from eagle3.core.prompt_sets import render_user_prompt as render_prompt
from eagle3.core.protocol.prepared import (
    META_FILE,
    PreparedFormatError,
    PreparedMeta,
    concat_prepared,
    is_heldout,
    iter_prepared,
    read_meta,
)
from tests.e2e.live_server import LiveServer, smollm2_generate_server

pytestmark = pytest.mark.integration

CFG = SelfInstructConfig(n_prompts=8, prompts_per_request=8, max_requests=1, max_tokens=24, seed=7)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[LiveServer]:
    with smollm2_generate_server(tmp_path_factory.mktemp("server"), smollm2_dir) as live:
        yield live


@pytest.fixture
def client(server: LiveServer) -> Iterator[ExtractionClient]:
    with ExtractionClient(server.url) as c:
        yield c


def test_filters() -> None:
    assert normalize("  What IS   a Cat?! ") == "what is a cat"
    assert is_acceptable([1, 2, 3, 4], "What is it", 4, 40)
    assert not is_acceptable([1, 2, 3], "What is", 4, 40)  # too short
    assert not is_acceptable(list(range(41)), "x" * 41, 4, 40)  # too long
    assert not is_acceptable([5, 5, 5, 5, 6], "hi hi hi hi ho", 4, 40)  # degenerate repeat
    assert not is_acceptable([1, 2, 3, 4], "1 2 3 4", 4, 40)  # no letters


def test_prefix_is_the_user_turn_start(smollm2_tokenizer: Any) -> None:
    prefix = user_turn_markers(smollm2_tokenizer, "SmolLM2").prefix
    assert prefix.endswith("<|im_start|>user\n")
    assert "<|im_start|>system\n" in prefix  # the template's default system turn comes first


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="min_tokens <= max_tokens"):
        SelfInstructConfig(min_tokens=9, max_tokens=8)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SelfInstructConfig(temperature=0.0)


def test_sampled_prompts_deterministic_filtered_and_excluded(client: ExtractionClient, smollm2_tokenizer: Any) -> None:
    first = sample_prompts(client, smollm2_tokenizer, CFG)
    assert 1 <= len(first) <= CFG.n_prompts
    assert len({normalize(t) for t in first}) == len(first)
    for text in first:
        content = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert CFG.min_tokens - 1 <= len(content) <= CFG.max_tokens + 1  # re-tokenizing a stripped decode may shift 1
        assert "<|im_end|>" not in text
    # same seed -> the same samples; excluding the first kept prompt leaves exactly the others
    assert sample_prompts(client, smollm2_tokenizer, CFG, exclude=[first[0].upper() + "!"]) == first[1:]


def test_write_prompt_dir_round_trip(tmp_path: Path, smollm2_dir: Path, smollm2_tokenizer: Any) -> None:
    texts = ["What is the tallest mountain on Earth?", "Write a haiku about rain."]
    meta = PreparedMeta("smollm2", str(smollm2_dir), "t" * 64, "c" * 64, 49152, 8192, "drop", ["chatterbot"])
    out = write_prompt_dir(texts, tmp_path / "si", smollm2_tokenizer, meta, id_ok=lambda i: i != "si-00001")
    samples = list(iter_prepared(out))
    assert [s.sample_id for s in samples] == ["si-00000", "si-00002"]  # the rejected id is skipped
    assert read_meta(out).inputs == ["self-instruct"]
    assert read_meta(out).max_length == max(s.n_tokens for s in samples)
    for sample, text in zip(samples, texts, strict=True):
        prompt = prompt_of(sample)
        assert prompt == render_prompt(smollm2_tokenizer, text)
        assert smollm2_tokenizer.decode(prompt).endswith(f"{text}<|im_end|>\n<|im_start|>assistant\n")
        assert sample.loss_mask.count(1) == 1


def test_openers_steer_every_prompt(client: ExtractionClient, smollm2_tokenizer: Any) -> None:
    # two openers of different token lengths: the request's prompts differ in length (left-padded server-side)
    openers = ["Which", "Do you"]
    assert len(smollm2_tokenizer("Which", add_special_tokens=False)["input_ids"]) != len(
        smollm2_tokenizer("Do you", add_special_tokens=False)["input_ids"]
    )
    # 8 sequences of at most 24 tokens per call (each call is a generate request: the test's cost)
    cfg = SelfInstructConfig(n_prompts=8, prompts_per_request=8, max_requests=1, max_tokens=24, seed=3)
    steered = sample_prompts(client, smollm2_tokenizer, cfg, openers=openers)
    assert len(steered) >= 4  # most sequences end their turn within 24 tokens
    assert all(text.startswith(tuple(openers)) for text in steered)
    assert {o for o in openers if any(t.startswith(o) for t in steered)} == set(openers)  # both drawn
    assert sample_prompts(client, smollm2_tokenizer, cfg, openers=openers) == steered  # seeded: same draw and samples
    blank = sample_prompts(client, smollm2_tokenizer, cfg, openers=[" ", ""])  # blank openers: unsteered
    assert blank == sample_prompts(client, smollm2_tokenizer, cfg)
    assert not all(text.startswith(tuple(openers)) for text in blank)


def test_prompts_distill_and_concat_with_chat_data(tmp_path: Path, server: LiveServer, client: ExtractionClient,
                                                   smollm2_dir: Path, smollm2_tokenizer: Any) -> None:  # fmt: skip
    """The prompt directory is what ``eagle3 distill`` answers; the answers concatenate with other
    distilled data of the same tokenizer, and a directory of another tokenizer is refused."""
    from eagle3.client.prepare import PrepareConfig, prepare_dataset
    from tests.conftest import write_jsonl

    chats = write_jsonl(
        tmp_path / "chats.jsonl",
        [{"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]}],
    )
    prepare_dataset(str(chats), tmp_path / "prepared", model=str(smollm2_dir), config=PrepareConfig(overwrite=True))
    texts = ["Which river is the longest?", "Do you like music?"]
    write_prompt_dir(texts, tmp_path / "si", smollm2_tokenizer, read_meta(tmp_path / "prepared"))
    config = DistillConfig(max_new_tokens=8, prompts_per_request=2)
    distill_dataset(tmp_path / "si", tmp_path / "si-distilled", client, config=config)
    distill_dataset(tmp_path / "prepared", tmp_path / "distilled", client, config=config)
    answers = list(iter_prepared(tmp_path / "si-distilled"))
    assert [a.sample_id for a in answers] == ["si-00000-distill", "si-00001-distill"]
    for answer, text in zip(answers, texts, strict=True):
        assert prompt_of(answer) == render_prompt(smollm2_tokenizer, text)
        assert 1 <= answer.n_assistant_tokens <= 8 + 1  # the verifier's reply (plus the template's newline)
    n = concat_prepared([tmp_path / "distilled", tmp_path / "si-distilled"], tmp_path / "train-data")
    merged = list(iter_prepared(tmp_path / "train-data"))
    assert n == len(merged) == 3 and [s.sample_id for s in merged[1:]] == [a.sample_id for a in answers]
    assert merged[1:] == answers
    assert read_meta(tmp_path / "train-data").max_length == max(s.n_tokens for s in merged)
    other = tmp_path / "other"
    other.mkdir()
    meta = read_meta(tmp_path / "prepared")
    (other / META_FILE).write_text(PreparedMeta(**{**meta.__dict__, "tokenizer_sha256": "0" * 64}).to_json())
    (other / "samples.jsonl").write_text("")
    with pytest.raises(PreparedFormatError, match="another tokenizer"):
        concat_prepared([tmp_path / "distilled", other], tmp_path / "bad")
    assert not (tmp_path / "bad" / "samples.jsonl").exists()


WORDS = ["Why", "What", "Who", "Where", "When", "How", "Tell", "Do", "Can", "Is", "Are", "Will", "Should", "Could",
         "Would", "Please", "Name", "Give", "List", "Explain", "Describe", "Write", "Show", "Find", "Compare",
         "Imagine", "Suppose", "Guess", "Say", "Help"]  # fmt: skip


def test_demo_self_instruct_adds_training_samples_only(tmp_path: Path, server: LiveServer, smollm2_dir: Path,
                                                        smollm2_tokenizer: Any) -> None:  # fmt: skip
    """``eagle3 demo --self-instruct``: openers come from training-split prompts only, no new prompt equals a
    dataset prompt, no new sample lands in the held-out split, and the training data is both sets."""
    from eagle3.client.prepare import PrepareConfig, prepare_dataset
    from eagle3.client.self_instruct import TASK_OPENERS
    from eagle3.demo import DEMO_HELDOUT_FRACTION, add_self_instruct
    from tests.conftest import write_jsonl

    turns = [f"{w} about the weather" for w in WORDS]
    rows = [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": "Ok"}]} for t in turns]
    chats = write_jsonl(tmp_path / "chats.jsonl", rows)
    prepare_dataset(str(chats), tmp_path / "prepared", model=str(smollm2_dir), config=PrepareConfig(overwrite=True))
    config = DistillConfig(max_new_tokens=4, prompts_per_request=16)
    distill_dataset(tmp_path / "prepared", tmp_path / "distilled", server.url, config=config)
    distilled = list(iter_prepared(tmp_path / "distilled"))
    assert [user_turns(smollm2_tokenizer, prompt_of(s)) for s in distilled] == [[t] for t in turns]
    held_words = {WORDS[i] for i, s in enumerate(distilled) if is_heldout(s.sample_id, DEMO_HELDOUT_FRACTION)}
    assert held_words  # the hash holds some of these prompts out, so the opener rule is exercised
    train_words = set(WORDS) - held_words
    openers, dataset_turns = openers_and_turns(smollm2_tokenizer, tmp_path / "distilled", DEMO_HELDOUT_FRACTION)
    assert openers == [w for w in WORDS if w not in held_words] and dataset_turns == turns

    # replies of 8 tokens (the demo's 48 cost time here and test nothing more)
    train_data = add_self_instruct(
        tmp_path, tmp_path / "distilled", server.url, n_prompts=12, n_task_prompts=4, reply_tokens=8
    )
    new = list(iter_prepared(tmp_path / "self-instruct-distilled"))
    task = list(iter_prepared(tmp_path / "task-prompts-distilled"))  # --task-prompts: a second set, its own ids
    assert 1 <= len(task) <= 4 and all(s.sample_id.startswith("task-") for s in task)
    assert all(s.source.startswith(TASK_OPENERS) for s in iter_prepared(tmp_path / "task-prompts"))
    assert not any(is_heldout(s.sample_id, DEMO_HELDOUT_FRACTION) for s in task)
    assert 6 <= len(new) <= 12
    assert not any(is_heldout(s.sample_id, DEMO_HELDOUT_FRACTION) for s in new)
    texts = [s.source for s in iter_prepared(tmp_path / "self-instruct")]
    assert all(t.startswith(tuple(train_words)) for t in texts)  # steered by training prompts only
    assert not any(re.match(rf"{h}\b", t) for h in held_words for t in texts)
    assert not {normalize(t) for t in texts} & {normalize(t) for t in turns}
    assert [s.sample_id for s in iter_prepared(train_data)] == [s.sample_id for s in distilled + new + task]


def test_cli_writes_steered_training_prompts(tmp_path: Path, server: LiveServer, smollm2_dir: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """``eagle3 self-instruct PREPARED --server URL --out DIR``: the prompt directory ``eagle3 distill``
    reads; a missing server is a usage error; data of another tokenizer is refused before any request.
    The first run is the command as a user types it; the others call the same entry point in-process."""
    import json
    import subprocess
    import sys

    from eagle3.cli import main
    from eagle3.client.prepare import PrepareConfig, prepare_dataset
    from eagle3.client.self_instruct import TASK_OPENERS
    from tests.conftest import write_jsonl

    def run(*extra: str) -> tuple[int, str, str]:
        status = main(["self-instruct", str(tmp_path / "prepared"), *extra])
        out, err = capsys.readouterr()
        return status, out, err

    turns = [f"{w} about the weather" for w in WORDS]
    rows = [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": "Ok"}]} for t in turns]
    chats = write_jsonl(tmp_path / "chats.jsonl", rows)
    prepare_dataset(str(chats), tmp_path / "prepared", model=str(smollm2_dir), config=PrepareConfig(overwrite=True))
    # 16 sequences per request (the default 64 is for throughput): up to 4 requests of 16 for 6 prompts
    si = ["--server", server.url, "--out", str(tmp_path / "si"), "--prompts", "6", "--heldout-fraction", "0.2",
          "--prompts-per-request", "16"]  # fmt: skip
    cmd = [sys.executable, "-m", "eagle3", "self-instruct", str(tmp_path / "prepared"), *si]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "prompts (steered by" in first.stdout and f"eagle3 distill {tmp_path / 'si'}" in first.stdout
    samples = list(iter_prepared(tmp_path / "si"))
    assert 1 <= len(samples) <= 6
    assert not any(is_heldout(s.sample_id + "-distill", 0.2) for s in samples)
    prepared = list(iter_prepared(tmp_path / "prepared"))
    train_words = tuple(w for w, s in zip(WORDS, prepared, strict=True) if not is_heldout(s.sample_id, 0.2))
    assert len(train_words) < len(WORDS) and all(s.source.startswith(train_words) for s in samples)

    # the same command again reuses the prompts (no request: the server generates no token); another seed samples
    written, before = (tmp_path / "si" / "samples.jsonl").read_bytes(), tokens_generated(server.url)
    status, out, err = run(*si)
    assert status == 0 and "reused" in out, out + err
    assert tokens_generated(server.url) == before and (tmp_path / "si" / "samples.jsonl").read_bytes() == written
    status, out, err = run(*si, "--seed", "1")
    assert status == 0 and "reused" not in out, out + err
    assert tokens_generated(server.url) > before
    (tmp_path / "si" / "self-instruct.json").write_text('{"prepared": ')  # torn: no reuse, and no crash either
    status, out, err = run(*si, "--seed", "1")
    assert status == 0 and "reused" not in out, out + err
    assert json.loads((tmp_path / "si" / "self-instruct.json").read_text())["settings"]["seed"] == 1

    # a second set for the same data: general instruction openers, its own ids (concatenates with the first)
    task = ["--server", server.url, "--out", str(tmp_path / "task"), "--prompts", "6", "--heldout-fraction", "0.2",
            "--prompts-per-request", "16"]  # fmt: skip
    status, out, err = run(*task, "--openers", "task", "--id-prefix", "task", "--max-tokens", "40")
    assert status == 0 and f"steered by {len(TASK_OPENERS)} openers" in out, out + err
    task_samples = list(iter_prepared(tmp_path / "task"))
    assert task_samples and all(s.sample_id.startswith("task-") for s in task_samples)
    assert all(s.source.startswith(TASK_OPENERS) for s in task_samples)
    assert concat_prepared([tmp_path / "si", tmp_path / "task"], tmp_path / "both") == len(samples) + len(task_samples)
    (tmp_path / "blank.txt").write_text("# no opener here\n")
    status, _, err = run(*task, "--openers", str(tmp_path / "blank.txt"))
    assert status == 2 and f"{tmp_path / 'blank.txt'}: no opener" in err, err

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("EAGLE3_SERVER_URL", raising=False)
        status, _, err = run("--out", str(tmp_path / "x"))
    assert status == 2 and "--server URL is required" in err
    with pytest.raises(SystemExit) as usage:
        run("--server", server.url, "--out", str(tmp_path / "x"), "--top-p", "1.5")
    assert usage.value.code == 2
    assert "argument --top-p: expected a number in (0, 1], got 1.5" in capsys.readouterr().err
    meta = json.loads((tmp_path / "prepared" / META_FILE).read_text())
    (tmp_path / "prepared" / META_FILE).write_text(json.dumps({**meta, "tokenizer_sha256": "0" * 64}))
    status, _, err = run("--server", server.url, "--out", str(tmp_path / "y"))
    assert status == 1 and "prepared for another tokenizer" in err
    assert not (tmp_path / "y").exists()


def tokens_generated(url: str) -> float:
    """The server's ``eagle3_tokens_generated_total``, summed over tenants."""
    import httpx

    lines = httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("eagle3_tokens_generated_total{"))
