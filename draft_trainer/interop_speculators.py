"""Converters between an eagle3 features directory and vLLM speculators' offline training data.

speculators' layout (github vllm-project/speculators, read at commit c05b95b3, 2026-08-20): one
directory, the ``--output`` of ``scripts/prepare_data.py``, which its offline generator
(``scripts/data_generation_offline.py``) fills and its trainer (``scripts/train.py --data-path``) reads:

* ``data-*.arrow``, ``dataset_info.json``, ``state.json``: ``prepare_data.py``'s ``Dataset.save_to_disk``,
  one row per sample: ``input_ids`` ``list<int32>``, ``loss_mask`` ``list<int64>`` (1 = assistant
  token), ``seq_len`` int64; format ``torch`` (``preprocessing.py`` ``_append_row``,
  ``build_speculator_training_dataset``).
* ``token_freq.pt``: ``torch.save`` of ``{token_id: count}`` over the tokens whose ``loss_mask`` is 1
  (``train/vocab_mapping.py`` ``save_token_frequency_distribution``).
* ``hidden_states/hs_<row>.safetensors``: written by vLLM's ``ExampleHiddenStatesConnector`` (the
  ``kv_transfer_config`` of ``launch_vllm.py``), moved there by ``data_generation_offline.py``
  ``worker``: ``hidden_states`` ``[n, L, H]`` in the model's dtype (bf16) and ``token_ids`` int64
  ``[n]``, no metadata.

(``input_ids`` is ``list<int32>`` because ``datasets.arrow_writer.OptimizedTypedSequence`` narrows the
column of that name; the torch format hands it out as int64.) The trainer's reader is
``train/data.py`` ``ArrowDataset._get_raw_data`` with ``hs_connectors/transfer.py`` ``FileTransfer``:
row ``i`` (``load_from_disk``) pairs with ``hs_<i>.safetensors`` (``load_file``); a row whose
``token_ids`` differ from its ``input_ids`` is dropped; it trains on ``hidden_states[:, :-1].flatten(1)``
(the aux taps, ``[n, 3H]``), ``hidden_states[:, -1]`` (``verifier_last_hidden_states``) and the row's
``loss_mask``. The vocabulary mapping comes from ``d2t.npy``/``t2d.npy`` in the directory (int64
offsets ``[K]``, bool ``[V]``: eagle3's convention) or is built from ``token_freq.pt`` with
``--draft-vocab-size`` (``train.py`` ``parse_vocab_mappings``, ``train/vocab_mapping.py``
``build_vocab_mappings_from_distribution``). A sample whose extraction failed is
skipped by the generator and leaves a hole in the ``hs_<i>`` numbering.

The layers are eagle3's: ``launch_vllm.py`` passes ``eagle_aux_hidden_state_layer_ids = [2, N//2, N-3,
N]`` to vLLM's ``extract_hidden_states`` method, i.e. the residual stream entering decoder layers 2,
N//2 and N-3 and the last decoder layer's output (``_maybe_add_hidden_state(..., idx + 1, ...)`` after
each layer, before ``self.norm``). **The final state is pre-norm in both**: speculators' Eagle3 model
applies ``verifier_norm`` to ``verifier_last_hidden_states`` itself (``models/eagle3/core.py``), as
eagle3's teacher does. So no norm is applied or undone either way: every tensor is copied bit for
bit and the round trip is bitwise exact. Post-norm features (imported from SpecForge,
``final_norm_applied: true``) are refused: a norm cannot be undone.

Each export carries ``eagle3_features.json`` (identity + sample ids, ``interop.write_sidecar``); a
directory speculators wrote itself needs the identity given (``meta_from_model``, the CLI's ``--model``).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3.core.features_union import open_features
from eagle3.core.features_writer import FeaturesWriter
from eagle3.core.protocol.features import FeaturesMeta
from eagle3.core.sample import ExtractedSample
from eagle3.draft_trainer.errors import DataError
from eagle3.draft_trainer.interop import SIDECAR, bf16_bits, read_sidecar, write_sidecar
from eagle3.draft_trainer.vocab import VOCAB_FILE, load_vocab

HS_DIR = "hidden_states"  # speculators' default --hidden-states-path under the data path
TOKEN_FREQ = "token_freq.pt"  # noqa: S105 (a file name)
HS_KEYS = {"hidden_states", "token_ids"}
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
CHUNK_TOKENS = 2**31 - 1  # per arrow chunk of the dataset


def hs_path(hs_dir: Path, row: int) -> Path:
    return hs_dir / f"hs_{row}.safetensors"


def _save_npy(path: Path, array: np.ndarray[Any, Any]) -> None:
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("wb") as f:  # a file object: np.save would append .npy to a name
        np.save(f, array)
    os.replace(tmp, path)


def _list_column(parts: list[np.ndarray[Any, Any]], offsets: Any, dtype: Any) -> Any:
    import pyarrow as pa

    values = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)
    return pa.ListArray.from_arrays(offsets, pa.array(values))


def _rows_table(input_ids: list[np.ndarray[Any, Any]], masks: list[np.ndarray[Any, Any]]) -> Any:
    """The dataset's arrow table: ``input_ids`` ``list<int32>``, ``loss_mask`` ``list<int64>``, ``seq_len``
    int64, as ``datasets`` writes speculators' rows; in chunks of at most ``CHUNK_TOKENS`` tokens (a
    list column's offsets are int32)."""
    import pyarrow as pa

    chunks: list[Any] = []
    start = 0
    while start < len(input_ids) or not chunks:
        end, n_tokens = start, 0
        while end < len(input_ids) and (end == start or n_tokens + len(input_ids[end]) <= CHUNK_TOKENS):
            n_tokens += len(input_ids[end])
            end += 1
        lengths = np.array([len(t) for t in input_ids[start:end]], dtype=np.int64)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        ids, mask = (
            _list_column(input_ids[start:end], offsets, np.int32),
            _list_column(masks[start:end], offsets, np.int64),
        )
        chunks.append(pa.table({"input_ids": ids, "loss_mask": mask, "seq_len": pa.array(lengths)}))
        start = end
    return pa.concat_tables(chunks)


def to_speculators(features_dir: str | Path, out_dir: str | Path, vocab_dir: str | Path | None = None) -> int:
    """Write every sample of ``features_dir`` as a speculators data directory (the dataset rows, the
    ``hidden_states/hs_<row>.safetensors`` files, ``token_freq.pt``); returns the sample count.
    ``vocab_dir`` (an ``eagle3 vocab`` output): also ``d2t.npy`` (int64 offsets) and ``t2d.npy`` (bool),
    which speculators' ``train.py`` loads from its data path before building its own from
    ``token_freq.pt``, so it trains the same draft vocabulary (the same convention: target id = draft
    id + d2t). ``out_dir`` must be new or empty: a speculators directory is one dataset, written whole."""
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from safetensors.torch import save_file

    reader = open_features(features_dir)
    meta = reader.meta
    if meta.final_norm_applied:
        raise DataError(
            f"{features_dir}: the final state is post-norm (final_norm_applied: true, converted from "
            "SpecForge); speculators needs the pre-norm state (it applies verifier_norm itself) and a "
            "norm cannot be undone: extract the features with eagle3 serve"
        )
    vocab = None
    if vocab_dir is not None:
        vocab = load_vocab(vocab_dir)
        if vocab.target_vocab_size != meta.vocab_size:
            raise DataError(
                f"{Path(vocab_dir) / VOCAB_FILE}: t2d covers {vocab.target_vocab_size} target ids, the "
                f"features' verifier has {meta.vocab_size}: give this verifier's vocab"
            )
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise DataError(
            f"{out}: not empty; a speculators data directory is written whole: give a new --out "
            "(or delete a half-written one)"
        )
    hs_dir = out / HS_DIR
    hs_dir.mkdir(parents=True)
    ids: list[str] = []
    input_ids: list[np.ndarray[Any, Any]] = []
    masks: list[np.ndarray[Any, Any]] = []
    counts = np.zeros(meta.vocab_size, dtype=np.int64)
    for row, sample in enumerate(reader):
        tokens = np.asarray(sample.input_ids, dtype=np.int64)
        path = hs_path(hs_dir, row)
        tmp = path.with_name(path.name + ".partial")  # not hs_*.safetensors: never taken for a sample
        save_file({"hidden_states": sample.as_torch().contiguous(), "token_ids": torch.from_numpy(tokens)}, str(tmp))
        os.replace(tmp, path)
        mask = np.asarray(sample.loss_mask, dtype=np.int64)
        counts += np.bincount(tokens[mask == 1], minlength=meta.vocab_size)[: meta.vocab_size]
        ids.append(sample.sample_id)
        input_ids.append(tokens.astype(np.int32))
        masks.append(mask)
    table = _rows_table(input_ids, masks)
    dataset = Dataset(InMemoryTable(table))
    dataset.set_format("torch")
    dataset.save_to_disk(str(out))
    freq = {int(t): int(counts[t]) for t in np.flatnonzero(counts)}
    torch.save(freq, out / (TOKEN_FREQ + ".partial"))
    os.replace(out / (TOKEN_FREQ + ".partial"), out / TOKEN_FREQ)
    if vocab is not None:
        _save_npy(out / "d2t.npy", vocab.d2t.astype(np.int64))
        _save_npy(out / "t2d.npy", vocab.t2d.astype(bool))
    write_sidecar(out, meta, ids)
    return len(ids)


def _load_rows(root: Path) -> Any:
    from datasets import Dataset, load_from_disk

    if not (root / "state.json").is_file():
        raise DataError(
            f"{root}: no state.json; expected a speculators data directory (the --output of its "
            "prepare_data.py, a datasets save_to_disk directory)"
        )
    data = load_from_disk(str(root))
    if not isinstance(data, Dataset):
        raise DataError(f"{root}: a DatasetDict ({list(data)}); give the directory of one split")
    missing = {"input_ids", "loss_mask"} - set(data.column_names)
    if missing:
        raise DataError(
            f"{root}: the dataset lacks the column(s) {sorted(missing)} speculators trains on (has {data.column_names})"
        )
    return data.with_format("numpy", columns=["input_ids", "loss_mask"])


def _read_hs(path: Path, row: int, tokens: np.ndarray[Any, Any], meta: FeaturesMeta) -> torch.Tensor:
    """One ``hs_<row>.safetensors``, checked against its dataset row and the identity."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            if not keys >= HS_KEYS:
                raise DataError(
                    f"{path}: holds {sorted(keys)}, expected {sorted(HS_KEYS)} (vLLM's "
                    "ExampleHiddenStatesConnector output)"
                )
            states: torch.Tensor = f.get_tensor("hidden_states")
            token_ids: torch.Tensor = f.get_tensor("token_ids")
    except (SafetensorError, OSError) as exc:
        raise DataError(
            f"{path}: unreadable safetensors file ({exc}); regenerate it with speculators' data_generation_offline.py"
        ) from None
    n = len(tokens)
    shape = (n, meta.n_layers_stored, meta.hidden_size)
    if tuple(states.shape) != shape:
        raise DataError(
            f"{path}: hidden_states {tuple(states.shape)}, expected {shape} (row {row}: {n} tokens; "
            f"aux layers {list(meta.aux_layer_ids)} + the last layer, hidden size {meta.hidden_size}); "
            "give --aux-layer-ids as passed to launch_vllm.py --target-layer-ids"
        )
    if states.dtype not in FLOATS:
        raise DataError(f"{path}: hidden_states are {states.dtype}; expected bfloat16 (or float16/float32)")
    if token_ids.dtype.is_floating_point or token_ids.tolist() != tokens.tolist():
        raise DataError(
            f"{path}: token_ids differ from row {row}'s input_ids (speculators drops such a "
            "sample); the hidden states belong to another dataset or row order"
        )
    return states


def from_speculators(
    speculators_dir: str | Path,
    out_dir: str | Path,
    meta: FeaturesMeta | None = None,
    *,
    hidden_states_dir: str | Path | None = None,
    skip_missing: bool = False,
) -> tuple[int, int]:
    """A speculators data directory -> an eagle3 features directory (pre-norm, ``final_norm_applied:
    false``, bf16; bf16 states are copied bit for bit). Returns (samples converted, rows skipped
    because their ``hs_<row>`` file is missing, only with ``skip_missing``). ``meta``: the identity to
    record; default the sidecar of an export made by ``to_speculators``. Resumable: samples already in
    ``out_dir`` are not converted again. Sample ids are the sidecar's, else ``hs_<row>``."""
    root = Path(speculators_dir)
    rows = _load_rows(root)
    meta, sample_ids = read_sidecar(root, meta)
    if sample_ids is not None and len(sample_ids) != len(rows):
        raise DataError(
            f"{root / SIDECAR}: {len(sample_ids)} sample ids for {len(rows)} dataset rows; the "
            "dataset changed after eagle3 convert wrote it: delete the sidecar, give --model"
        )
    meta = replace(meta, final_norm_applied=False)  # speculators' states are pre-norm by construction
    if sample_ids is None and not meta.n_samples_total:
        meta = replace(meta, n_samples_total=len(rows))  # the dataset it is filled from
    hs_dir = Path(hidden_states_dir) if hidden_states_dir is not None else root / HS_DIR
    if not hs_dir.is_dir():
        raise DataError(
            f"{hs_dir}: no hidden-states directory; run speculators' data_generation_offline.py "
            "(its --output defaults to DATA/hidden_states) or give --hidden-states-path"
        )
    writer = FeaturesWriter.open(out_dir, meta)
    skipped = 0
    try:
        for row, item in enumerate(rows):
            sample_id = sample_ids[row] if sample_ids is not None else f"hs_{row}"
            if sample_id in writer.done_ids:
                continue
            path = hs_path(hs_dir, row)
            if not path.is_file():
                if skip_missing:
                    skipped += 1
                    continue
                raise DataError(
                    f"{path}: missing (row {row} of {root}; speculators' generator skips a sample "
                    "whose extraction failed): rerun data_generation_offline.py to fill it, or pass "
                    "--skip-missing"
                )
            tokens, mask = np.asarray(item["input_ids"]), np.asarray(item["loss_mask"])
            if mask.shape != tokens.shape or not np.isin(mask, (0, 1)).all():
                raise DataError(
                    f"{root}: row {row}: loss_mask must be 0/1 with one entry per input id "
                    f"({mask.shape[0]} entries for {tokens.shape[0]} ids)"
                )
            if tokens.size and not 0 <= int(tokens.min()) <= int(tokens.max()) < meta.vocab_size:
                raise DataError(
                    f"{root}: row {row}: token ids outside [0, {meta.vocab_size}) of the verifier's "
                    "vocabulary; the data belongs to another model than --model"
                )
            states = _read_hs(path, row, tokens, meta)
            writer.add(
                ExtractedSample(
                    sample_id,
                    tokens.astype(np.int32),
                    mask.astype(np.uint8),
                    bf16_bits(states),
                    meta.aux_layer_ids,
                    meta.final_layer_id,
                )
            )
    finally:
        writer.close()
    return len(writer.done_ids), skipped
