"""The one way eagle3 writes a file that must never be seen half written (features shards and
``features.json``, training checkpoints and drafts, exports, the feature cache's entries, the load-time
record): write a temporary file beside it, flush it to disk, rename it over the final name, then flush
the directory so the rename survives a power cut.

A crash at any point leaves the previous file (or none) under the final name, plus at most a temporary
``.<name>.<pid>-<random>.tmp`` in the same directory, which readers ignore and writers clean up
(``is_temp_name``). ``sync_dir=False`` skips the directory flush where losing the newest file to a power
cut costs only a recomputation (the feature cache). Stdlib only.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

TEMP_SUFFIX = ".tmp"
Chunk = bytes | bytearray | memoryview


def temp_path(path: Path) -> Path:
    """A fresh temporary name beside ``path``: hidden, unique per process and call, ending in ``.tmp``."""
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")


def is_temp_name(name: str) -> bool:
    """A name ``temp_path`` made (a write still running, or one a crash left behind)."""
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def fsync_dir(directory: Path) -> None:
    """Flush a directory's entries (a rename in it) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, path: Path, sync_dir: bool) -> None:
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)


@contextmanager
def atomic_path(path: Path, *, sync_dir: bool = True) -> Iterator[Path]:
    """A temporary path for a library that writes files itself (``torch.save``, safetensors'
    ``save_file``); when the block ends without an error the file is flushed to disk and renamed to
    ``path``; on any error it is removed and ``path`` is untouched."""
    tmp = temp_path(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        _publish(tmp, path, sync_dir)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(
    path: Path,
    data: str | Chunk | Iterable[Chunk],
    *,
    sync_dir: bool = True,
    on_chunk: Callable[[Chunk], object] | None = None,
    mode: int = 0o666,
) -> int:
    """Write ``data`` (text as UTF-8, bytes, or an iterable of chunks written in order) to ``path``
    atomically and durably; ``on_chunk`` sees each chunk as it is written (a checksum). ``mode``: the new
    file's permissions before the umask (0o600: private from the first byte). Returns the bytes written. On
    any error the temporary file is removed and ``path`` is untouched."""
    chunks: Iterable[Chunk]
    if isinstance(data, str):
        chunks = (data.encode("utf-8"),)
    elif isinstance(data, bytes | bytearray | memoryview):
        chunks = (data,)
    else:
        chunks = data
    tmp = temp_path(path)
    size = 0
    try:
        with open(tmp, "wb", opener=lambda name, flags: os.open(name, flags | os.O_EXCL, mode)) as fh:
            for chunk in chunks:
                fh.write(chunk)
                size += memoryview(chunk).nbytes
                if on_chunk is not None:
                    on_chunk(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        _publish(tmp, path, sync_dir)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def write_text_atomic(path: Path, text: str) -> None:
    """``write_atomic`` of a text file (UTF-8)."""
    write_atomic(path, text)
