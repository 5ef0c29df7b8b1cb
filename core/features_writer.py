"""Append samples to a features directory (``core/protocol/features.py``), crash-safe and resumable.

Samples accumulate in one shard buffer (about ``shard_mb``; a single larger sample gets a shard of
its own); a full buffer becomes ``shards/.<name>.<pid>-<random>.tmp`` (``core/atomic_write.py``;
safetensors via ``eagle3.core.codec.safetensors_parts``), is fsynced, renamed to its final name, the directory fsynced,
and only then one manifest line (with the file's xxh3-128) is appended and fsynced. So at any instant
the manifest lists complete shards only; what a crash leaves behind is an orphan file or a torn last
manifest line, and ``open`` cleans both up. A full disk raises ``FeaturesWriteError`` with the
manifest as it was.

With ``background=True`` (``extract_dataset``) one writer thread does the disk work and the states
reach the disk while the shard fills: each sample's states are written into the shard's ``.tmp`` as
it is added (after ``header_bytes`` reserved for the safetensors header, which is padded with spaces
to exactly that size), so when the shard is full only the small tensors after the states, the header
and the commit above remain (the last shard of a run no longer writes all of its bytes after the
stream ended). The checksum is computed from the samples' arrays in file order at that point (memory
speed; the arrays are kept until the shard is recorded). The order of the commit is the same in
both modes, line for line: ``.tmp`` complete -> fsync -> rename -> fsync directory -> manifest line
-> fsync manifest.

The directory's format (``FeaturesMeta.dtype`` / ``shard_codec``, ``core/protocol/features.py``,
``core/shard_states.py``) is fixed when it is created: an FP8 directory gets each sample's e4m3 codes
and scales (a bf16 sample is quantized in ``add``), a compressed one each sample's states compressed
in ``add`` (on the caller's thread, before the bytes take the path above: the commit order does not
change, only what the shard's bytes are). Resuming a directory with another format, or adding an
FP8 sample to a lossless one, is refused.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import xxhash
from filelock import FileLock, Timeout

from eagle3.core.atomic_write import fsync_dir, write_atomic
from eagle3.core.codec import safetensors_parts
from eagle3.core.errors import FeaturesLockedError, IncompatibleError
from eagle3.core.progress import ProgressBar
from eagle3.core.protocol.features import (
    FEATURES_META_FILE,
    MANIFEST_FILE,
    SHARDS_DIR,
    FeaturesFormatError,
    FeaturesMeta,
    ShardRecord,
    iter_manifest,
    read_features_meta,
)
from eagle3.core.sample import ExtractedSample
from eagle3.core.shard_files import (
    DEFAULT_SHARD_MB,
    ShardFile,
    check_free_disk,
    repair_manifest_tail,
    shard_checksum_ok,
    write_error,
)
from eagle3.core.shard_states import bytes_per_token, cumulative, i64_bytes, raw_bytes, states_specs, stored_states

__all__ = ["DEFAULT_SHARD_MB", "FeaturesWriter", "bytes_per_token", "check_free_disk"]

logger = logging.getLogger(__name__)

HEADER_RESERVE_MAX_BYTES = 1 << 20  # background writer: safetensors header room per shard (~10k sample ids)


LOCK_FILE = ".lock"  # held by the writer while the directory is open (FeaturesWriter.open)


class FeaturesWriter:
    """``open`` a directory (new or partly filled), ``add`` samples, ``close``; ``done_ids`` to resume."""

    def __init__(
        self,
        features_dir: str | Path,
        meta: FeaturesMeta,
        *,
        shard_mb: float = DEFAULT_SHARD_MB,
        background: bool = False,
    ) -> None:
        self.dir = Path(features_dir)
        self.meta = meta
        self.shard_bytes = int(shard_mb * (1 << 20))
        self.records: list[ShardRecord] = []
        self.done_ids: set[str] = set()
        self.bytes_written = 0  # shard bytes written by this writer
        self.n_samples_written = 0
        self.n_tokens_written = 0
        # background: a full shard is written by one writer thread while ``add`` keeps filling the next
        # (at most one shard in flight; manifest lines stay in shard order); ``flush``/``close`` wait for it
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="eagle3-shard") if background else None
        self._in_flight: Future[ShardRecord] | None = None
        self._lock: FileLock | None = None
        # background: the shard being filled has its .tmp open on the writer thread; the header goes in
        # the first header_bytes when the shard is full, so a shard also ends when its ids would not fit
        self.header_bytes = max(4096, min(HEADER_RESERVE_MAX_BYTES, self.shard_bytes // 256)) // 8 * 8
        self._shard: ShardFile | None = None
        self._reset_buffer()

    @classmethod
    def open(
        cls,
        features_dir: str | Path,
        meta: FeaturesMeta,
        *,
        shard_mb: float = DEFAULT_SHARD_MB,
        verify: bool = False,
        background: bool = False,
    ) -> FeaturesWriter:
        """Create the directory or resume it: check features.json, repair the manifest tail, drop orphans.

        The directory is locked first (``LOCK_FILE``, ``filelock``: an OS lock, gone when the process
        dies): a second writer would take the first one's in-flight shard for an orphan and delete
        it, so it is refused with ``FeaturesLockedError`` instead. ``close()``/``release()`` unlock."""
        writer = cls(features_dir, meta, shard_mb=shard_mb, background=background)
        try:
            writer.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise write_error(exc, writer.dir, "creating the features directory") from None
        writer._lock = FileLock(writer.dir / LOCK_FILE)
        try:
            writer._lock.acquire(timeout=0)
        except Timeout:
            raise FeaturesLockedError(
                f"{writer.dir} is being written by another process (eagle3 extract into the same --out); "
                "wait for it to finish, or give this run another --out"
            ) from None
        try:
            writer._prepare(verify)
        except BaseException:
            writer.release()
            raise
        return writer

    def release(self) -> None:
        """Unlock the directory (idempotent)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # -- resume -----------------------------------------------------------------------------------

    def _prepare(self, verify: bool) -> None:
        shards = self.dir / SHARDS_DIR
        try:
            shards.mkdir(parents=True, exist_ok=True)
            meta_path = self.dir / FEATURES_META_FILE
            if meta_path.exists():
                self._check_identity(read_features_meta(self.dir))
            else:
                write_atomic(meta_path, self.meta.to_json() + "\n")
            repair_manifest_tail(self.dir)
        except OSError as exc:
            raise write_error(exc, self.dir, "preparing the features directory") from None
        self.records = list(iter_manifest(self.dir))
        recorded = set()
        bar = ProgressBar("verify", len(self.records), unit="shard", enabled=None if verify else False)
        for record in self.records:
            path = shards / record.shard
            if not path.is_file() or path.stat().st_size != record.bytes:
                found = "missing" if not path.is_file() else f"{path.stat().st_size} bytes"
                raise FeaturesFormatError(
                    f"{path}: listed in {MANIFEST_FILE} with {record.bytes} bytes but {found}; "
                    "the directory is damaged (move the shard back or start a new --out)"
                )
            if verify and not shard_checksum_ok(path, record):
                raise FeaturesFormatError(f"{path}: checksum differs from {MANIFEST_FILE} (corrupt shard)")
            bar.update(1)
            duplicate = self.done_ids.intersection(record.sample_ids)
            if duplicate:
                raise FeaturesFormatError(f"{MANIFEST_FILE}: sample {sorted(duplicate)[0]!r} recorded twice")
            self.done_ids.update(record.sample_ids)
            recorded.add(record.shard)
        bar.close()
        for path in shards.iterdir():
            if path.name not in recorded:
                logger.info("removing orphan %s (not in %s)", path, MANIFEST_FILE)
                path.unlink()

    def _check_identity(self, existing: FeaturesMeta) -> None:
        """The directory's model (``features.json``) must be the server's (``ModelIdentity``: any field),
        and its format (dtype, compression) the one asked for: one format per directory."""
        difference = existing.identity.diff(self.meta.identity)
        if difference:
            raise IncompatibleError(
                f"{self.dir} holds features of another model than the server's ({difference}; this "
                "directory -> the server); use a new --out directory or the server that made these features"
            )
        if existing.feature_format != self.meta.feature_format:
            raise IncompatibleError(
                f"{self.dir} holds {existing.feature_format} features, this run writes {self.meta.feature_format} "
                "(dtype/compression); a directory holds one format: give this run a new directory, or the "
                f"--feature-dtype / --compress-shards of the run that started {self.dir}"
            )

    # -- writing ----------------------------------------------------------------------------------

    def _reset_buffer(self) -> None:
        # the samples' own arrays (views, not copies) until the shard is written: callers must not modify
        # a sample's arrays after ``add``
        self._hidden: list[memoryview] = []  # per sample: states (compressed at rest: one encoded blob)
        self._scales: list[memoryview] = []  # FP8: per sample float32 [n, L]
        self._ids: list[memoryview] = []
        self._mask: list[memoryview] = []
        self._buffered_bytes = 0
        self._sample_ids: list[str] = []
        self._n_tokens: list[int] = []
        self._header_estimate = 1024 + 2 * len(json.dumps(list(self.meta.aux_layer_ids)))  # an upper bound

    @property
    def buffered_bytes(self) -> int:
        return self._buffered_bytes

    def add(self, sample: ExtractedSample) -> None:
        n, n_layers, hidden = sample.states.shape
        if (n_layers, hidden) != (self.meta.n_layers_stored, self.meta.hidden_size):
            raise IncompatibleError(
                f"sample {sample.sample_id!r} has states [{n}, {n_layers}, {hidden}], this directory stores "
                f"[n, {self.meta.n_layers_stored}, {self.meta.hidden_size}]"
            )
        if sample.sample_id in self.done_ids:
            raise FeaturesFormatError(f"sample {sample.sample_id!r} is already in {self.dir}")
        id_bytes = len(json.dumps(json.dumps([sample.sample_id]))) + 4  # its share of the header, escaped twice
        if self._sample_ids and (
            self.buffered_bytes + n * bytes_per_token(self.meta) > self.shard_bytes
            or (self._pool is not None and self._header_estimate + id_bytes > self.header_bytes - 8)
        ):
            self._shard_full()
        states, scales = stored_states(self.meta, sample, self.dir)
        for parts, view in (
            (self._hidden, states),
            (self._scales, scales),
            (self._ids, raw_bytes(sample.input_ids, "<i4")),
            (self._mask, raw_bytes(sample.loss_mask, "u1")),
        ):
            if view is not None:
                parts.append(view)
                self._buffered_bytes += view.nbytes
        self._sample_ids.append(sample.sample_id)
        self._n_tokens.append(n)
        self._header_estimate += id_bytes
        self.done_ids.add(sample.sample_id)
        if self._pool is not None:  # its states go into the shard's .tmp now, on the writer thread
            if self._shard is None:
                self._shard = ShardFile(self.dir / SHARDS_DIR, self.header_bytes)
            self._pool.submit(self._shard.write, self._hidden[-1])
        if self.buffered_bytes >= self.shard_bytes:
            self._shard_full()

    def _shard_full(self) -> None:
        if self._pool is None:
            self.flush()
            return
        self.wait()  # at most one shard in flight (raises its FeaturesWriteError, if any)
        shard, self._shard = self._shard, None
        self._in_flight = self._pool.submit(self._write_buffers, shard, *self._take_buffer())

    def wait(self) -> None:
        """Block until the shard being written in the background is recorded (no-op otherwise)."""
        future, self._in_flight = self._in_flight, None
        if future is not None:
            future.result()

    def flush(self) -> ShardRecord | None:
        """Write the buffered samples as one shard and record it (after any background shard); nothing
        to do when empty."""
        self.wait()
        if not self._sample_ids:
            return None
        if self._pool is None:
            return self._write_buffers(None, *self._take_buffer())
        shard, self._shard = self._shard, None
        return self._pool.submit(self._write_buffers, shard, *self._take_buffer()).result()

    def _take_buffer(
        self,
    ) -> tuple[list[str], list[int], list[memoryview], list[memoryview], list[memoryview], list[memoryview]]:
        out = (self._sample_ids, self._n_tokens, self._hidden, self._scales, self._ids, self._mask)
        self._reset_buffer()
        return out

    def _write_buffers(
        self,
        shard: ShardFile | None,
        ids: list[str],
        n_tokens: list[int],
        hidden: list[memoryview],
        scales: list[memoryview],
        token_ids: list[memoryview],
        mask: list[memoryview],
    ) -> ShardRecord:
        """Complete one shard and record it. ``shard``: its ``.tmp`` with the states already written
        (background), or None: write the whole file now."""
        total = sum(n_tokens)
        specs = states_specs(self.meta, total, hidden, scales)
        specs["input_ids"] = ("I32", (total,), token_ids)  # [T]
        specs["loss_mask"] = ("U8", (total,), mask)  # [T]
        specs["sample_offsets"] = ("I64", (len(ids) + 1,), [memoryview(i64_bytes(cumulative(n_tokens)))])  # [n + 1]
        metadata = {
            "schema_version": str(self.meta.schema_version),
            "sample_ids": json.dumps(ids),
            "layer_ids": json.dumps(list(self.meta.aux_layer_ids)),
            "final_norm_applied": str(self.meta.final_norm_applied).lower(),
            "dtype": self.meta.dtype,
            "codec": self.meta.shard_codec,
        }
        name = f"shard-{len(self.records):06d}-{uuid.uuid4().hex[:12]}.safetensors"
        if shard is None:
            size, digest = self._write_shard(name, safetensors_parts(specs, metadata))
        else:
            size, digest = self._complete_shard(shard, name, specs, metadata, len(hidden))
        record = ShardRecord(
            name,
            tuple(ids),
            tuple(n_tokens),
            size,
            "",
            self.meta.model_id,
            self.meta.aux_layer_ids,
            xxh3_128=digest,
            dtype=self.meta.dtype,
            codec=self.meta.shard_codec,
        )
        self._append_manifest(record)
        self.records.append(record)
        self.bytes_written += size
        self.n_samples_written += len(ids)
        self.n_tokens_written += total
        return record

    def _write_shard(self, name: str, chunks: list[bytes | memoryview]) -> tuple[int, str]:
        final = self.dir / SHARDS_DIR / name
        digest = xxhash.xxh3_128()
        try:
            size = write_atomic(final, chunks, on_chunk=digest.update)
        except OSError as exc:
            raise write_error(exc, self.dir, f"writing shard {name}", len(self.records)) from None
        return size, digest.hexdigest()

    def _complete_shard(
        self,
        shard: ShardFile,
        name: str,
        specs: dict[str, tuple[str, tuple[int, ...], list[memoryview]]],
        metadata: dict[str, str],
        n_hidden: int,
    ) -> tuple[int, str]:
        """The background path of ``_write_shard``: the states are in ``shard``'s ``.tmp`` already; write
        what follows them and the header, then fsync and rename (same order). The checksum is taken over
        the parts in file order, from memory."""
        try:
            chunks = safetensors_parts(specs, metadata, header_bytes=shard.header_bytes)
        except ValueError:  # more ids than the header room (add() ends shards before): write it whole
            shard.discard()
            return self._write_shard(name, safetensors_parts(specs, metadata))
        final = self.dir / SHARDS_DIR / name
        try:
            size, digest = shard.finish(chunks, n_hidden)
            os.replace(shard.tmp, final)
            fsync_dir(final.parent)
        except OSError as exc:
            shard.discard()
            raise write_error(exc, self.dir, f"writing shard {name}", len(self.records)) from None
        return size, digest

    def _append_manifest(self, record: ShardRecord) -> None:
        path = self.dir / MANIFEST_FILE
        size_before = path.stat().st_size if path.exists() else 0
        try:
            with open(path, "ab") as fh:
                fh.write(record.to_line().encode())
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            try:  # take back a partial line; the shard becomes an orphan that open() removes
                with open(path, "r+b") as fh:
                    fh.truncate(size_before)
                (self.dir / SHARDS_DIR / record.shard).unlink(missing_ok=True)
            except OSError:
                pass
            raise write_error(exc, self.dir, f"recording shard {record.shard}", len(self.records)) from None

    def close(self) -> None:
        try:
            self.flush()
            self.shutdown()
        finally:
            self.release()

    def shutdown(self) -> None:
        """Stop the background writer thread (after the shard it is writing; its errors are not raised)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
