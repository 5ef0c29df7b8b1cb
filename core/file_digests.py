"""Content digests of large files (a checkpoint's weights), computed once and remembered.

``file_digest(path)`` is the xxh3-128 of the file's bytes. Computing it reads the whole file, so the
answer is kept in a small sidecar under eagle3's cache directory (never next to the file: a model
directory may be read-only or shared), keyed by the file's identity as the OS reports it: device,
inode, size, ``mtime_ns`` and ``ctime_ns``. Any write to the file changes its mtime and ctime (and a
new copy has a new inode), so a changed file is hashed again; an unchanged one is never re-read. ctime
cannot be set back by a user (``touch -r`` restores mtime only), so a file rewritten in place and
given its old mtime back is still noticed. A chmod or a hard link also changes ctime: that costs one
re-hash, never a wrong answer.

A file in a Hugging Face hub cache snapshot is a symlink to ``blobs/<sha256 of its bytes>`` (the LFS
object id the hub verified on upload); that name is the digest, and nothing is read.

Sidecar entries are one JSON file each (``<dir>/<xxh3 of the key>.json``), written to a temporary name
and renamed, so two servers starting at once at worst both hash the same file; an unwritable cache
directory means hashing on every start, with a warning, never a failure.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import xxhash

from eagle3.core.errors import Eagle3Error

logger = logging.getLogger(__name__)

READ_CHUNK_BYTES = 16 << 20
HUB_BLOB_RE = re.compile(r"^[0-9a-f]{64}$")  # an LFS object id: the sha256 of the blob's bytes
DIGEST_DIR_NAME = "file-digests"
MAX_ENTRIES = 4096  # beyond this, entries of files that are gone or changed are dropped (prune)


class DigestCancelledError(Eagle3Error):
    """``stop`` was set while a file was being hashed."""


def default_digest_dir() -> Path:
    from eagle3.core.models import cache_dir

    return cache_dir() / DIGEST_DIR_NAME


def file_key(path: Path) -> str:
    """The file's identity: equal keys mean the same bytes unless someone forged both mtime and ctime."""
    st = os.stat(path)
    return f"dev={st.st_dev} ino={st.st_ino} size={st.st_size} mtime_ns={st.st_mtime_ns} ctime_ns={st.st_ctime_ns}"


def hub_blob_digest(path: Path) -> str | None:
    """``sha256:<hex>`` when ``path`` is a hub snapshot's link to an LFS blob, else None."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    if target.parent.name == "blobs" and HUB_BLOB_RE.match(target.name):
        return f"sha256:{target.name}"
    return None


def hash_file(path: Path, stop: threading.Event | None = None, on_bytes: Callable[[int], None] | None = None) -> str:
    """``xxh3_128:<hex>`` of the file's bytes (read in ``READ_CHUNK_BYTES`` chunks into one buffer)."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(READ_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while True:
            if stop is not None and stop.is_set():
                raise DigestCancelledError(str(path))
            n = fh.readinto(view)
            if not n:
                break
            digest.update(view[:n])
            if on_bytes is not None:
                on_bytes(n)
    return f"xxh3_128:{digest.hexdigest()}"


class FileDigests:
    """``digest(path)``: a file's content digest, from the sidecar when the file is unchanged."""

    def __init__(self, digest_dir: Path | None = None) -> None:
        self.dir = Path(digest_dir) if digest_dir is not None else default_digest_dir()
        self.hashed_bytes = 0  # read by this object (0 when every digest came from the sidecar or the hub)
        self._warned = False

    def _entry(self, key: str) -> Path:
        return self.dir / f"{xxhash.xxh3_64_hexdigest(key.encode())}.json"

    def remembered(self, key: str) -> str | None:
        try:
            data = json.loads(self._entry(key).read_text())
        except (OSError, ValueError):
            return None
        if isinstance(data, dict) and data.get("key") == key and isinstance(data.get("digest"), str):
            return str(data["digest"])
        return None

    def remember(self, path: Path, key: str, digest: str) -> None:
        body = json.dumps({"key": key, "digest": digest, "path": str(path)}) + "\n"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w") as fh:
                fh.write(body)
            os.replace(tmp, self._entry(key))
            if sum(1 for _ in zip(self.dir.iterdir(), range(MAX_ENTRIES + 1), strict=False)) > MAX_ENTRIES:
                self.prune()
        except OSError as exc:
            if not self._warned:
                logger.warning(
                    "cannot keep weight digests in %s (%s): they are re-hashed on every start", self.dir, exc
                )
                self._warned = True

    def prune(self) -> int:
        """Drop the entries whose file is gone or changed (they can never be used again); returns how many."""
        dropped = 0
        for entry in self.dir.glob("*.json"):
            try:
                data = json.loads(entry.read_text())
                current = file_key(Path(data["path"]))
            except (OSError, ValueError, KeyError, TypeError):
                current = None
            if current is None or current != data.get("key"):
                entry.unlink(missing_ok=True)
                dropped += 1
        return dropped

    def digest(self, path: Path, stop: threading.Event | None = None) -> str:
        hub = hub_blob_digest(path)
        if hub is not None:
            return hub
        key = file_key(path)
        known = self.remembered(key)
        if known is not None:
            return known

        def count(n: int) -> None:
            self.hashed_bytes += n

        digest = hash_file(path, stop, count)
        if file_key(path) != key:  # written while we read it: this digest names no version of the file
            raise OSError(f"{path} changed while it was being hashed; start again once it is written")
        self.remember(path, key, digest)
        return digest

    def digests(self, paths: Sequence[Path], stop: threading.Event | None = None) -> list[str]:
        return [self.digest(path, stop) for path in paths]
