"""eagle3 prepare on real input shapes with the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from eagle3.client.prepare import PrepareConfig, PrepareError, prepare_dataset
from eagle3.core.models import DEFAULT_MODEL, ModelNotFoundError
from eagle3.core.protocol import PreparedFormatError, iter_prepared, read_meta
from tests.conftest import read_jsonl, write_jsonl

pytestmark = pytest.mark.integration

ROWS: list[dict[str, Any]] = [
    {"id": "a", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "2+2?"},
            {"from": "gpt", "value": "4"},
            {"from": "human", "value": "3+3?"},
            {"from": "gpt", "value": "6"},
        ]
    },
    {"prompt": "Name a colour.", "response": "Blue."},
]


def prepare(tmp_path: Path, rows: list[Any], tokenizer: Any, **config: Any) -> tuple[Path, dict[str, Any]]:
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "prepared"
    stats = prepare_dataset(str(src), out, model=DEFAULT_MODEL, config=PrepareConfig(**config), tokenizer=tokenizer)
    return out, stats.to_dict()


def test_three_shapes_to_samples_meta_and_stats(tmp_path, smollm2_tokenizer, smollm2_dir):
    out, stats = prepare(tmp_path, ROWS, smollm2_tokenizer)
    samples = list(iter_prepared(out, vocab_size=49152))
    assert [s.sample_id for s in samples] == ["line1", "line2", "line3"]
    assert samples[0].source.endswith("in.jsonl:1 (id=a)")
    decoded = [
        smollm2_tokenizer.decode([t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m]) for s in samples
    ]
    assert decoded == ["Hello!<|im_end|>\n", "4<|im_end|>\n6<|im_end|>\n", "Blue.<|im_end|>\n"]
    assert stats["samples_kept"] == 3 and stats["samples_dropped"] == 0
    assert stats["total_tokens"] == sum(s.n_tokens for s in samples)
    assert stats["assistant_tokens"] == sum(s.n_assistant_tokens for s in samples)
    assert json.loads((out / "stats.json").read_text()) == stats
    meta = read_meta(out)
    assert meta.vocab_size == 49152 and meta.max_length == 8192  # the model's context by default
    assert Path(meta.model_dir) == smollm2_dir and len(meta.tokenizer_sha256) == 64
    assert not (out / "samples.jsonl.partial").exists()


def test_malformed_row_fails_with_file_and_line_and_publishes_nothing(tmp_path, smollm2_tokenizer):
    rows = [ROWS[0], "{broken", ROWS[2]]
    with pytest.raises(PrepareError, match=r"in\.jsonl:2: invalid JSON"):
        prepare(tmp_path, rows, smollm2_tokenizer)
    out = tmp_path / "prepared"
    assert not (out / "samples.jsonl").exists()  # no half-written dataset under the final name
    assert len(read_jsonl(out / "samples.jsonl.partial")) == 1  # what was written survives
    with pytest.raises(PreparedFormatError, match="did not finish"):
        list(iter_prepared(out))


def test_skip_counts_malformed_rows_and_names_them(tmp_path, smollm2_tokenizer):
    rows = [ROWS[0], "{broken", {"messages": [{"role": "user", "content": "no answer"}]}, ROWS[2]]
    out, stats = prepare(tmp_path, rows, smollm2_tokenizer, on_error="skip")
    assert stats["samples_kept"] == 2
    assert stats["dropped_by_reason"] == {"malformed": 2}
    examples = stats["malformed_examples"]
    assert examples[0].endswith(
        "in.jsonl:2: invalid JSON (Expecting property name enclosed in double quotes at column 2)"
    )
    assert examples[1].endswith("in.jsonl:3: conversation has no assistant turn")
    assert [s.sample_id for s in iter_prepared(out)] == ["line1", "line4"]


def test_max_length_drop_and_truncate(tmp_path, smollm2_tokenizer):
    long_answer = " ".join(["word"] * 200)
    rows = [ROWS[0], {"prompt": "Say word a lot.", "response": long_answer}]
    _, dropped = prepare(tmp_path, rows, smollm2_tokenizer, max_length=64)
    assert dropped["samples_kept"] == 1 and dropped["dropped_by_reason"] == {"too_long": 1}

    out, kept = prepare(tmp_path, rows, smollm2_tokenizer, max_length=64, overlong="truncate", overwrite=True)
    assert kept["samples_kept"] == 2 and kept["samples_truncated"] == 1
    samples = list(iter_prepared(out))
    assert samples[1].n_tokens == 64 and samples[1].loss_mask[-1] == 1 and kept["length"]["max"] == 64


def test_truncation_that_removes_every_assistant_token_drops_the_sample(tmp_path, smollm2_tokenizer):
    rows = [{"prompt": "x " * 100, "response": "y"}, ROWS[0]]
    out, stats = prepare(tmp_path, rows, smollm2_tokenizer, max_length=40, overlong="truncate")
    assert stats["dropped_by_reason"] == {"no_assistant_tokens_after_truncation": 1}
    assert [s.sample_id for s in iter_prepared(out)] == ["line2"]


def test_limit_reads_only_the_first_rows(tmp_path, smollm2_tokenizer):
    out, stats = prepare(tmp_path, ROWS * 10, smollm2_tokenizer, limit=4)
    assert stats["rows_read"] == 4
    assert [s.sample_id for s in iter_prepared(out)] == ["line1", "line2", "line3", "line4"]


def test_existing_output_needs_overwrite(tmp_path, smollm2_tokenizer):
    prepare(tmp_path, ROWS, smollm2_tokenizer)
    with pytest.raises(PrepareError, match="already exists; pass --overwrite"):
        prepare(tmp_path, ROWS, smollm2_tokenizer)


def test_nothing_kept_is_an_error(tmp_path, smollm2_tokenizer):
    with pytest.raises(PrepareError, match="no sample was kept"):
        prepare(tmp_path, [ROWS[0]], smollm2_tokenizer, max_length=5)


def test_saved_datasets_dataset_and_dataset_dict(tmp_path, smollm2_tokenizer):
    datasets = pytest.importorskip("datasets")
    rows = [ROWS[0], ROWS[2]]
    ds = datasets.Dataset.from_list([{"messages": ROWS[0]["messages"]}] * 3)
    ds.save_to_disk(str(tmp_path / "ds"))
    stats = prepare_dataset(str(tmp_path / "ds"), tmp_path / "o1", model=DEFAULT_MODEL, tokenizer=smollm2_tokenizer)
    assert stats.kept == 3
    assert [s.sample_id for s in iter_prepared(tmp_path / "o1")] == ["row0", "row1", "row2"]

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": "a", "response": "b"}]),
            "test": datasets.Dataset.from_list([rows[1]] * 2),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    stats = prepare_dataset(
        str(tmp_path / "dd"),
        tmp_path / "o2",
        model=DEFAULT_MODEL,
        tokenizer=smollm2_tokenizer,
        config=PrepareConfig(split="test"),
    )
    assert stats.kept == 2
    assert next(iter_prepared(tmp_path / "o2")).source.endswith("dd[test] row 0")
    with pytest.raises(Exception, match=r"has splits \['test', 'train'\]"):
        prepare_dataset(
            str(tmp_path / "dd"),
            tmp_path / "o3",
            model=DEFAULT_MODEL,
            tokenizer=smollm2_tokenizer,
            config=PrepareConfig(split="validation"),
        )


def local_checkpoint(tmp_path: Path, smollm2_dir: Path, vocab_size: int) -> Path:
    """A local HF checkpoint directory: SmolLM2's tokenizer files and a config of our own."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, ckpt / name)
    config = json.loads((smollm2_dir / "config.json").read_text())
    config.update(vocab_size=vocab_size, max_position_embeddings=512)
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


def test_any_local_checkpoint_directory(tmp_path, smollm2_dir):
    ckpt = local_checkpoint(tmp_path, smollm2_dir, vocab_size=50000)
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    prepare_dataset(str(src), tmp_path / "out", model=str(ckpt))
    meta = read_meta(tmp_path / "out")
    assert meta.vocab_size == 50000 and meta.max_length == 512 and meta.model_dir == str(ckpt)


def test_token_ids_outside_the_model_vocab_are_fatal(tmp_path, smollm2_dir):
    ckpt = local_checkpoint(tmp_path, smollm2_dir, vocab_size=100)
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    with pytest.raises(
        PrepareError,
        match=r"in\.jsonl:1: the tokenizer produced token id \d+, outside the model's vocabulary of 100",
    ):
        prepare_dataset(str(src), tmp_path / "out", model=str(ckpt))


def test_unknown_model_is_not_downloaded(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        prepare_dataset(str(src), tmp_path / "out", model="meta-llama/Llama-3.1-8B-Instruct")


def test_memory_does_not_grow_with_the_dataset(tmp_path, smollm2_tokenizer):
    """Peak Python heap while preparing 4,000 rows stays near the peak for 400 rows (streaming)."""

    def peak_bytes(n_rows: int, name: str) -> int:
        rows = (
            {"prompt": f"Question number {i}?", "response": f"Answer number {i}, " * (1 + i % 20)}
            for i in range(n_rows)
        )
        src = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        tracemalloc.start()
        try:
            prepare_dataset(str(src), tmp_path / name, model=DEFAULT_MODEL, tokenizer=smollm2_tokenizer)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, large = peak_bytes(400, "small"), peak_bytes(4000, "large")
    assert large < small * 1.5 + (1 << 20), (small, large)


def test_several_inputs_keep_ids_unique(tmp_path, smollm2_tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    b = write_jsonl(tmp_path / "b.jsonl", ROWS[2:] + ROWS[:1])
    stats = prepare_dataset([str(a), str(b)], tmp_path / "out", model=DEFAULT_MODEL, tokenizer=smollm2_tokenizer)
    ids = [s.sample_id for s in iter_prepared(tmp_path / "out")]
    assert ids == ["0/line1", "0/line2", "1/line1", "1/line2"]
    assert stats.rows_read == 4
    assert read_meta(tmp_path / "out").inputs == [str(a), str(b)]


def test_full_disk_is_a_clear_error(tmp_path, smollm2_tokenizer):
    """/dev/full fails every write with ENOSPC, as a full disk does."""
    out = tmp_path / "prepared"
    out.mkdir()
    (out / "samples.jsonl.partial").symlink_to("/dev/full")
    src = write_jsonl(tmp_path / "in.jsonl", ROWS * 2000)  # more than one write buffer
    with pytest.raises(PrepareError, match="disk full while writing .*samples.jsonl.partial"):
        prepare_dataset(str(src), out, model=DEFAULT_MODEL, tokenizer=smollm2_tokenizer)
    assert not (out / "samples.jsonl").exists()


def test_worker_processes_give_identical_output(tmp_path, smollm2_tokenizer):
    """Two spawned tokenizing processes write byte-for-byte what one process writes, in order,
    malformed rows and length drops included."""
    rows: list[Any] = []
    for i in range(300):
        rows.append({"prompt": f"Question {i}?", "response": "word " * (i % 50)})
        if i % 97 == 0:
            rows.append("{broken")
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    outputs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        config = PrepareConfig(workers=workers, on_error="skip", max_length=60)
        stats = prepare_dataset(str(src), out, model=DEFAULT_MODEL, tokenizer=smollm2_tokenizer, config=config)
        outputs.append(((out / "samples.jsonl").read_bytes(), stats.to_dict()))
    assert outputs[0] == outputs[1]
    assert outputs[0][1]["dropped_by_reason"]["malformed"] == 4
    assert outputs[0][1]["dropped_by_reason"]["too_long"] > 0


def test_worker_processes_stop_at_the_first_malformed_row(tmp_path, smollm2_tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS * 100 + ["{broken"] + ROWS * 100)
    with pytest.raises(PrepareError, match=r"in\.jsonl:301: invalid JSON"):
        prepare_dataset(
            str(src),
            tmp_path / "out",
            model=DEFAULT_MODEL,
            tokenizer=smollm2_tokenizer,
            config=PrepareConfig(workers=2),
        )


def test_a_dead_worker_is_an_error_not_a_hang(tmp_path, smollm2_tokenizer):
    from eagle3.client.prepare_workers import WorkerError, tokenize_rows
    from eagle3.core.conversations import iter_rows
    from eagle3.core.masking import ChatTokenizer

    src = write_jsonl(tmp_path / "in.jsonl", ROWS * 50)
    rows = iter_rows(str(src))  # the workers cannot load a tokenizer from a missing directory
    with pytest.raises(WorkerError, match="worker process died"):
        list(tokenize_rows(rows, ChatTokenizer(smollm2_tokenizer), workers=2, model_dir=str(tmp_path / "missing")))
