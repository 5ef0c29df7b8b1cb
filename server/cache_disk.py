"""The feature cache's disk tier (``--feature-cache-dir``, ``--cache-gb``): one file per extracted sample.

Layout: ``<cache_dir>/v2/<key[:2]>/<key>.e3c`` where ``key`` is the entry's 32 hex digits
(``server/feature_cache.py``: xxh3-128 of everything that determines the bytes), and
``<cache_dir>/v2/secret``: 32 random bytes made by the first server that opens the directory. One file:

    MAGIC (8 B) | header length (u32 LE) | header JSON, padded with spaces to a 64-byte boundary |
    states (raw little-endian, C order) | input ids (int32 LE) | MAC of every byte before it (16 B)

The MAC is keyed BLAKE2b-128 under the directory's secret (``hashlib``; about 0.75 GB/s on one core
here against xxh3's 8.6, paid once per disk write and disk hit, not per memory hit): an entry planted
or edited by anyone who cannot read the secret fails it, however they recompute a checksum. Who can
read the secret can forge entries: directories are made 0700 and files 0600 (the servers sharing a
directory run as one user), and a secret readable by group or others is refused at start.
(Layout ``v1``, xxh3 without a key, is not read; delete ``<cache_dir>/v1`` to reclaim its space.)

Invariants:

* A file under its final name is complete: written by ``eagle3.core.atomic_write`` as
  ``.<name>.<pid>-<random>.tmp`` in the same directory, fsynced, then ``os.replace``d (atomic on POSIX;
  no directory fsync: a lost entry is only recomputed); a crash leaves at most a temporary file, removed
  by the next scan. Two servers sharing the directory may write the same entry at once: each
  rename installs a whole file, and both hold the same bytes.
* A read checks the magic, the sizes the header declares against the file's size, the checksum and
  the stored token ids against the asked ones; any failure is a miss (the file is deleted), never a
  wrong answer.
* LRU by modification time: a hit touches the file (``os.utime``), the scan at start orders the index
  by it, and writes evict the oldest entries until the tier's bytes are within ``max_bytes``. Each
  server bounds the entries it knows of (its scan, its writes, its hits): servers sharing a directory
  each keep it within their own limit for their own entries.
* Writes run on one background thread with a bounded queue (``MAX_PENDING_BYTES``): the forward
  path never waits for the disk; when the queue is full the entry is not written (memory keeps it).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3.core.atomic_write import is_temp_name, temp_path, write_atomic
from eagle3.core.errors import Eagle3Error

logger = logging.getLogger(__name__)
MAGIC = b"E3FCACHE"
LAYOUT_VERSION = "v2"
SECRET_NAME = "secret"  # noqa: S105 (a file name, not a password)
SECRET_BYTES = 32
DIR_MODE, FILE_MODE = 0o700, 0o600  # the entries are tenants' token ids and states
SUFFIX = ".e3c"
ALIGN = 64  # the states start on a 64-byte boundary of the file (and of the buffer it is read into)
DIGEST_BYTES = 16
MAX_PENDING_BYTES = 256 << 20  # states queued for the writer thread; over it a write is dropped
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CorruptEntryError(Eagle3Error, ValueError):
    """A cache file that fails a check (truncated, wrong magic, MAC, sizes, other token ids)."""


class CacheSecretError(Eagle3Error, OSError):
    """The cache directory's secret cannot be used (readable by others, wrong size, unreadable)."""


def _mac(secret: bytes) -> Any:
    return hashlib.blake2b(key=secret, digest_size=DIGEST_BYTES)


def load_secret(root: Path) -> bytes:
    """The directory's MAC key: read, or made once (0600, linked into place whole so two servers starting
    together agree on one). Refused when group or others may read it: they could forge entries."""
    path = root / SECRET_NAME
    if not path.exists():
        tmp = temp_path(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(os.urandom(SECRET_BYTES))
                fh.flush()
                os.fsync(fh.fileno())
            with contextlib.suppress(FileExistsError):  # another server made it first: use theirs
                os.link(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    st = path.stat()
    if st.st_mode & 0o077:
        raise CacheSecretError(
            f"{path} is readable by group or others (mode {st.st_mode & 0o777:o}): whoever reads it can plant "
            f"cache entries every server serves; run 'chmod 600 {path}' (or delete it: a new one is made and "
            "the entries made under the old one are recomputed)"
        )
    secret = path.read_bytes()
    if len(secret) != SECRET_BYTES:
        raise CacheSecretError(f"{path} holds {len(secret)} bytes, not {SECRET_BYTES}: delete it to make a new one")
    return secret


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes (C order, little-endian); bf16 through its int16 view; no copy."""
    t = t.contiguous()
    arr = t.view(torch.int16).numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()
    return arr.data.cast("B")


def encode_entry(ids: np.ndarray, states: torch.Tensor, secret: bytes) -> list[bytes | memoryview]:
    """The file's bytes as parts to write in order (the states are not copied), MACed under ``secret``."""
    header = json.dumps({"dtype": DTYPE_NAMES[states.dtype], "shape": list(states.shape), "n_tokens": int(ids.size)})
    head_len = len(header)
    pad = (-(len(MAGIC) + 4 + head_len)) % ALIGN
    head = MAGIC + struct.pack("<I", head_len + pad) + header.encode() + b" " * pad
    body: list[bytes | memoryview] = [head, raw_bytes(states), np.ascontiguousarray(ids, dtype="<i4").data.cast("B")]
    digest = _mac(secret)
    for part in body:
        digest.update(part)
    return [*body, digest.digest()]


def decode_entry(data: bytearray, ids: np.ndarray, secret: bytes) -> torch.Tensor:
    """The states stored in ``data`` (a whole file), checked; ``CorruptEntryError`` on any mismatch. The
    tensor is a view of ``data`` (no copy)."""
    fixed = len(MAGIC) + 4
    if len(data) < fixed + DIGEST_BYTES or bytes(data[: len(MAGIC)]) != MAGIC:
        raise CorruptEntryError(f"{len(data)} bytes without the cache file's magic")
    body = memoryview(data)[:-DIGEST_BYTES]
    mac = _mac(secret)
    mac.update(body)
    if not hmac.compare_digest(mac.digest(), bytes(data[-DIGEST_BYTES:])):
        raise CorruptEntryError("MAC mismatch (a damaged entry, or one not written by a server holding the secret)")
    (head_len,) = struct.unpack_from("<I", data, len(MAGIC))
    try:
        header = json.loads(bytes(data[fixed : fixed + head_len]))
        dtype = DTYPES[header["dtype"]]
        shape = tuple(int(x) for x in header["shape"])
        n_tokens = int(header["n_tokens"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptEntryError(f"bad header ({exc})") from None
    start = fixed + head_len
    n_elems = int(np.prod(shape)) if shape else 0
    states_bytes = n_elems * torch.empty((), dtype=dtype).element_size()
    if start + states_bytes + 4 * n_tokens != len(body) or not shape or shape[0] != n_tokens:
        raise CorruptEntryError(f"sizes do not add up: header {header}, {len(data)} bytes")
    stored_ids = np.frombuffer(data, dtype="<i4", count=n_tokens, offset=start + states_bytes)
    if stored_ids.size != ids.size or not np.array_equal(stored_ids, ids):
        raise CorruptEntryError("the entry holds other token ids (a hash collision)")
    return torch.frombuffer(data, dtype=dtype, count=n_elems, offset=start).view(shape)


@dataclass
class DiskStats:
    writes: int = 0
    dropped_writes: int = 0  # the writer's queue was full
    evictions: int = 0
    corrupt: int = 0  # entries that failed a check on read (deleted)


class DiskTier:
    def __init__(self, cache_dir: str | Path, max_bytes: int) -> None:
        self.root = Path(cache_dir) / LAYOUT_VERSION
        Path(cache_dir).mkdir(parents=True, exist_ok=True, mode=DIR_MODE)  # 0700 when made here
        self.root.mkdir(exist_ok=True, mode=DIR_MODE)
        with contextlib.suppress(PermissionError):  # not ours (another user's server made it): left as it is
            self.root.chmod(DIR_MODE)
        self.secret = load_secret(self.root)
        self.max_bytes = max_bytes
        self.stats = DiskStats()
        self._lock = threading.Lock()  # the index and its byte count
        self._index: OrderedDict[str, int] = OrderedDict()  # key hex -> file size, oldest first
        self.bytes = 0
        self._pending_bytes = 0
        self._queue: queue.Queue[tuple[str, np.ndarray, torch.Tensor] | None] = queue.Queue()
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="eagle3-cache-writer", daemon=True)
        self._writer.start()

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{SUFFIX}"

    def _scan(self) -> None:
        """Rebuild the index from the directory (oldest first); remove temporary files of dead writers."""
        found: list[tuple[float, str, int]] = []
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                if is_temp_name(path.name):
                    if time.time() - st.st_mtime > 60:  # another live server may be writing a young one
                        path.unlink(missing_ok=True)
                elif path.name.endswith(SUFFIX):
                    found.append((st.st_mtime, path.name[: -len(SUFFIX)], st.st_size))
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self.bytes += size
        self._evict()

    @property
    def n_entries(self) -> int:
        return len(self._index)

    def get(self, key: str, ids: np.ndarray) -> torch.Tensor | None:
        """The stored states, or None (absent, or corrupt: then the file is deleted)."""
        path = self.path(key)
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                data = bytearray(size)
                if fh.readinto(data) != size:
                    raise CorruptEntryError("short read")
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as exc:
            logger.warning("feature cache: cannot read %s (%s); recomputing", path, exc)
            return None
        try:
            states = decode_entry(data, ids, self.secret)
        except CorruptEntryError as exc:
            logger.warning("feature cache: %s is corrupt (%s); deleted, recomputing", path, exc)
            self.stats.corrupt += 1
            path.unlink(missing_ok=True)
            self._forget(key)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recency, for this server's index and every other server's next scan
        with self._lock:
            if key not in self._index:  # written by another server sharing the directory
                self.bytes += size
            self._index[key] = size
            self._index.move_to_end(key)
        return states

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.bytes -= size

    def put(self, key: str, ids: np.ndarray, states: torch.Tensor) -> None:
        """Queue ``states`` for writing (returns at once); dropped when the queue holds too much."""
        nbytes = states.numel() * states.element_size()
        with self._lock:
            if key in self._index:
                return
            if self._pending_bytes + nbytes > MAX_PENDING_BYTES:
                self.stats.dropped_writes += 1
                return
            self._pending_bytes += nbytes
        self._queue.put((key, ids, states))

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued write is on disk (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._pending_bytes and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self, timeout_s: float = 10.0) -> None:
        self.flush(timeout_s)
        self._queue.put(None)
        self._writer.join(timeout_s)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            key, ids, states = item
            try:
                self._write(key, ids, states)
            except OSError as exc:  # a full or read-only disk: the memory tier still serves it
                logger.warning("feature cache: cannot write entry %s (%s)", key, exc)
            finally:
                with self._lock:
                    self._pending_bytes -= states.numel() * states.element_size()

    def _write(self, key: str, ids: np.ndarray, states: torch.Tensor) -> None:
        parts = encode_entry(ids, states, self.secret)
        size = sum(memoryview(p).nbytes for p in parts)
        if size > self.max_bytes:
            return
        path = self.path(key)
        path.parent.mkdir(exist_ok=True, mode=DIR_MODE)
        write_atomic(path, parts, sync_dir=False, mode=FILE_MODE)
        with self._lock:
            if key not in self._index:
                self.bytes += size
            self._index[key] = size
            self._index.move_to_end(key)
            self.stats.writes += 1
        self._evict()

    def _evict(self) -> None:
        """Delete the least recently used entries until the tier is within ``max_bytes``."""
        while True:
            with self._lock:
                if self.bytes <= self.max_bytes or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self.bytes -= size
                self.stats.evictions += 1
            self.path(key).unlink(missing_ok=True)

    def describe(self) -> dict[str, Any]:
        return {"dir": str(self.root.parent), "max_bytes": self.max_bytes}
