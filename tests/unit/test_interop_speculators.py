"""eagle3 features <-> vLLM speculators' offline training data: the directory as speculators' own
trainer reads it (its reading logic reproduced below, cited by file), a round trip that is bitwise
exact both ways (both store the pre-norm final state), a directory speculators wrote itself (holes
in the hs_<row> numbering, no sidecar), and the errors bad input gets."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.core.features_reader import FeaturesReader
from eagle3.core.identity import checkpoint_revision, tokenizer_sha256
from eagle3.draft_trainer.data import FeaturesData
from eagle3.draft_trainer.errors import DataError
from eagle3.draft_trainer.interop import from_specforge, meta_from_model, to_specforge
from eagle3.draft_trainer.interop_speculators import from_speculators, to_speculators
from tests.unit.test_interop_specforge import AUX, HIDDEN, META, features, verifier


def speculators_item(root: Path, index: int) -> dict[str, torch.Tensor]:
    """What speculators' trainer gets for row ``index`` (vllm-project/speculators @ c05b95b3):
    ``src/speculators/train/data.py`` ``ArrowDataset._get_raw_data`` (train_ratio 1.0) reading through
    ``hs_connectors/transfer.py`` ``FileTransfer.get_cached`` (``load_file(hs_<i>.safetensors)``), with
    the checks of ``data_generation/offline.py`` ``check_hidden_states``."""
    data = datasets.load_from_disk(str(root))  # ArrowDataset.__init__
    loaded = load_file(root / "hidden_states" / f"hs_{index}.safetensors")  # FileTransfer.get_cached
    row = data[index]
    assert {"token_ids", "hidden_states"} <= loaded.keys()  # check_hidden_states
    assert loaded["token_ids"].tolist() == row["input_ids"].tolist()
    assert loaded["hidden_states"].shape[0] == len(row["input_ids"]) and torch.isfinite(loaded["hidden_states"]).all()
    assert torch.equal(loaded["token_ids"], row["input_ids"])  # else _get_raw_data drops the sample
    return {
        "hidden_states": loaded["hidden_states"][:, :-1].flatten(1),
        "input_ids": loaded["token_ids"],
        "verifier_last_hidden_states": loaded["hidden_states"][:, -1],
        "loss_mask": row["loss_mask"],
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_round_trip_is_bitwise_and_the_layout_is_speculators(tmp_path: Path) -> None:
    samples = features(tmp_path / "features")
    assert to_speculators(tmp_path / "features", tmp_path / "spec") == len(samples)
    spec = tmp_path / "spec"
    names = {p.name for p in spec.iterdir()}
    assert {"state.json", "dataset_info.json", "token_freq.pt", "eagle3_features.json", "hidden_states"} <= names
    assert sorted(p.name for p in (spec / "hidden_states").iterdir()) == sorted(
        f"hs_{i}.safetensors" for i in range(len(samples))
    )
    data = datasets.load_from_disk(str(spec))
    assert str(data.data.schema.field("input_ids").type) == "list<item: int32>"  # as datasets' own map writes it
    assert str(data.data.schema.field("loss_mask").type) == "list<item: int64>"
    assert str(data.data.schema.field("seq_len").type) == "int64"
    assert json.loads((spec / "state.json").read_text())["_format_type"] == "torch"
    assert list(data.with_format(None)["seq_len"]) == [s.n_tokens for s in samples]  # _compute_approx_lengths

    for index, sample in enumerate(samples):
        raw = load_file(spec / "hidden_states" / f"hs_{index}.safetensors")
        assert set(raw) == {"hidden_states", "token_ids"}
        assert raw["hidden_states"].dtype == torch.bfloat16 and raw["token_ids"].dtype == torch.int64
        item = speculators_item(spec, index)
        n, states = sample.n_tokens, sample.as_torch()
        assert item["hidden_states"].shape == (n, 3 * HIDDEN) and item["verifier_last_hidden_states"].shape == (
            n,
            HIDDEN,
        )
        assert item["input_ids"].dtype == item["loss_mask"].dtype == torch.int64
        assert item["input_ids"].tolist() == sample.input_ids.tolist()
        assert item["loss_mask"].tolist() == sample.loss_mask.tolist()
        for k in range(3):  # the aux taps in aux_layer_ids order, bit for bit
            assert torch.equal(bits(item["hidden_states"][:, k * HIDDEN : (k + 1) * HIDDEN]), bits(states[:, k]))
        assert torch.equal(bits(item["verifier_last_hidden_states"]), bits(states[:, -1]))  # pre-norm, untouched

    # token_freq.pt: speculators' save_token_frequency_distribution over the same rows
    expected: dict[int, int] = {}
    for row in data:
        for t in row["input_ids"][row["loss_mask"].to(torch.bool)].tolist():
            expected[t] = expected.get(t, 0) + 1
    assert torch.load(spec / "token_freq.pt", weights_only=True) == expected

    # back: the same features, every byte of every sample and the identity
    n, skipped = from_speculators(spec, tmp_path / "back")
    assert (n, skipped) == (len(samples), 0)
    back = FeaturesReader(tmp_path / "back", verify=True)
    assert back.meta == META and not back.meta.final_norm_applied
    assert back.sample_ids == [s.sample_id for s in samples]
    for sample in samples:
        got = back[sample.sample_id]
        assert np.array_equal(got.input_ids, sample.input_ids) and np.array_equal(got.loss_mask, sample.loss_mask)
        assert got.input_ids.dtype == np.int32 and got.loss_mask.dtype == np.uint8
        assert np.array_equal(got.hidden_states_bf16, sample.hidden_states_bf16)  # final state too: no norm
    FeaturesData(tmp_path / "back")  # pre-norm: eagle3 train takes it

    # speculators -> eagle3 -> speculators: the hidden-states files byte for byte, the same rows
    assert to_speculators(tmp_path / "back", tmp_path / "spec2") == len(samples)
    for path in (spec / "hidden_states").iterdir():
        assert path.read_bytes() == (tmp_path / "spec2" / "hidden_states" / path.name).read_bytes()
    again = datasets.load_from_disk(str(tmp_path / "spec2"))
    assert again.data.schema.equals(data.data.schema) and again.with_format(None)[:] == data.with_format(None)[:]
    assert torch.load(tmp_path / "spec2" / "token_freq.pt", weights_only=True) == expected


def write_like_speculators(root: Path, rows: list[tuple[list[int], list[int]]], missing: set[int]) -> torch.Tensor:
    """A data directory as speculators writes it: ``preprocessing.py`` (a batched ``map`` returning
    int64 tensors, ``set_format("torch")``, ``save_to_disk``) and vLLM's connector (``save_file`` of
    ``hidden_states`` bf16 ``[n, 4, H]`` and ``token_ids = torch.tensor(list)``); rows in ``missing``
    failed extraction and have no file. Returns every row's states, concatenated."""
    seed = datasets.Dataset.from_dict({"row": list(range(len(rows)))})
    data = seed.map(lambda batch: {"input_ids": [torch.tensor(rows[i][0], dtype=torch.long) for i in batch["row"]],
                                   "loss_mask": [torch.tensor(rows[i][1], dtype=torch.long) for i in batch["row"]],
                                   "seq_len": [len(rows[i][0]) for i in batch["row"]]},
                    batched=True, remove_columns=["row"])  # fmt: skip
    data.set_format(type="torch")
    data.save_to_disk(str(root))
    (root / "hidden_states").mkdir()
    all_states = torch.randn(sum(len(r[0]) for r in rows), len(AUX) + 1, HIDDEN).to(torch.bfloat16)
    start = 0
    for i, (ids, _) in enumerate(rows):
        states = all_states[start : start + len(ids)]
        start += len(ids)
        if i not in missing:
            save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(ids)},
                      str(root / "hidden_states" / f"hs_{i}.safetensors"))  # fmt: skip
    return all_states


def test_a_directory_speculators_wrote_itself(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(5):
        n = int(rng.integers(2, 30))
        rows.append((rng.integers(0, 100, n).tolist(), [0] * (n // 2) + [1] * (n - n // 2)))
    spec = tmp_path / "spec"
    states = write_like_speculators(spec, rows, missing={3})

    with pytest.raises(DataError, match="--model"):  # no sidecar: the identity must be given
        from_speculators(spec, tmp_path / "out")
    with pytest.raises(DataError, match=r"hs_3\.safetensors: missing.*--skip-missing"):
        from_speculators(spec, tmp_path / "out", META)
    assert from_speculators(spec, tmp_path / "out", META, skip_missing=True) == (4, 1)  # resumes the 3 written
    out = FeaturesReader(tmp_path / "out", verify=True)
    assert out.sample_ids == ["hs_0", "hs_1", "hs_2", "hs_4"] and not out.meta.final_norm_applied
    offsets = np.cumsum([0] + [len(r[0]) for r in rows])
    for i in (0, 1, 2, 4):
        got = out[f"hs_{i}"]
        assert got.input_ids.tolist() == rows[i][0] and got.loss_mask.tolist() == rows[i][1]
        assert torch.equal(bits(got.as_torch()), bits(states[offsets[i] : offsets[i + 1]]))
    assert from_speculators(spec, tmp_path / "out", META, skip_missing=True) == (4, 1)  # nothing twice


def test_bad_input_is_named(tmp_path: Path) -> None:
    features(tmp_path / "features", n_samples=2)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(DataError, match="not empty"):
        to_speculators(tmp_path / "features", tmp_path / "busy")
    model, _ = verifier(tmp_path / "verifier")  # post-norm features (through SpecForge) cannot go to speculators
    to_specforge(tmp_path / "features", tmp_path / "sf", model)
    from_specforge(tmp_path / "sf", tmp_path / "postnorm")
    with pytest.raises(DataError, match="post-norm"):
        to_speculators(tmp_path / "postnorm", tmp_path / "never")
    with pytest.raises(DataError, match="state.json"):
        from_speculators(tmp_path / "sf", tmp_path / "never")

    rows = [([1, 2, 3], [0, 1, 1]), ([4, 5], [0, 1])]
    spec = tmp_path / "spec"
    write_like_speculators(spec, rows, missing=set())
    hs0 = spec / "hidden_states" / "hs_0.safetensors"
    good = hs0.read_bytes()

    def rewrite(tensors: dict[str, Any]) -> None:
        save_file(tensors, str(hs0))

    cases: list[tuple[dict[str, Any] | bytes, str]] = [
        ({"hidden_states": torch.zeros(3, 4, HIDDEN, dtype=torch.bfloat16), "token_ids": torch.tensor([1, 2, 9])},
         r"hs_0\.safetensors: token_ids differ from row 0"),
        ({"hidden_states": torch.zeros(3, 5, HIDDEN, dtype=torch.bfloat16), "token_ids": torch.tensor([1, 2, 3])},
         r"hs_0\.safetensors: hidden_states \(3, 5, 32\), expected \(3, 4, 32\).*--aux-layer-ids"),
        ({"states": torch.zeros(3, 4, HIDDEN)}, r"hs_0\.safetensors: holds \['states'\], expected"),
        ({"hidden_states": torch.zeros(3, 4, HIDDEN, dtype=torch.int8), "token_ids": torch.tensor([1, 2, 3])},
         r"hs_0\.safetensors: hidden_states are torch\.int8"),
        (good[:50], r"hs_0\.safetensors: unreadable"),
    ]  # fmt: skip
    for i, (content, message) in enumerate(cases):
        if isinstance(content, bytes):
            hs0.write_bytes(content)
        else:
            rewrite(content)
        with pytest.raises(DataError, match=message):
            from_speculators(spec, tmp_path / f"bad{i}", META)
    hs0.write_bytes(good)
    wide = replace(META, vocab_size=4)
    with pytest.raises(DataError, match=r"row 1: token ids outside \[0, 4\)"):
        from_speculators(spec, tmp_path / "narrow", wide)
    assert from_speculators(spec, tmp_path / "fine", META) == (2, 0)


def tiny_model(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": HIDDEN, "vocab_size": 100}))
    (root / "tokenizer.json").write_text('{"model": {"vocab": {}}}')
    save_file({"model.norm.weight": torch.ones(HIDDEN)}, str(root / "model.safetensors"))
    return root


def test_identity_from_the_verifier(tmp_path: Path) -> None:
    model = tiny_model(tmp_path / "tiny")
    meta = meta_from_model(model, model)
    assert (meta.model_id, meta.aux_layer_ids, meta.final_layer_id) == ("tiny", (2, 4, 5), 8)
    assert (meta.hidden_size, meta.vocab_size, meta.dtype) == (HIDDEN, 100, "bfloat16")
    assert meta.revision == checkpoint_revision(model) and meta.tokenizer_sha256 == tokenizer_sha256(model)
    assert meta_from_model(model, model, [1, 3, 6]).aux_layer_ids == (1, 3, 6)
    with pytest.raises(DataError, match=r"--aux-layer-ids.*\[0, 8\)"):
        meta_from_model(model, model, [1, 3, 8])


def test_convert_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from eagle3.cli import main

    samples = features(tmp_path / "features", n_samples=3)
    model = tiny_model(tmp_path / "tiny")
    assert main(["convert", str(tmp_path / "features"), "--out", str(tmp_path / "spec"), "--to", "speculators"]) == 0
    assert main(["convert", str(tmp_path / "spec"), "--out", str(tmp_path / "back"), "--to", "eagle3"]) == 0
    assert "converted 3 samples" in capsys.readouterr().out
    assert FeaturesReader(tmp_path / "back").sample_ids == [s.sample_id for s in samples]

    (tmp_path / "spec" / "eagle3_features.json").unlink()  # as speculators wrote it: the identity from --model
    (tmp_path / "spec" / "hidden_states" / "hs_1.safetensors").unlink()
    args = ["convert", str(tmp_path / "spec"), "--out", str(tmp_path / "own"), "--to", "eagle3"]
    assert main(args) == 1
    assert "--model" in capsys.readouterr().err
    assert main([*args, "--model", str(model), "--aux-layer-ids", "2,x"]) == 1
    assert "--aux-layer-ids" in capsys.readouterr().err
    assert main([*args, "--model", str(model), "--from", "speculators", "--skip-missing"]) == 0
    assert "1 rows without hidden states skipped" in capsys.readouterr().out
    own = FeaturesReader(tmp_path / "own")
    assert own.sample_ids == ["hs_0", "hs_2"] and own.meta.model_id == "tiny" and own.meta.aux_layer_ids == AUX
    assert main(["convert", str(tmp_path / "features"), "--out", str(tmp_path / "x"), "--to", "speculators",
                 "--model", str(model)]) == 1  # fmt: skip
    assert "leave it out" in capsys.readouterr().err


def test_real_verifier_states_and_the_servers_identity(tmp_path: Path) -> None:
    """States a real (tiny, random) Llama computed through the hf backend: the round trip is bitwise, and
    the identity ``--model`` derives for a directory speculators wrote is the one the server reported."""
    from tests.trainer_helpers import random_samples, tiny_llama_dir, write_features

    model = tiny_llama_dir(tmp_path / "llama", n_layers=8)
    write_features(random_samples(4, 97), tmp_path / "features", model, aux_layer_ids=None)  # the default taps
    original = FeaturesReader(tmp_path / "features")
    assert to_speculators(tmp_path / "features", tmp_path / "spec") == 4
    (tmp_path / "spec" / "eagle3_features.json").unlink()  # now as speculators would have written it
    assert from_speculators(tmp_path / "spec", tmp_path / "back", meta_from_model(model, model)) == (4, 0)
    back = FeaturesReader(tmp_path / "back", verify=True)
    assert back.meta == original.meta  # model name, revision, layers, sizes, tokenizer hash, sample count
    for row, sample in enumerate(original):
        got = back[f"hs_{row}"]
        assert np.array_equal(got.hidden_states_bf16, sample.hidden_states_bf16)
        assert np.array_equal(got.input_ids, sample.input_ids) and np.array_equal(got.loss_mask, sample.loss_mask)


def speculators_vocab(freq: dict[int, int], k: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """speculators' ``train/vocab_mapping.py`` ``build_vocab_mappings_from_distribution`` (@ c05b95b3):
    what its train.py builds from ``token_freq.pt`` when the data path has no d2t.npy/t2d.npy."""
    selected = sorted(freq, key=lambda tid: (-freq[tid], tid))[: min(k, len(freq))]
    if len(selected) < k:
        current = set(selected)
        for tid in range(k):
            if tid not in current:
                selected.append(tid)
            if len(selected) >= k:
                break
    selected.sort()
    d2t = torch.tensor(selected, dtype=torch.long) - torch.arange(k, dtype=torch.long)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


@pytest.mark.parametrize("k", [8, 80])  # 80: more than the distinct supervised tokens, so padded
def test_the_draft_vocab_goes_along(tmp_path: Path, k: int) -> None:
    from eagle3.draft_trainer.vocab import build_draft_vocab, save_vocab

    samples = features(tmp_path / "features", n_samples=7)
    counts = np.zeros(META.vocab_size, dtype=np.int64)
    for s in samples:
        np.add.at(counts, s.input_ids[s.loss_mask == 1], 1)
    vocab, stats = build_draft_vocab(counts, k)
    assert (stats.padded_ids > 0) == (k == 80)
    save_vocab(vocab, stats, counts, tmp_path / "vocab")
    to_speculators(tmp_path / "features", tmp_path / "spec", tmp_path / "vocab")
    d2t = torch.from_numpy(np.load(tmp_path / "spec" / "d2t.npy"))  # speculators' train.py _load_mappings
    t2d = torch.from_numpy(np.load(tmp_path / "spec" / "t2d.npy"))
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and d2t.shape == (k,) and t2d.shape == (100,)
    assert np.array_equal(d2t.numpy(), vocab.d2t) and np.array_equal(t2d.numpy(), vocab.t2d)
    # without the .npy files speculators builds the same vocabulary from token_freq.pt
    built = speculators_vocab(torch.load(tmp_path / "spec" / "token_freq.pt", weights_only=True), k, 100)
    assert torch.equal(built[0], d2t) and torch.equal(built[1], t2d)

    small, small_stats = build_draft_vocab(counts[:50], 8)
    save_vocab(small, small_stats, counts[:50], tmp_path / "small")
    with pytest.raises(DataError, match=r"vocab\.safetensors: t2d covers 50 target ids.*has 100"):
        to_speculators(tmp_path / "features", tmp_path / "spec2", tmp_path / "small")


def test_the_rows_are_chunked_under_arrows_offset_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import eagle3.draft_trainer.interop_speculators as isp

    samples = features(tmp_path / "features")
    to_speculators(tmp_path / "features", tmp_path / "whole")
    monkeypatch.setattr(isp, "CHUNK_TOKENS", 30)  # a list column's offsets are int32: 2**31 - 1 tokens a chunk
    table = isp._rows_table([s.input_ids for s in samples], [s.loss_mask for s in samples])
    assert len(table.column("input_ids").chunks) > 2 and table.num_rows == len(samples)
    to_speculators(tmp_path / "features", tmp_path / "chunked")
    whole, chunked = (datasets.load_from_disk(str(tmp_path / d)) for d in ("whole", "chunked"))
    assert chunked.data.schema.equals(whole.data.schema) and chunked.with_format(None)[:] == whole.with_format(None)[:]
