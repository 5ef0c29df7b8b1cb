"""A micro-batch in its stored form, widened on the device it trains on (``FeaturesData(compact=True)``).

``pack`` (``draft_trainer/data.py``) widens bf16 (or dequantizes FP8) to float32 on the host: 4 bytes a
value written by the loader, and 4 bytes a value copied to the GPU. On a GPU the host's part is what
limits the loader (docs/performance.md, "Features at rest"), so for CUDA training ``pack_compact``
only gathers the samples' stored states (bf16 bits, or FP8 codes and their float32 scales: 2 or 1
bytes a value) and ``CompactBatch.to(device)`` moves them and widens there. The result is the batch
``pack`` makes, bit for bit: bf16 -> float32 is exact, e4m3 -> float32 is exact, and the scale is
applied with the same one float32 multiply (``tests/integration/test_feature_formats.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from eagle3.core.sample import ExtractedSample
from eagle3.draft_trainer.ttt import PackedBatch


@dataclass(frozen=True)
class CompactBatch:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    positions: torch.Tensor  # [T] int64
    seg_start: torch.Tensor  # [T] int64
    seg_end: torch.Tensor  # [T] int64
    states: torch.Tensor  # [T, L, H] int16 (bf16 bits) or uint8 (e4m3fn codes)
    scales: torch.Tensor | None  # FP8: [T, L] float32

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device) -> PackedBatch:
        """The float32 ``PackedBatch`` on ``device``: moved in the stored form, then widened there."""
        states = self.states.to(device, non_blocking=True)
        if self.scales is None:
            wide = states.view(torch.bfloat16).float()
        else:
            wide = states.view(torch.float8_e4m3fn).float()
            wide.mul_(self.scales.to(device, non_blocking=True).unsqueeze(-1))
        n_tokens, n_layers, hidden = wide.shape
        return PackedBatch(
            input_ids=self.input_ids.to(device, non_blocking=True),
            aux=wide[:, :-1].reshape(n_tokens, (n_layers - 1) * hidden),
            final=wide[:, -1].contiguous(),
            loss_mask=self.loss_mask.to(device, non_blocking=True),
            positions=self.positions.to(device, non_blocking=True),
            seg_start=self.seg_start.to(device, non_blocking=True),
            seg_end=self.seg_end.to(device, non_blocking=True),
        )


def pack_compact(samples: Sequence[ExtractedSample], max_batch_tokens: int | None = None) -> CompactBatch:
    """``pack``'s batch with the states left as stored (one copy into the batch, no widening)."""
    lengths = [s.n_tokens if max_batch_tokens is None else min(s.n_tokens, max_batch_tokens) for s in samples]
    total = sum(lengths)
    _, n_layers, hidden = samples[0].states.shape
    fp8 = samples[0].is_fp8
    states = np.empty((total, n_layers, hidden), np.uint8 if fp8 else np.int16)
    scales = np.empty((total, n_layers), np.float32) if fp8 else None
    row = 0
    for sample, n in zip(samples, lengths, strict=True):
        states[row : row + n] = np.asarray(sample.states[:n]).view(states.dtype)
        if scales is not None:
            scales[row : row + n] = np.asarray(sample.fp8_scales)[:n]
        row += n
    return CompactBatch(
        **packed_segments(samples, lengths),
        states=torch.from_numpy(states),
        scales=None if scales is None else torch.from_numpy(scales),
    )


def packed_segments(samples: Sequence[ExtractedSample], lengths: Sequence[int]) -> dict[str, torch.Tensor]:
    """The token-level fields of samples packed end to end, each cut to its length in ``lengths``: [T]
    ``input_ids``, ``loss_mask``, ``positions`` (from 0 in each sample) and ``seg_start``/``seg_end`` (the
    sample's row range), shared by the host batch (``data.pack``) and the compact one."""
    ids, mask, pos, start, end = [], [], [], [], []
    row = 0
    for sample, n in zip(samples, lengths, strict=True):
        ids.append(np.asarray(sample.input_ids[:n], dtype=np.int64))
        mask.append(np.asarray(sample.loss_mask[:n], dtype=bool))
        pos.append(np.arange(n, dtype=np.int64))
        start.append(np.full(n, row, dtype=np.int64))
        end.append(np.full(n, row + n, dtype=np.int64))
        row += n
    fields = {"input_ids": ids, "loss_mask": mask, "positions": pos, "seg_start": start, "seg_end": end}
    return {name: torch.from_numpy(np.concatenate(parts)) for name, parts in fields.items()}
