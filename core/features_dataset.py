"""A features directory as a map-style dataset a ``torch.utils.data.DataLoader`` takes as it is::

    from torch.utils.data import DataLoader
    from eagle3 import FeaturesDataset

    data = FeaturesDataset("features/")
    loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=2, collate_fn=FeaturesDataset.pad_collate)
    for batch in loader:
        batch["hidden_states"]  # torch.bfloat16 [B, T, L, H]: aux layers, then the final pre-norm state
        batch["input_ids"], batch["loss_mask"], batch["attention_mask"]  # int64 / uint8 / bool [B, T]

A ``DataLoader`` needs ``__len__`` and ``__getitem__`` only (no ``torch.utils.data.Dataset`` base), so
this module imports torch only when an item is read: the core stays torch-free at import. Each worker
process opens its own reader (a dataset pickles as its directory and options, never the
memory maps). Items are ``torch`` tensors of one sample; ``hidden_states`` is a zero-copy view of the
shard's memory map (read-only: copy before writing into it); a compressed directory's are decompressed
and an FP8 directory's dequantized (and rounded to bf16) per item instead. ``pad_collate`` right-pads a batch of
samples of different lengths (padding: token id 0, loss mask 0, attention mask False, states 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3.core.features_reader import FeaturesReader
from eagle3.core.features_union import FeaturesUnion, open_features

if TYPE_CHECKING:  # to a type checker it is the Dataset a DataLoader's signature asks for; at run time no torch
    from torch.utils.data import Dataset

    _Base = Dataset[dict[str, Any]]
else:
    _Base = object


class FeaturesDataset(_Base):
    """``len(ds)``, ``ds[i]`` -> ``{"sample_id", "input_ids", "loss_mask", "hidden_states"}`` (torch).
    ``sample_ids``: a subset and order (default: every sample in manifest order)."""

    def __init__(
        self, features_dir: str | Path, *, sample_ids: Sequence[str] | None = None, verify: bool = False
    ) -> None:
        self.features_dir = Path(features_dir)
        self.verify = verify
        reader = open_features(self.features_dir, verify=verify)
        self.aux_layer_ids = tuple(reader.meta.aux_layer_ids)
        self.final_layer_id = reader.meta.final_layer_id
        if sample_ids is None:
            self.sample_ids: list[str] = reader.sample_ids
        else:
            missing = [s for s in sample_ids if s not in reader]
            if missing:
                raise KeyError(f"{len(missing)} sample id(s) not in {self.features_dir}, e.g. {missing[0]!r}")
            self.sample_ids = list(sample_ids)
        self._reader: FeaturesReader | FeaturesUnion | None = reader

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        import torch

        if self._reader is None:  # a fresh process (DataLoader worker): open the directory here
            self._reader = open_features(self.features_dir)
        sample = self._reader[self.sample_ids[index]]
        return {
            "sample_id": sample.sample_id,
            "input_ids": torch.from_numpy(sample.input_ids.astype("int64")),
            "loss_mask": torch.from_numpy(sample.loss_mask.copy()),
            "hidden_states": sample.as_torch(),
        }

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_reader"] = None  # memory maps do not travel; each process opens its own
        return state

    @staticmethod
    def pad_collate(batch: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Right-pad a list of items to the longest: ``input_ids`` int64, ``loss_mask`` uint8,
        ``attention_mask`` bool [B, T], ``hidden_states`` bf16 [B, T, L, H], ``sample_ids`` a list."""
        import torch

        longest = max(int(item["input_ids"].shape[0]) for item in batch)
        first = batch[0]["hidden_states"]
        states = torch.zeros((len(batch), longest, *first.shape[1:]), dtype=first.dtype)
        input_ids = torch.zeros((len(batch), longest), dtype=torch.int64)
        loss_mask = torch.zeros((len(batch), longest), dtype=torch.uint8)
        attention = torch.zeros((len(batch), longest), dtype=torch.bool)
        for row, item in enumerate(batch):
            n = int(item["input_ids"].shape[0])
            states[row, :n] = item["hidden_states"]
            input_ids[row, :n] = item["input_ids"]
            loss_mask[row, :n] = item["loss_mask"]
            attention[row, :n] = True
        return {
            "sample_ids": [item["sample_id"] for item in batch],
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "attention_mask": attention,
            "hidden_states": states,
        }
