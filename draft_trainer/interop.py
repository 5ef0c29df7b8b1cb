"""Converters between an eagle3 features directory and SpecForge's offline hidden-states directory.

SpecForge's layout (``scripts/prepare_hidden_states.py`` writes it, its offline trainer reads every
``*.ckpt`` under the directory): one ``torch.save`` file per sample,
``rows_<g>-<g + 5000>/data_<index>.ckpt``, holding a dict of tensors:

| key | shape | dtype | content |
| --- | --- | --- | --- |
| ``input_ids`` | ``[n]`` | int64 | the sample's token ids |
| ``loss_mask`` | ``[n]`` | int64 | 1 = assistant token |
| ``hidden_state`` | ``[1, n, H]`` | the model's (bf16) | the last layer's output **after** the final norm |
| ``aux_hidden_state`` | ``[1, n, 3H]`` | bf16 | the three aux taps concatenated on the last axis |

Its aux taps are the same layers as eagle3's (SGLang is given ``[1, N//2 - 1, N - 4]`` and adds one:
the residual stream entering decoder layers 2, N//2, N-3, eagle3's default ``aux_layer_ids``).

The one real difference is the final state: eagle3 stores it **before** the final norm (as vLLM's
drafter consumes it, ``final_norm_applied: false``), SpecForge after it. So:

* ``to_specforge`` applies the verifier's RMSNorm (its ``norm`` weight and ``rms_norm_eps``, in float32,
  the trainer's own ``Teacher`` formula, rounded to bf16) and copies everything else bit for bit.
* ``from_specforge`` cannot undo a norm: it writes the post-norm state and records
  ``final_norm_applied: true`` in ``features.json``; ``eagle3 train`` refuses such a directory (its
  teacher applies the norm itself), but converting it back to SpecForge is bitwise exact.

Each export carries ``eagle3_features.json`` (the features meta and the sample id of every index), so a
SpecForge directory made here converts back with its identity and sample ids. Files are read with
``torch.load(weights_only=True)``: tensors only, no arbitrary objects.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3.core.features_union import open_features
from eagle3.core.features_writer import FeaturesWriter
from eagle3.core.identity import checkpoint_revision, model_config, tokenizer_sha256
from eagle3.core.layers import check_aux_layer_ids, default_aux_layer_ids
from eagle3.core.protocol.features import FeaturesMeta
from eagle3.core.sample import ExtractedSample
from eagle3.draft_trainer.errors import DataError
from eagle3.draft_trainer.ttt import load_verifier_tensors
from eagle3.draft_trainer.vocab import load_vocab

GROUP_SIZE = 5000  # SpecForge's rows_<g>-<g+5000> sub-directories
SIDECAR = "eagle3_features.json"
FILE_RE = re.compile(r"^data_(\d+)\.ckpt$")


def rms_norm(final: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float32 RMSNorm exactly as ``ttt.Teacher`` applies it."""
    final = final.float()
    return final * torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _norm_of(model_dir: str | Path) -> tuple[torch.Tensor, float]:
    config, tensors = load_verifier_tensors(model_dir)
    text = config.get("text_config") or config
    return tensors["norm"], float(text.get("rms_norm_eps", config.get("rms_norm_eps", 1e-6)))


def bf16_bits(states: torch.Tensor) -> np.ndarray[Any, Any]:
    """The bf16 bit patterns (uint16) eagle3's features store, from any float tensor (bf16: no rounding)."""
    return states.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def write_sidecar(out: Path, meta: FeaturesMeta, sample_ids: list[str]) -> None:
    """``eagle3_features.json``: the identity and the sample id of every index, so an export converts back."""
    sidecar = {"meta": asdict(meta), "sample_ids": sample_ids}
    tmp = out / (SIDECAR + ".partial")
    tmp.write_text(json.dumps(sidecar, indent=1) + "\n")
    tmp.replace(out / SIDECAR)


def read_sidecar(root: Path, meta: FeaturesMeta | None) -> tuple[FeaturesMeta, list[str] | None]:
    """The identity to record for an import (``meta`` if given, else the sidecar's) and the sidecar's sample
    ids (None without one). A directory the other trainer wrote itself has no sidecar: ``meta`` is then
    required (``meta_from_model``: the CLI's ``--model``)."""
    path = root / SIDECAR
    sample_ids: list[str] | None = None
    if path.is_file():
        try:
            sidecar = json.loads(path.read_text())
            fields = dict(sidecar["meta"])
            fields["aux_layer_ids"] = tuple(fields["aux_layer_ids"])
            meta = meta or FeaturesMeta(**fields)
            sample_ids = [str(s) for s in sidecar["sample_ids"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{path}: not a valid {SIDECAR} ({exc}); delete it and give --model instead") from None
    if meta is None:
        raise DataError(
            f"{root}: no {SIDECAR} (not written by eagle3 convert); give the verifier (--model, or "
            "meta=meta_from_model(...)) for the identity to record"
        )
    return meta, sample_ids


def meta_from_model(model: str | Path, model_dir: Path, aux_layer_ids: Sequence[int] | None = None) -> FeaturesMeta:
    """The identity ``eagle3 extract`` would record for this verifier (what the server reports on
    ``/v1/info``: model name, checkpoint revision, layers, sizes, tokenizer hash), for importing a
    directory another trainer wrote itself. ``aux_layer_ids``: default 2, N//2, N-3 (eagle3's and both
    other trainers' default)."""
    config = model_config(model_dir)
    n_layers = int(config["num_hidden_layers"])
    try:
        aux = check_aux_layer_ids(aux_layer_ids, n_layers) if aux_layer_ids else default_aux_layer_ids(n_layers)
    except ValueError as exc:
        raise DataError(f"--aux-layer-ids: {exc}") from None
    name = str(model) if not Path(model).is_dir() else Path(model).resolve().name
    return FeaturesMeta(
        name,
        checkpoint_revision(model_dir),
        aux,
        n_layers,
        int(config["hidden_size"]),
        int(config["vocab_size"]),
        "bfloat16",
        tokenizer_sha256(model_dir),
    )


VOCAB_MAPPING = "vocab_mapping.pt"  # what SpecForge's prepare_hidden_states.py writes beside its .ckpt files


def to_specforge(
    features_dir: str | Path,
    out_dir: str | Path,
    model_dir: str | Path | None = None,
    vocab_dir: str | Path | None = None,
) -> int:
    """Write every sample of ``features_dir`` as SpecForge ``.ckpt`` files; returns the sample count.
    ``model_dir`` (the verifier, for its final norm) is needed unless the features are post-norm already.
    ``vocab_dir`` (an ``eagle3 vocab`` output): also ``vocab_mapping.pt``, ``{"d2t": int64 [K], "t2d": bool
    [V]}`` as SpecForge's ``process_token_dict_to_mappings`` saves it (the same convention: target id = draft
    id + d2t), so its trainer (``--vocab-mapping-path``) trains the same draft vocabulary."""
    reader = open_features(features_dir)
    meta = reader.meta
    mapping: dict[str, torch.Tensor] | None = None
    if vocab_dir is not None:
        vocab = load_vocab(vocab_dir)
        if vocab.target_vocab_size != meta.vocab_size:
            raise DataError(
                f"{vocab_dir}: t2d covers {vocab.target_vocab_size} target ids, the features' verifier "
                f"has {meta.vocab_size}: give this verifier's vocab"
            )
        mapping = {"d2t": torch.from_numpy(vocab.d2t.astype(np.int64)), "t2d": torch.from_numpy(vocab.t2d.astype(bool))}
    if len(meta.aux_layer_ids) != 3:
        raise DataError(f"{features_dir}: SpecForge expects 3 aux layers, found {list(meta.aux_layer_ids)}")
    norm: tuple[torch.Tensor, float] | None = None
    if not meta.final_norm_applied:
        if model_dir is None:
            raise DataError(f"{features_dir}: pre-norm final states; give the verifier (--model) for its final norm")
        norm = _norm_of(model_dir)
        if norm[0].shape != (meta.hidden_size,):
            raise DataError(f"{model_dir}: norm has {tuple(norm[0].shape)} weights, the features {meta.hidden_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids: list[str] = []
    for index, sample in enumerate(reader):
        states = sample.as_torch()  # bf16 [n, L, H]
        n, n_layers, hidden = states.shape
        group = index // GROUP_SIZE * GROUP_SIZE
        path = out / f"rows_{group}-{group + GROUP_SIZE}" / f"data_{index}.ckpt"
        path.parent.mkdir(exist_ok=True)
        record = {
            "input_ids": torch.from_numpy(np.asarray(sample.input_ids, dtype=np.int64)),
            "loss_mask": torch.from_numpy(np.asarray(sample.loss_mask, dtype=np.int64)),
            "hidden_state": (
                rms_norm(states[:, -1], *norm).to(torch.bfloat16) if norm else states[:, -1].clone()
            ).unsqueeze(0),
            "aux_hidden_state": states[:, :-1].reshape(n, (n_layers - 1) * hidden).clone().unsqueeze(0),
        }
        torch.save(record, path)
        ids.append(sample.sample_id)
    if mapping is not None:
        torch.save(mapping, out / (VOCAB_MAPPING + ".partial"))
        (out / (VOCAB_MAPPING + ".partial")).replace(out / VOCAB_MAPPING)
    write_sidecar(out, replace(meta, final_norm_applied=True), ids)
    return len(ids)


def _ckpt_files(root: Path) -> list[tuple[int, Path]]:
    found = sorted((int(m.group(1)), p) for p in root.rglob("*.ckpt") if (m := FILE_RE.match(p.name)))
    if not found:
        raise DataError(f"{root}: no data_<index>.ckpt files (a SpecForge prepare_hidden_states output?)")
    return found


def from_specforge(specforge_dir: str | Path, out_dir: str | Path, meta: FeaturesMeta | None = None) -> int:
    """SpecForge ``.ckpt`` files -> an eagle3 features directory (post-norm final state, recorded as
    ``final_norm_applied: true``). ``meta``: the identity to record; default the sidecar of an export
    made by ``to_specforge`` (a directory SpecForge wrote itself needs it given)."""
    root = Path(specforge_dir)
    meta, sample_ids = read_sidecar(root, meta)
    meta = replace(meta, final_norm_applied=True)
    n_aux = len(meta.aux_layer_ids)
    writer = FeaturesWriter.open(out_dir, meta)
    try:
        for index, path in _ckpt_files(root):
            data = torch.load(path, map_location="cpu", weights_only=True)
            aux, final = data["aux_hidden_state"][0], data["hidden_state"][0]  # [n, k*H], [n, H]
            n = final.shape[0]
            if aux.shape != (n, n_aux * meta.hidden_size) or final.shape != (n, meta.hidden_size):
                raise DataError(
                    f"{path}: aux {tuple(aux.shape)} / hidden {tuple(final.shape)} do not match "
                    f"{n_aux} x hidden_size {meta.hidden_size}"
                )
            states = torch.cat([aux.reshape(n, n_aux, meta.hidden_size), final.unsqueeze(1)], dim=1)
            bits = bf16_bits(states)
            sample_id = sample_ids[index] if sample_ids is not None else f"data_{index}"
            writer.add(
                ExtractedSample(
                    sample_id,
                    data["input_ids"].numpy().astype(np.int32),
                    data["loss_mask"].numpy().astype(np.uint8),
                    bits,
                    meta.aux_layer_ids,
                    meta.final_layer_id,
                )
            )
    finally:
        writer.close()
    return len(writer.done_ids)
