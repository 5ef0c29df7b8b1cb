"""A checkpoint's revision names its weights by content (core/identity.py, core/file_digests.py).

A fine-tuned copy with identical file sizes gets another revision; an unchanged checkpoint gets the same
revision on every start without one weight byte being read again (the digests are remembered in eagle3's
cache directory, never in the model directory); a file rewritten in place is noticed even when its old
mtime is put back; a hub snapshot's blob is named by the hub's own sha256 without reading it.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from eagle3.core import file_digests
from eagle3.core.file_digests import FileDigests, hub_blob_digest
from eagle3.core.identity import checkpoint_revision, weight_files
from tests.e2e.live_server import file_sizes, scaled_copy, tiny_llama_dir


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_dir(tmp_path_factory.mktemp("run1") / "final", n_layers=2)


def test_a_same_size_fine_tuned_copy_has_another_revision(model: Path, tmp_path: Path) -> None:
    tuned = scaled_copy(model, tmp_path / "run2" / "final")
    assert file_sizes(tuned) == file_sizes(model), "the copy must keep every file's size (the case names+sizes missed)"
    assert (tuned / "model.safetensors").read_bytes() != (model / "model.safetensors").read_bytes()
    digests = FileDigests(tmp_path / "digests")
    assert checkpoint_revision(tuned, digests) != checkpoint_revision(model, digests)
    # an exact copy (new inodes, same bytes) is the same checkpoint
    same = shutil.copytree(model, tmp_path / "copy" / "final")
    assert checkpoint_revision(same, digests) == checkpoint_revision(model, digests)


def test_a_restart_reads_no_weight_byte(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = FileDigests(tmp_path / "digests")
    revision = checkpoint_revision(model, first)
    assert first.hashed_bytes == sum(p.stat().st_size for p in weight_files(model)) > 0

    def no_reading(*_args: object, **_kw: object) -> str:
        raise AssertionError("a weight file was read again")

    monkeypatch.setattr(file_digests, "hash_file", no_reading)
    again = FileDigests(tmp_path / "digests")  # a new process: only the sidecar carries over
    assert checkpoint_revision(model, again) == revision and again.hashed_bytes == 0


def test_a_file_rewritten_in_place_with_its_old_mtime_is_hashed_again(tmp_path: Path, model: Path) -> None:
    ckpt = shutil.copytree(model, tmp_path / "final")
    digests = FileDigests(tmp_path / "digests")
    before = checkpoint_revision(ckpt, digests)
    weights = ckpt / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last weight
    with open(weights, "r+b") as fh:  # same inode, same size
        fh.write(data)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # `touch -r`: the old mtime back
    assert weights.stat().st_ino == st.st_ino and weights.stat().st_mtime_ns == st.st_mtime_ns
    assert checkpoint_revision(ckpt, FileDigests(tmp_path / "digests")) != before


def test_a_read_only_model_directory_is_never_written(tmp_path: Path, model: Path) -> None:
    ckpt = shutil.copytree(model, tmp_path / "final")
    listing = sorted(p.name for p in ckpt.iterdir())
    ckpt.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        digests = FileDigests(tmp_path / "digests")
        revision = checkpoint_revision(ckpt, digests)
        assert sorted(p.name for p in ckpt.iterdir()) == listing
        assert len(list((tmp_path / "digests").glob("*.json"))) == len(weight_files(ckpt))
    finally:
        ckpt.chmod(0o755)
    # nowhere to remember (a file where the digest directory should be): hashed again, same answer
    (tmp_path / "blocked").write_text("")
    stuck = FileDigests(tmp_path / "blocked" / "digests")
    assert checkpoint_revision(ckpt, stuck) == revision and stuck.hashed_bytes > 0


def test_a_hub_snapshot_blob_is_named_by_its_sha256_without_reading(tmp_path: Path, model: Path) -> None:
    import hashlib

    blobs = tmp_path / "models--org--m" / "blobs"
    snapshot = tmp_path / "models--org--m" / "snapshots" / ("c" * 40)
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for src in model.iterdir():
        data = src.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / src.name).symlink_to(os.path.relpath(blob, snapshot))
    weights = snapshot / "model.safetensors"
    assert hub_blob_digest(weights) == f"sha256:{hashlib.sha256(weights.read_bytes()).hexdigest()}"
    digests = FileDigests(tmp_path / "digests")
    checkpoint_revision(snapshot, digests)
    assert digests.hashed_bytes == 0


def test_prune_drops_entries_of_files_that_are_gone_or_changed(tmp_path: Path) -> None:
    digests = FileDigests(tmp_path / "digests")
    kept, gone, changed = (tmp_path / name for name in ("kept.bin", "gone.bin", "changed.bin"))
    for path in (kept, gone, changed):
        path.write_bytes(os.urandom(1000))
        digests.digest(path)
    gone.unlink()
    changed.write_bytes(os.urandom(1000))
    assert digests.prune() == 2
    assert len(list((tmp_path / "digests").glob("*.json"))) == 1
    assert FileDigests(tmp_path / "digests").remembered(file_digests.file_key(kept)) is not None


def test_the_servers_revision_job_reports_while_it_hashes_and_names_a_failure(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from eagle3.server.backends.base import BackendError
    from eagle3.server.backends.identity import RevisionJob

    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(RevisionJob, "report_every_s", 0.01)
    release = threading.Event()
    real_hash = file_digests.hash_file

    def slow_hash(*args: object, **kw: object) -> str:
        release.wait(10)
        return real_hash(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(file_digests, "hash_file", slow_hash)
    job = RevisionJob(model)  # as open_checkpoint starts it, before the engine loads
    phases: list[str] = []

    def progress(phase: str, _fraction: float) -> None:
        phases.append(phase)
        release.set()  # the engine is ready first: the server says what it still waits for

    assert job.result(progress) == checkpoint_revision(model, FileDigests(tmp_path / "other"))
    assert phases and phases[0].startswith("hashing the checkpoint's weights")

    def failing_read(*_args: object, **_kw: object) -> str:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(file_digests, "hash_file", failing_read)
    copy = shutil.copytree(model, tmp_path / "copy")  # new inodes: nothing remembered
    with pytest.raises(BackendError, match=f"{copy}: cannot hash the weights for its revision: .*Input/output"):
        RevisionJob(copy).result()
