"""Training data: a features directory read memory-mapped, split by sample, batched by tokens.

Invariants:

* Samples are numbered in one canonical order, their ids sorted (``canonical_order``): positions, the
  split and the epoch plans refer to it, never to a features directory's manifest (arrival order,
  which differs between two extractions of the same data). So a features directory and a stream from
  the servers (``draft_trainer/stream_data.py``) of the same samples give the same batches. (Until
  this order existed, plans ran over manifest positions: a run resumed mid-epoch across the change
  sees the rest of that epoch in another order; every sample is still trained once per epoch.)
* The held-out split is a pure function of the sample ids and ``heldout_fraction`` (a hash,
  ``core.protocol.prepared.is_heldout``), so it is
  the same on every rank, on resume, and for ``eagle3 eval``. Extra replies to one prompt (ids
  ``<base>~s<k>``, ``eagle3 distill --sampled-replies``) hash as ``<base>``: all on the training side,
  or, for a held-out prompt, none trained on and none scored (the held-out split keeps the one reply
  ``<base>``, the one offline metrics compare with what ``eagle3 eval`` generates).
* A micro-batch holds at most ``max_batch_tokens`` tokens of whole samples packed end to end (no
  padding). A sample longer than ``max_batch_tokens`` is an error unless ``truncate`` is set.
* A features directory's micro-batches are read ahead (``loader_threads``): the ones ``begin`` announced
  are read, decompressed, dequantized (FP8) and packed by a thread pool while the step runs, in order,
  a window of ``loader_threads + 1`` batches; ``load`` of anything else (held-out batches) reads at once. The
  batches are the same either way (a pure function of the positions).
* The plan of an epoch (order of samples, cut into micro-batches) depends only on the seed, the epoch
  and the sample lengths; a global step takes ``world_size * grad_accum_steps`` consecutive
  micro-batches and rank ``r`` reads micro-batches ``r, r + W, ...`` of them (disjoint data per rank).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3.core.features_union import open_features
from eagle3.core.protocol.features import FeaturesMeta
from eagle3.core.protocol.prepared import is_heldout, variant_of
from eagle3.core.sample import ExtractedSample
from eagle3.draft_trainer.compact_batch import CompactBatch, pack_compact, packed_segments
from eagle3.draft_trainer.errors import DataError
from eagle3.draft_trainer.ttt import PackedBatch


@dataclass(frozen=True)
class Split:
    train: tuple[int, ...]  # canonical positions
    heldout: tuple[int, ...]
    n_dropped: int = 0  # extra replies (``<base>~s<k>``) to held-out prompts: in neither split


def canonical_order(sample_ids: Sequence[str]) -> list[int]:
    """Indices of ``sample_ids`` sorted by id: position ``k`` of the training data is ``sample_ids[order[k]]``."""
    return sorted(range(len(sample_ids)), key=sample_ids.__getitem__)


def split_ids(ids: Sequence[str], heldout_fraction: float, where: str) -> Split:
    """The train / held-out split of samples ``ids`` (canonical positions), see the module invariants."""
    held = [i for i, s in enumerate(ids) if is_heldout(s, heldout_fraction)]
    held_set = set(held)
    scored = tuple(i for i in held if variant_of(ids[i])[1] == 0)
    train = tuple(i for i in range(len(ids)) if i not in held_set)
    if not train:
        raise DataError(f"{where}: heldout_fraction {heldout_fraction} leaves no training samples")
    return Split(train, scored, len(held) - len(scored))


def check_layout(meta: FeaturesMeta, where: str) -> None:
    if len(meta.aux_layer_ids) != 3:
        raise DataError(f"{where}: EAGLE-3 needs 3 aux layers, found {list(meta.aux_layer_ids)}")
    if meta.final_norm_applied:
        raise DataError(
            f"{where}: the final state is post-norm (converted from SpecForge); eagle3 train needs the "
            "pre-norm state its teacher normalises itself: extract with eagle3 serve, or train with SpecForge"
        )


class SampleTable:
    """Sample ids and lengths in canonical order, with the split and the epoch plans over them."""

    ids: list[str]
    n_tokens: np.ndarray[Any, Any]  # int64 [N]
    split: Split
    meta: FeaturesMeta  # what the features are (layers, hidden size)

    def plan(
        self,
        positions: tuple[int, ...],
        max_batch_tokens: int,
        *,
        seed: int,
        epoch: int,
        shuffle: bool = True,
        truncate: bool = False,
    ) -> list[list[int]]:
        """Micro-batches (lists of canonical positions) for one epoch."""
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
                        f"sample {self.ids[pos]!r} has {n} tokens > max_batch_tokens "
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
        raise NotImplementedError

    def load_to(self, positions: list[int], max_batch_tokens: int | None, device: torch.device) -> PackedBatch:
        """``load`` on ``device`` (what the training step calls: data that can widens there)."""
        return self.load(positions, max_batch_tokens).to(device)

    # the trainer's data interface, beside plan/load: no-ops for data that needs no prefetch
    syncs_each_epoch = False  # True: ``begin`` takes one epoch at a time, ``epoch_sync`` between epochs

    def begin(self, micro_batches: Iterable[list[int]]) -> None:
        """The micro-batches this rank will ``load`` next, in order (a stream prefetches them)."""

    def epoch_sync(self) -> None:
        """Between two epochs, on every rank at once (a torchrun cache: every rank sees what the others wrote)."""

    def stats(self) -> dict[str, float]:
        """Counters for the training log since the last call (a stream's data wait, bytes, ...)."""
        return {}

    def close(self) -> None:
        """Stop background work (a stream's fetchers, its cache writer)."""


class FeaturesData(SampleTable):
    """A features directory with per-sample token counts, its split and its batch plans. ``loader_threads``:
    read the micro-batches ``begin`` announces ahead, on that many threads (0: each in its ``load``);
    ``cut_to``: the ``max_batch_tokens`` the trainer's ``load`` passes (None unless it truncates)."""

    def __init__(
        self,
        features_dir: str | Path,
        *,
        heldout_fraction: float = 0.05,
        loader_threads: int = 0,
        cut_to: int | None = None,
        compact: bool = False,
    ) -> None:
        self.loader_threads, self.cut_to, self.compact = loader_threads, cut_to, compact
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: deque[tuple[list[int], Future[PackedBatch | CompactBatch]]] = deque()
        self._upcoming: Iterator[list[int]] = iter(())
        self.reader = open_features(features_dir)  # a features directory, or a torchrun cache's rank directories
        if len(self.reader) == 0:
            raise DataError(f"{features_dir}: the features directory holds no samples")
        self.meta = self.reader.meta
        check_layout(self.meta, str(features_dir))
        stored = np.array(self.reader.sample_n_tokens, dtype=np.int64)  # [N]
        reader_ids = self.reader.sample_ids
        self._reader_pos = canonical_order(reader_ids)  # canonical position -> reader position
        self.ids = [reader_ids[p] for p in self._reader_pos]
        self.n_tokens = stored[self._reader_pos]
        self.split = split_ids(self.ids, heldout_fraction, str(features_dir))

    def sample(self, position: int) -> ExtractedSample:
        return self.reader[self._reader_pos[position]]

    def load(self, positions: list[int], max_batch_tokens: int | None = None) -> PackedBatch:
        """Pack the samples at ``positions`` into one batch (float32 features, bool mask): the batch read
        ahead when it is the next one ``begin`` announced, else read now."""
        return self.read(positions, max_batch_tokens).to(torch.device("cpu"))

    def load_to(self, positions: list[int], max_batch_tokens: int | None, device: torch.device) -> PackedBatch:
        """``load`` on ``device``; with ``compact`` the states travel as stored and are widened there."""
        return self.read(positions, max_batch_tokens).to(device)

    def read(self, positions: list[int], max_batch_tokens: int | None) -> PackedBatch | CompactBatch:
        """The host's part of ``load_to``: the batch read ahead, or read now (float32, or compact as stored)."""
        if self._ahead and self._ahead[0][0] == positions and max_batch_tokens == self.cut_to:
            _, future = self._ahead.popleft()
            self._read_ahead()
            return future.result()
        return self._pack(positions, max_batch_tokens)

    def _pack(self, positions: list[int], max_batch_tokens: int | None) -> PackedBatch | CompactBatch:
        samples = [self.sample(p) for p in positions]
        return pack_compact(samples, max_batch_tokens) if self.compact else pack(samples, max_batch_tokens)

    def begin(self, micro_batches: Iterable[list[int]]) -> None:
        """Read ``micro_batches`` ahead, in order (``loader_threads`` > 0)."""
        self._drop_ahead()
        if self.loader_threads <= 0:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.loader_threads, thread_name_prefix="eagle3-loader")
        self._upcoming = iter(micro_batches)
        self._read_ahead()

    def _read_ahead(self) -> None:
        while self._pool is not None and len(self._ahead) < self.loader_threads + 1:
            positions = next(self._upcoming, None)
            if positions is None:
                return
            self._ahead.append((positions, self._pool.submit(self._pack, positions, self.cut_to)))

    def _drop_ahead(self) -> None:
        for _, future in self._ahead:
            future.cancel()
        self._ahead.clear()
        self._upcoming = iter(())

    def close(self) -> None:
        self._drop_ahead()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def pack(samples: Sequence[ExtractedSample], max_batch_tokens: int | None = None) -> PackedBatch:
    """Samples packed end to end into one batch (float32 features, bool mask), each cut to
    ``max_batch_tokens`` when given. The states are widened (bf16) or dequantized (FP8) straight into
    the batch's arrays (``ExtractedSample.float32_into``): one pass over them, no intermediate copies."""
    lengths = [s.n_tokens if max_batch_tokens is None else min(s.n_tokens, max_batch_tokens) for s in samples]
    total = sum(lengths)
    _, n_layers, hidden = samples[0].states.shape
    aux = np.empty((total, (n_layers - 1) * hidden), np.float32)  # [T, 3H]
    final = np.empty((total, hidden), np.float32)  # [T, H]
    row = 0
    for sample, n in zip(samples, lengths, strict=True):
        sample.float32_into(aux[row : row + n].reshape(n, n_layers - 1, hidden), final[row : row + n])
        row += n
    return PackedBatch(aux=torch.from_numpy(aux), final=torch.from_numpy(final), **packed_segments(samples, lengths))
