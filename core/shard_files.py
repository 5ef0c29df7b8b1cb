"""One shard file of a features directory on disk: writing it crash-safely and checking it.

``ShardFile`` is a background shard's ``.tmp`` while its samples arrive (``FeaturesWriter`` with
``background=True``; the other files of the directory go through ``eagle3.core.atomic_write``, as every
crash-safe file of eagle3 does); ``write_error`` turns an ``OSError`` into the ``FeaturesWriteError`` that names
what was being written and what survived; ``shard_checksum_ok`` checks a shard against its manifest
line (xxh3-128, or sha256 in manifests written before it); ``check_free_disk`` refuses a run the disk
cannot hold before it starts; ``repair_manifest_tail`` cuts a torn last manifest line (a crash mid-append).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import BinaryIO

import xxhash

from eagle3.core.errors import FeaturesWriteError, InsufficientDiskError
from eagle3.core.protocol.features import MANIFEST_FILE, FeaturesMeta, ShardRecord
from eagle3.core.shard_states import bytes_per_token

logger = logging.getLogger(__name__)

DEFAULT_SHARD_MB = 256
DISK_OVERHEAD_BYTES = 64 << 20  # headers, manifest, one shard's .tmp slack
SYNC_EVERY_BYTES = 64 << 20  # background shard: write-back started while the stream arrives
_datasync = getattr(os, "fdatasync", os.fsync)  # fdatasync where the OS has it (not macOS)


class ShardFile:
    """A background shard's ``.tmp`` while its samples arrive: ``write`` (writer thread) appends one
    sample's states after ``header_bytes`` left for the header; a failure is kept in ``error`` and
    raised by ``finish`` (``FeaturesWriter._complete_shard`` names the shard in its error)."""

    def __init__(self, shards_dir: Path, header_bytes: int) -> None:
        self.tmp = shards_dir / f".shard-{uuid.uuid4().hex[:12]}.tmp"
        self.header_bytes = header_bytes
        self.error: OSError | None = None
        self._fh: BinaryIO | None = None
        self._unsynced = 0  # bytes written since the last early sync

    def open(self) -> BinaryIO:
        if self._fh is None:
            self._fh = open(self.tmp, "wb")  # noqa: SIM115 - closed by close()/discard()
            self._fh.seek(self.header_bytes)
        return self._fh

    def write(self, data: memoryview) -> None:
        """Append one sample's states; every ``SYNC_EVERY_BYTES`` the data so far is sent to the disk
        (``fdatasync``) while the stream is still arriving, so the fsync that completes the shard has
        little left to wait for (it stays the one that counts: nothing is recorded before it)."""
        if self.error is not None:
            return
        try:
            fh = self.open()
            fh.write(data)
            self._unsynced += memoryview(data).nbytes
            if self._unsynced >= SYNC_EVERY_BYTES:
                fh.flush()
                _datasync(fh.fileno())
                self._unsynced = 0
        except OSError as exc:
            self.error = exc

    def finish(self, chunks: list[bytes | memoryview], n_hidden: int) -> tuple[int, str]:
        """Complete the file from the shard's safetensors ``chunks`` (length, header of exactly
        ``header_bytes``, the ``n_hidden`` states pieces already written, then the rest): write the rest,
        then the header at the start, flush, fsync, close. Returns (bytes, xxh3-128 of the file, taken
        over ``chunks`` in file order from memory). Raises the first write error (``OSError``)."""
        if self.error is not None:
            raise self.error
        fh = self.open()
        for chunk in chunks[2 + n_hidden :]:  # input_ids, loss_mask, sample_offsets
            fh.write(chunk)
        size = fh.tell()
        expected = sum(memoryview(c).nbytes for c in chunks)
        if size != expected or memoryview(chunks[0]).nbytes + memoryview(chunks[1]).nbytes != self.header_bytes:
            raise OSError(errno.EIO, f"{self.tmp}: {size} bytes written, {expected} expected (a bug)")
        fh.seek(0)
        fh.write(chunks[0])
        fh.write(chunks[1])
        fh.flush()
        os.fsync(fh.fileno())
        self.close()
        digest = xxhash.xxh3_128()
        for chunk in chunks:
            digest.update(chunk)
        return size, digest.hexdigest()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()

    def discard(self) -> None:
        """Close and remove the ``.tmp`` (a failed or abandoned shard)."""
        with contextlib.suppress(OSError):
            self.close()
        self.tmp.unlink(missing_ok=True)


def shard_checksum_ok(path: Path, record: ShardRecord) -> bool:
    """The file matches its manifest checksum: xxh3_128 when recorded, else (older manifests) sha256."""
    if record.xxh3_128:
        return xxh3_file(path) == record.xxh3_128
    return sha256_file(path) == record.sha256


def xxh3_file(path: Path, chunk_bytes: int = 8 << 20) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: Path, chunk_bytes: int = 8 << 20) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            sha.update(chunk)
    return sha.hexdigest()


def write_error(exc: OSError, features_dir: Path, what: str, n_shards: int | None = None) -> Exception:
    kept = f"; the {n_shards} shards in {MANIFEST_FILE} are intact, rerun to resume" if n_shards is not None else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return FeaturesWriteError(f"{features_dir}: disk full while {what}{kept}")
    return FeaturesWriteError(f"{features_dir}: {what} failed: {exc.strerror or exc}{kept}")


def check_free_disk(features_dir: Path, n_tokens: int, meta: FeaturesMeta, shard_mb: float = DEFAULT_SHARD_MB) -> int:
    """Raise ``InsufficientDiskError`` unless the disk holds ``n_tokens`` more; returns the bytes needed."""
    needed = n_tokens * bytes_per_token(meta) + DISK_OVERHEAD_BYTES + int(shard_mb * (1 << 20))
    free = shutil.disk_usage(features_dir).free
    if free < needed:
        raise InsufficientDiskError(
            f"{features_dir}: {n_tokens} tokens need about {needed / 1e9:.2f} GB "
            f"({meta.n_layers_stored} layers x {meta.hidden_size} x {meta.dtype} per token), "
            f"only {free / 1e9:.2f} GB free"
        )
    return needed


def repair_manifest_tail(features_dir: Path) -> None:
    """Cut a torn last line (a crash mid-append) so the next append starts on a fresh line."""
    path = features_dir / MANIFEST_FILE
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        logger.warning("%s: dropping a torn last line (%d bytes)", path, len(data) - keep)
        with open(path, "r+b") as fh:
            fh.truncate(keep)
            os.fsync(fh.fileno())
