"""Training data streamed from extraction servers while the draft trains (``eagle3 train --server``).

The prepared dataset gives the sample ids, token ids, loss masks and lengths, in the canonical order of
``draft_trainer/data.py`` (ids sorted); the split and the epoch plans are the same functions a features
directory uses, so a run streamed from the servers trains on the same batches as a run on a features
directory of the same samples (``tests/e2e/test_train_stream.py``). The features themselves come
from a ``FeatureSource`` (the SDK-backed one is ``eagle3.client.train_source.ServerSource``; the trainer
never imports the SDK), prefetched in plan order by ``draft_trainer/prefetch.py``.

Modes:

* consume once (no cache): each sample's features are dropped after its step (every epoch fetches again);
* hybrid (``features_cache``): samples already in the cache directory are read from it; the others are
  fetched and appended to it with ``FeaturesWriter`` (the ``eagle3 extract`` format, crash-safe as
  extraction: a SIGKILL loses at most the shards in flight, and a restart fetches only what is missing).
  After the first epoch nothing is fetched; the directory is a features directory like any other.
  Under torchrun each rank writes ``DIR/rank-N`` and reads the union of all of them, refreshed at each
  epoch's barrier (``FeatureCache``); ``--features DIR`` reads that union too (``core/features_union.py``).

The held-out evaluation loads its batches outside the plan: they are fetched (or read from the cache)
at once, synchronously.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from eagle3.core.features_reader import FeaturesReader
from eagle3.core.features_union import FeaturesUnion, features_dirs, rank_dir, same_features
from eagle3.core.features_writer import FeaturesWriter, bytes_per_token
from eagle3.core.protocol.features import FeaturesMeta
from eagle3.core.protocol.prepared import PreparedSample, iter_prepared
from eagle3.core.sample import ExtractedSample
from eagle3.draft_trainer.config import TrainConfig, resolve_device
from eagle3.draft_trainer.data import FeaturesData, SampleTable, canonical_order, check_layout, pack, split_ids
from eagle3.draft_trainer.errors import ConfigError, DataError
from eagle3.draft_trainer.prefetch import Prefetcher
from eagle3.draft_trainer.ttt import PackedBatch

logger = logging.getLogger(__name__)


class FeatureSource(Protocol):
    """Where streamed features come from (one or more extraction servers, through the SDK)."""

    @property
    def n_workers(self) -> int:
        """How many ``fetch`` calls may run at once (servers x requests in flight per server)."""
        ...

    def open(self, prepared_dir: Path, n_samples: int) -> tuple[FeaturesMeta, int]:
        """Check the servers against the prepared dataset; the features' meta (what a features directory
        of them records) and the longest sample the servers take, in tokens."""
        ...

    def fetch(self, samples: Sequence[PreparedSample], worker: int) -> Iterator[ExtractedSample]:
        """Every one of ``samples``' features, in any order; retries transient failures (moving between
        servers) itself, raises on a deterministic failure naming the sample."""
        ...

    def server_stats(self) -> dict[str, float]:
        """Cumulative server-side counters for the log: ``server_forward_s`` and ``server_uptime_s`` summed
        over the servers that answered (empty when none did)."""
        ...

    def close(self) -> None: ...


class EpochReport:
    """One epoch's figures for the training log: time waiting for data and its share of the wall time,
    tokens/s trained and fetched, and the servers' idle share (1 - forward seconds / uptime, from their
    ``/metrics``; a shared server's other users count as busy)."""

    def __init__(self, stats: dict[str, float]) -> None:
        self._reset(stats)

    def _reset(self, stats: dict[str, float]) -> None:
        self._stats, self._started = dict(stats), time.monotonic()
        self.load_s, self.step_s, self.tokens = 0.0, 0.0, 0

    def add(self, record: dict[str, Any]) -> None:
        self.load_s += float(record["data_s"])
        self.step_s += float(record["step_s"])
        self.tokens += int(record["tokens"])

    def close(self, step: int, steps_per_epoch: int, stats: dict[str, float]) -> dict[str, Any]:
        epoch = (step - 1) // steps_per_epoch
        wall_s = max(time.monotonic() - self._started, 1e-9)
        delta = {k: v - self._stats.get(k, 0.0) for k, v in stats.items() if k != "prefetch_bytes"}
        wait_s = delta.get("data_wait_s", self.load_s)  # streamed: blocked on the prefetch; offline: reading
        out: dict[str, Any] = {
            "step": step,
            "epoch": epoch,
            "epoch_data": True,  # the epoch's data report (the held-out evaluation is an "epoch_end" record)
            "time": time.time(),
            "epoch_wall_s": wall_s,
            "data_wait_s": wait_s,
            "data_wait_share": wait_s / wall_s,
            "data_load_s": self.load_s,
            "tokens_per_s": self.tokens / wall_s,
        }
        if "fetched_tokens" in delta:
            out["fetched_tokens"] = int(delta["fetched_tokens"])
            out["fetched_bytes"] = int(delta["fetched_bytes"])
            out["fetch_tokens_per_s"] = delta["fetched_tokens"] / wall_s
            out["prefetch_bytes"] = int(stats["prefetch_bytes"])
        if "cache_read_samples" in delta:
            out["cache_read_samples"] = int(delta["cache_read_samples"])
        uptime_s = delta.get("server_uptime_s", 0.0)
        if uptime_s > 0 and "server_forward_s" in delta:
            out["server_idle_share"] = max(0.0, 1.0 - delta["server_forward_s"] / uptime_s)
        self._reset(stats)
        return out


class FeatureCache:
    """The hybrid mode's features directory: read what it holds, append what was fetched.

    Under torchrun (``world`` > 1) each rank appends to a features directory of its own, ``DIR/rank-N``
    (a features directory takes one writer), and reads the others (DIR itself and every rank's) as one
    (``core/features_union.py``) as of its last ``refresh``: the trainer refreshes at each epoch's
    barrier, after every rank has flushed (``StreamedData.epoch_sync``)."""

    def __init__(self, cache_dir: Path, meta: FeaturesMeta, rank: int = 0, world: int = 1) -> None:
        self.root, self.meta = cache_dir, meta
        self.dir = rank_dir(cache_dir, rank) if world > 1 else cache_dir
        self.writer = FeaturesWriter.open(self.dir, meta, background=True)  # checks identity, repairs, locks
        self.reader = FeaturesReader(self.dir)
        self.others: FeaturesUnion | None = None  # the other directories of the cache
        self.n_read = 0

    def refresh(self) -> None:
        """Re-read the cache's other directories (the other ranks' as of their last flush; an earlier run's)."""
        if self.others is not None:
            self.others.close()
            self.others = None
        dirs = [d for d in features_dirs(self.root) if d != self.dir]
        if dirs:
            self.others = FeaturesUnion(dirs)
            same_features(self.meta, self.others.meta, dirs[0], f"the servers' features for {self.dir}")

    def has(self, sample_id: str) -> bool:
        return sample_id in self.writer.done_ids or (self.others is not None and sample_id in self.others)

    def get(self, sample_id: str) -> ExtractedSample:
        self.n_read += 1
        if sample_id not in self.writer.done_ids:
            assert self.others is not None  # has() said it is in the cache
            return self.others[sample_id]
        if sample_id not in self.reader:  # written by this run and not yet recorded when the reader opened
            self.writer.flush()
            self.reader.close()
            self.reader = FeaturesReader(self.dir)
        return self.reader[sample_id]

    def add(self, sample: ExtractedSample) -> None:
        if not self.has(sample.sample_id):
            self.writer.add(sample)

    def close(self) -> None:
        try:
            self.writer.close()  # the buffered samples as a last shard, then unlock
        finally:
            self.writer.release()
            self.reader.close()
            if self.others is not None:
                self.others.close()


class StreamedData(SampleTable):
    """A prepared dataset whose features stream from a ``FeatureSource`` (see the module docstring)."""

    def __init__(
        self,
        prepared_dir: str | Path,
        source: FeatureSource,
        *,
        heldout_fraction: float = 0.05,
        features_cache: str | Path | None = None,
        max_batch_tokens: int = 2048,
        prefetch_micro_batches: int = 0,
        rank: int = 0,
        world: int = 1,
        barrier: Callable[[], None] | None = None,
    ) -> None:
        self.prepared_dir = Path(prepared_dir)
        self.source = source
        samples = list(iter_prepared(self.prepared_dir))
        if not samples:
            raise DataError(f"{prepared_dir}: the prepared dataset holds no samples")
        self.meta, longest = source.open(self.prepared_dir, len(samples))
        check_layout(self.meta, f"the servers' features for {prepared_dir}")
        order = canonical_order([s.sample_id for s in samples])
        self.ids = [samples[i].sample_id for i in order]
        for a, b in zip(self.ids, self.ids[1:], strict=False):
            if a == b:
                raise DataError(f"{prepared_dir}: sample id {a!r} appears twice")
        self._input_ids = [np.asarray(samples[i].input_ids, dtype=np.int32) for i in order]
        self._loss_mask = [np.asarray(samples[i].loss_mask, dtype=np.uint8) for i in order]
        del samples
        self.n_tokens = np.array([a.shape[0] for a in self._input_ids], dtype=np.int64)  # [N]
        for pos in np.nonzero(self.n_tokens > longest)[0][:1].tolist():
            raise DataError(
                f"sample {self.ids[pos]!r} of {prepared_dir} has {int(self.n_tokens[pos])} tokens, over the "
                f"servers' limit of {longest}; re-run eagle3 prepare with --max-length {longest}"
            )
        for pos, ids in enumerate(self._input_ids):
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.meta.vocab_size):
                raise DataError(
                    f"sample {self.ids[pos]!r} of {prepared_dir} has token ids outside the servers' "
                    f"vocabulary of {self.meta.vocab_size}; prepare it for the servers' model"
                )
        self._position = {sample_id: pos for pos, sample_id in enumerate(self.ids)}
        self.split = split_ids(self.ids, heldout_fraction, str(prepared_dir))
        self.bytes_per_token = bytes_per_token(self.meta)  # L * H * 2
        n_micro = prefetch_micro_batches or max(4, 2 * source.n_workers)
        self.prefetch_bytes = n_micro * max_batch_tokens * self.bytes_per_token
        self.cache = FeatureCache(Path(features_cache), self.meta, rank, world) if features_cache else None
        self._barrier = barrier if barrier is not None else (lambda: None)
        # under torchrun with a cache, what another rank fetched is seen only after an epoch's barrier, so the
        # prefetch must not run ahead into the next epoch (it would fetch those samples again)
        self.syncs_each_epoch = self.cache is not None and world > 1
        if self.cache is not None:
            self._barrier()  # every rank's directory opened (repaired, locked) before any rank reads it
            self.cache.refresh()
        self._prefetch: Prefetcher | None = None
        self._fetched_before: dict[str, float] = {}  # the counters of the prefetches ``begin`` replaced
        self._pending: set[int] = set()  # hybrid: positions admitted for fetching, not yet in the cache
        self._started = time.monotonic()

    # -- the trainer's interface -------------------------------------------------------------------

    def begin(self, micro_batches: Iterable[list[int]]) -> None:
        if self._prefetch is not None:
            self._prefetch.close()
            for key, value in self._prefetch.stats.as_dict().items():
                self._fetched_before[key] = self._fetched_before.get(key, 0.0) + value
        self._prefetch = Prefetcher(self._fetch_positions, self.source.n_workers, self.prefetch_bytes)
        self._prefetch.start(self._with_work(micro_batches))

    def load(self, positions: list[int], max_batch_tokens: int | None = None) -> PackedBatch:
        prefetch = self._prefetch
        if prefetch is not None and prefetch.next_positions() == positions:
            got = prefetch.take(positions)
        else:  # outside the plan (held-out evaluation): at once, synchronously
            got = dict(self._fetch_positions(self._missing(positions), 0))
        samples = []
        for pos in positions:
            sample = got.get(pos)
            if sample is None:
                assert self.cache is not None  # only cached samples are not fetched
                sample = self.cache.get(self.ids[pos])
            elif self.cache is not None:
                self.cache.add(sample)
                self._pending.discard(pos)
            samples.append(sample)
        return pack(samples, max_batch_tokens)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {"prefetch_bytes": self.prefetch_bytes, **self._fetched_before}
        if self._prefetch is not None:
            for key, value in self._prefetch.stats.as_dict().items():
                out[key] = out.get(key, 0.0) + value
        if self.cache is not None:
            out["cache_read_samples"] = self.cache.n_read
        out.update(self.source.server_stats())
        return out

    def epoch_sync(self) -> None:
        """Under torchrun with a cache, between epochs (no prefetch running): write this rank's fetched
        samples, wait for every rank to have written theirs, then read what they wrote."""
        if self.cache is None:
            return
        self.cache.writer.flush()
        self._barrier()
        self.cache.refresh()

    def close(self) -> None:
        """Stop the prefetch, closing the source first so that requests in flight end now, not when their
        server has computed them; then the cache's last shard."""
        try:
            if self._prefetch is not None:
                self._prefetch.stop()
            self.source.close()
            if self._prefetch is not None:
                self._prefetch.close()
        finally:
            if self.cache is not None:
                self.cache.close()

    # -- plumbing ----------------------------------------------------------------------------------

    def _missing(self, positions: list[int]) -> list[int]:
        if self.cache is None:
            return list(positions)
        return [p for p in positions if not self.cache.has(self.ids[p])]

    def _with_work(self, micro_batches: Iterable[list[int]]) -> Iterator[tuple[list[int], list[int], int]]:
        for positions in micro_batches:
            missing = self._missing(positions)
            if self.cache is not None:  # hybrid: a sample an earlier slot fetches is in the cache by this one's turn
                missing = [p for p in missing if p not in self._pending]
                self._pending.update(missing)
            n_tokens = sum(int(self.n_tokens[p]) for p in missing)
            yield positions, missing, n_tokens * self.bytes_per_token

    def _fetch_positions(self, positions: list[int], worker: int) -> Iterator[tuple[int, ExtractedSample]]:
        if not positions:
            return
        requests = [
            PreparedSample(self.ids[p], self._input_ids[p].tolist(), self._loss_mask[p].tolist()) for p in positions
        ]
        for sample in self.source.fetch(requests, worker):
            pos = self._position.get(sample.sample_id, -1)
            if pos < 0:
                raise DataError(f"the server sent sample {sample.sample_id!r}, which is not in {self.prepared_dir}")
            expected = self._input_ids[pos]
            shape = (int(expected.shape[0]), self.meta.n_layers_stored, self.meta.hidden_size)
            if sample.states.shape != shape or not np.array_equal(sample.input_ids, expected):
                raise DataError(
                    f"sample {sample.sample_id!r}: the server sent states {sample.states.shape}"
                    f" for other tokens than asked (expected {shape})"
                )
            yield pos, sample


def training_data(
    cfg: TrainConfig,
    source: FeatureSource | None,
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], None] | None = None,
) -> SampleTable:
    """The trainer's data: a features directory (``cfg.features``), or ``cfg.prepared`` streamed from ``source``
    (``rank`` of ``world``; ``barrier`` waits for every rank: a cache under torchrun needs it)."""
    if source is None:
        if not cfg.features:
            raise ConfigError(
                "features is not set: give a features directory (--features), or a prepared "
                "dataset (--prepared) and the servers to stream it from (--server)"
            )
        return FeaturesData(
            cfg.features,
            heldout_fraction=cfg.heldout_fraction,
            loader_threads=cfg.loader_threads,
            cut_to=cfg.max_batch_tokens if cfg.truncate else None,
            # on a GPU the batch travels as stored (bf16 / FP8) and is widened there (draft_trainer/compact_batch.py)
            compact=resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0"))).type == "cuda",
        )
    if not cfg.prepared:
        raise ConfigError("streaming from servers needs the prepared dataset (--prepared, config key prepared)")
    return StreamedData(
        cfg.prepared,
        source,
        heldout_fraction=cfg.heldout_fraction,
        features_cache=cfg.features_cache or None,
        max_batch_tokens=cfg.max_batch_tokens,
        prefetch_micro_batches=cfg.prefetch_micro_batches,
        rank=rank,
        world=world,
        barrier=barrier,
    )
