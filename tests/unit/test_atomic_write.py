"""The one atomic-write helper (core/atomic_write.py) that the features writer, the trainer's checkpoint
and draft, the feature cache and the load-time record share: a finished write replaces the file whole;
a failed or killed one leaves the previous file and at most a temporary that ``is_temp_name`` knows."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3.core.atomic_write import atomic_path, is_temp_name, temp_path, write_atomic, write_text_atomic

ROOT = Path(__file__).resolve().parents[2]


def test_text_bytes_and_chunks_land_whole(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    write_text_atomic(target, "ünïcode\n")
    assert target.read_text(encoding="utf-8") == "ünïcode\n"
    seen: list[bytes] = []
    n = write_atomic(target, [b"ab", memoryview(b"cde"), bytearray(b"f")], on_chunk=lambda c: seen.append(bytes(c)))
    assert (n, target.read_bytes(), seen) == (6, b"abcdef", [b"ab", b"cde", b"f"])
    assert write_atomic(target, b"xyz", sync_dir=False) == 3 and target.read_bytes() == b"xyz"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old")

    def chunks() -> Iterator[bytes]:
        yield b"new, half"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_atomic(target, chunks())

    def serializer_fails() -> None:
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"partial")
            raise RuntimeError("serializer failed")

    with pytest.raises(RuntimeError, match="serializer failed"):
        serializer_fails()
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    with atomic_path(target) as tmp:  # a library that writes the file itself (torch.save, save_file)
        assert is_temp_name(tmp.name) and tmp.parent == tmp_path
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


KILLED_WRITER = """
import sys, time
from pathlib import Path
from eagle3.core.atomic_write import write_atomic

def chunks():
    yield b"new-" * 1000
    print("writing", flush=True)
    time.sleep(60)  # killed here, mid-write
    yield b"never"

write_atomic(Path(sys.argv[1]), chunks())
"""


def test_a_killed_writer_leaves_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint.pt"
    target.write_bytes(b"previous complete checkpoint")
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(target)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert target.read_bytes() == b"previous complete checkpoint"
    leftovers = [p.name for p in tmp_path.iterdir() if p != target]
    assert len(leftovers) == 1 and is_temp_name(leftovers[0]), leftovers  # what a scan cleans up


def test_temporary_names_are_unique_hidden_and_recognised(tmp_path: Path) -> None:
    names = {temp_path(tmp_path / "x.e3c").name for _ in range(100)}
    assert len(names) == 100 and all(is_temp_name(n) and n.startswith(".x.e3c.") for n in names)
    assert not is_temp_name("x.e3c") and not is_temp_name("shard-000001-ab.safetensors")


# The four copies issue 28 named, now calls of the helper: no module of theirs opens, fsyncs and renames
# a temporary of its own any more.
ONE_HELPER = ("core/shard_files.py", "draft_trainer/checkpoint.py", "server/cache_disk.py", "server/load_history.py")


@pytest.mark.parametrize("module", ONE_HELPER)
def test_the_four_copies_are_gone(module: str) -> None:
    tree = ast.parse((ROOT / module).read_text())
    calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert not calls & {"os.replace", "os.rename", "tempfile.mkstemp", "_fsync_replace", "fsync_dir"}, module
    defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert not defined & {"write_atomic", "write_text_atomic", "_fsync_replace", "fsync_dir"}, module
