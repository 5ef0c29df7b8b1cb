"""Training data: a features directory read memory-mapped, split by sample, batched by tokens.

Invariants:

* The held-out split is a pure function of the sample ids and ``heldout_fraction`` (a hash,
  ``core.protocol.prepared.is_heldout``), so it is
  the same on every rank, on resume, and for ``eagle3 eval``. Extra replies to one prompt (ids
  ``<base>~s<k>``, ``eagle3 distill --sampled-replies``) hash as ``<base>``: all on the training side,
  or, for a held-out prompt, none trained on and none scored (the held-out split keeps the one reply
  ``<base>``, the one offline metrics compare with what ``eagle3 eval`` generates).
* A micro-batch holds at most ``max_batch_tokens`` tokens of whole samples packed end to end (no
  padding). A sample longer than ``max_batch_tokens`` is an error unless ``truncate`` is set.
* The plan of an epoch (order of samples, cut into micro-batches) depends only on the seed, the epoch
  and the sample lengths; a global step takes ``world_size * grad_accum_steps`` consecutive
  micro-batches and rank ``r`` reads micro-batches ``r, r + W, ...`` of them (disjoint data per rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle3.core.codec import bf16_to_float32
from eagle3.core.features_reader import FeaturesReader
from eagle3.core.protocol.prepared import is_heldout, variant_of
from eagle3.draft_trainer.errors import DataError
from eagle3.draft_trainer.ttt import PackedBatch


@dataclass(frozen=True)
class Split:
    train: tuple[int, ...]  # reader positions
    heldout: tuple[int, ...]
    n_dropped: int = 0  # extra replies (``<base>~s<k>``) to held-out prompts: in neither split


class FeaturesData:
    """A features directory with per-sample token counts, its split and its batch plans."""

    def __init__(self, features_dir: str | Path, *, heldout_fraction: float = 0.05) -> None:
        self.reader = FeaturesReader(features_dir)
        if len(self.reader) == 0:
            raise DataError(f"{features_dir}: the features directory holds no samples")
        self.meta = self.reader.meta
        if len(self.meta.aux_layer_ids) != 3:
            raise DataError(f"{features_dir}: EAGLE-3 needs 3 aux layers, found {list(self.meta.aux_layer_ids)}")
        if self.meta.final_norm_applied:
            raise DataError(
                f"{features_dir}: the final state is post-norm (converted from SpecForge); eagle3 train needs the "
                "pre-norm state its teacher normalises itself: extract with eagle3 serve, or train with SpecForge"
            )
        self.n_tokens = np.array([n for r in self.reader.records for n in r.n_tokens], dtype=np.int64)  # [N]
        ids = self.reader.sample_ids
        held = [i for i, s in enumerate(ids) if is_heldout(s, heldout_fraction)]
        held_set = set(held)
        scored = tuple(i for i in held if variant_of(ids[i])[1] == 0)
        train = tuple(i for i in range(len(ids)) if i not in held_set)
        self.split = Split(train, scored, len(held) - len(scored))
        if not self.split.train:
            raise DataError(f"{features_dir}: heldout_fraction {heldout_fraction} leaves no training samples")

    def plan(self, positions: tuple[int, ...], max_batch_tokens: int, *, seed: int, epoch: int,
             shuffle: bool = True, truncate: bool = False) -> list[list[int]]:  # fmt: skip
        """Micro-batches (lists of reader positions) for one epoch."""
        order = np.array(positions, dtype=np.int64)
        if shuffle:
            order = order[np.random.default_rng([seed, epoch]).permutation(len(order))]
        batches: list[list[int]] = []
        current: list[int] = []
        used = 0
        for pos in order.tolist():
            n = int(self.n_tokens[pos])
            if n > max_batch_tokens:
                if not truncate:
                    raise DataError(
                        f"sample {self.reader.sample_ids[pos]!r} has {n} tokens > max_batch_tokens "
                        f"{max_batch_tokens}; raise max_batch_tokens or set truncate=true"
                    )
                n = max_batch_tokens
            if current and used + n > max_batch_tokens:
                batches.append(current)
                current, used = [], 0
            current.append(pos)
            used += n
        if current:
            batches.append(current)
        return batches

    def load(self, positions: list[int], max_batch_tokens: int | None = None) -> PackedBatch:
        """Pack the samples at ``positions`` into one batch (float32 features, bool mask)."""
        ids, aux, final, mask, pos, start, end = [], [], [], [], [], [], []
        row = 0
        for p in positions:
            sample = self.reader[p]
            bits = np.asarray(sample.hidden_states_bf16)  # [n, L, H] uint16
            if max_batch_tokens is not None:
                bits = bits[:max_batch_tokens]
            n = bits.shape[0]
            states = bf16_to_float32(bits)  # [n, L, H]
            ids.append(np.asarray(sample.input_ids[:n], dtype=np.int64))
            aux.append(states[:, :-1].reshape(n, -1))  # [n, 3H]
            final.append(states[:, -1])  # [n, H]
            mask.append(np.asarray(sample.loss_mask[:n], dtype=bool))
            pos.append(np.arange(n, dtype=np.int64))
            start.append(np.full(n, row, dtype=np.int64))
            end.append(np.full(n, row + n, dtype=np.int64))
            row += n
        return PackedBatch(
            input_ids=torch.from_numpy(np.concatenate(ids)),
            aux=torch.from_numpy(np.concatenate(aux)),
            final=torch.from_numpy(np.concatenate(final)),
            loss_mask=torch.from_numpy(np.concatenate(mask)),
            positions=torch.from_numpy(np.concatenate(pos)),
            seg_start=torch.from_numpy(np.concatenate(start)),
            seg_end=torch.from_numpy(np.concatenate(end)),
        )
