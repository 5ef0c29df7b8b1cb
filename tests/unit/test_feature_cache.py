"""The feature cache's tiers on their own (server/feature_cache.py, server/cache_disk.py): a corrupt or
truncated disk entry is a miss and is deleted, LRU eviction keeps each tier within its byte limit, a new
process finds the entries of an old one, two caches sharing a directory from several threads never
return wrong states, and a forward pass asks the backend only for its misses (once per distinct sample)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from eagle3.server.cache_disk import SUFFIX, DiskTier
from eagle3.server.feature_cache import ENTRY_OVERHEAD_BYTES, FeatureCache, compute_with_cache
from eagle3.server.units import Sample

LAYERS, HIDDEN = 4, 16
NAMESPACE = b"n" * 16


def states_of(ids: list[int], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Deterministic states that differ per token id and position."""
    n = len(ids)
    base = torch.tensor(ids, dtype=torch.float32)[:, None, None] + torch.arange(n, dtype=torch.float32)[:, None, None]
    return (base * 0.37 + torch.arange(LAYERS * HIDDEN, dtype=torch.float32).view(1, LAYERS, HIDDEN)).to(dtype)


def disk_cache(path: Path, disk_bytes: int = 1 << 30, memory_bytes: int = 0) -> FeatureCache:
    return FeatureCache(NAMESPACE, memory_bytes, DiskTier(path, disk_bytes))


def stored(cache: FeatureCache, ids: list[int], dtype: torch.dtype = torch.bfloat16) -> bytes:
    key, arr = cache.key(ids)
    cache.put(key, arr, states_of(ids, dtype))
    assert cache.disk is not None
    cache.disk.flush()
    return key


def entry_files(root: Path) -> list[Path]:
    return sorted(root.rglob(f"*{SUFFIX}"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_disk_entry_reads_back_bitwise_after_a_restart(tmp_path: Path, dtype: torch.dtype) -> None:
    ids = [5, 9, 2, 7, 7, 1]
    first = disk_cache(tmp_path)
    stored(first, ids, dtype)
    first.close()
    second = disk_cache(tmp_path, memory_bytes=1 << 20)  # a new process: the index is rebuilt from the directory
    assert second.disk is not None and second.disk.n_entries == 1
    got = second.get(*second.key(ids))
    assert got is not None and got.dtype == dtype and got.shape == (len(ids), LAYERS, HIDDEN)
    assert torch.equal(got.view(torch.uint8), states_of(ids, dtype).view(torch.uint8))
    assert second.stats.disk_hits == 1 and second.stats.misses == 0
    assert second.get(*second.key(ids)) is got, "a disk hit is promoted to memory"
    assert second.stats.memory_hits == 1
    second.close()


def test_a_flipped_byte_is_a_miss_then_the_sample_is_recomputed(tmp_path: Path) -> None:
    ids = list(range(40, 80))
    cache = disk_cache(tmp_path)
    stored(cache, ids)
    cache.close()
    (path,) = entry_files(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of the states
    path.write_bytes(bytes(data))

    cache = disk_cache(tmp_path)
    calls: list[list[int]] = []

    def compute(samples: list[Sample]) -> list[tuple[Any, dict[str, Any] | None]]:
        calls.extend(s.input_ids for s in samples)
        return [(states_of(s.input_ids), None) for s in samples]

    sample = Sample(0, "a", ids, [0] * len(ids))
    outputs, computed = compute_with_cache(cache, [sample], [True], compute)
    assert calls == [ids] and computed == [sample], "the corrupt entry was served instead of recomputed"
    assert torch.equal(outputs[0][0].view(torch.int16), states_of(ids).view(torch.int16))
    assert cache.disk is not None and cache.disk.stats.corrupt == 1 and cache.stats.misses == 1
    cache.disk.flush()
    assert entry_files(tmp_path) == [path], "the recomputed entry replaces the corrupt one"
    assert bytes(data) != path.read_bytes()
    cache.close()
    fresh = disk_cache(tmp_path)
    got = fresh.get(*fresh.key(ids))
    assert got is not None and torch.equal(got.view(torch.int16), states_of(ids).view(torch.int16))
    fresh.close()


@pytest.mark.parametrize("cut", ["truncated", "empty", "other_ids"])
def test_a_truncated_empty_or_foreign_entry_is_a_miss_and_deleted(tmp_path: Path, cut: str) -> None:
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    cache = disk_cache(tmp_path)
    key = stored(cache, ids)
    (path,) = entry_files(tmp_path)
    data = path.read_bytes()
    asked = ids
    if cut == "truncated":
        path.write_bytes(data[: len(data) - 100])
    elif cut == "empty":
        path.write_bytes(b"")
    else:  # the same key holding other token ids: what a hash collision would look like
        asked = [*ids[:-1], 7]
    assert cache.disk is not None
    assert cache.disk.get(key.hex(), np.asarray(asked, dtype="<i4")) is None
    assert cache.disk.stats.corrupt == 1 and not path.exists() and cache.disk.n_entries == 0
    cache.close()


def test_memory_tier_evicts_least_recently_used_within_its_byte_limit() -> None:
    ids = [[i] * 10 for i in range(1, 6)]
    entry_bytes = states_of(ids[0]).numel() * 2 + 10 * 4 + ENTRY_OVERHEAD_BYTES
    cache = FeatureCache(NAMESPACE, memory_bytes=3 * entry_bytes)
    for sample in ids[:3]:
        key, arr = cache.key(sample)
        cache.put(key, arr, states_of(sample))
    assert cache.get(*cache.key(ids[0])) is not None  # 0 is now the most recently used
    for sample in ids[3:]:
        key, arr = cache.key(sample)
        cache.put(key, arr, states_of(sample))
    assert cache.memory_bytes <= 3 * entry_bytes and cache.stats.memory_evictions == 2
    present = [cache.get(*cache.key(s)) is not None for s in ids]
    assert present == [True, False, False, True, True]


def test_disk_tier_evicts_oldest_files_within_its_byte_limit(tmp_path: Path) -> None:
    probe = disk_cache(tmp_path / "probe")
    stored(probe, [1] * 10)
    (one,) = entry_files(tmp_path / "probe")
    size = one.stat().st_size
    probe.close()

    cache = disk_cache(tmp_path / "c", disk_bytes=3 * size)
    for i in range(6):
        stored(cache, [i + 1] * 10)
        time.sleep(0.01)  # distinct mtimes: the order a restart rebuilds
        if i == 2:
            assert cache.get(*cache.key([1] * 10)) is not None  # touch the oldest: it becomes the newest
    assert cache.disk is not None
    on_disk = sum(p.stat().st_size for p in entry_files(tmp_path / "c"))
    assert on_disk <= 3 * size and cache.disk.bytes == on_disk and cache.disk.stats.evictions == 3
    cache.close()
    reopened = disk_cache(tmp_path / "c", disk_bytes=3 * size)
    hits = [reopened.get(*reopened.key([i + 1] * 10)) is not None for i in range(6)]
    assert hits == [False, False, False, True, True, True], hits  # 1 was touched, but 4, 5, 6 came later
    reopened.close()
    smaller = disk_cache(tmp_path / "c", disk_bytes=size)  # a restart with a lower --cache-gb evicts at once
    assert smaller.disk is not None and smaller.disk.n_entries == 1 and len(entry_files(tmp_path / "c")) == 1
    smaller.close()


def test_two_caches_sharing_a_directory_under_threads_never_answer_wrong(tmp_path: Path) -> None:
    """Two servers on one --feature-cache-dir, four threads each, writing and reading the same 24 keys."""
    caches = [disk_cache(tmp_path, memory_bytes=0), disk_cache(tmp_path, memory_bytes=0)]
    samples = [[k + 1] * (5 + k) for k in range(24)]
    wrong: list[str] = []

    def worker(cache: FeatureCache, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(150):
            ids = samples[int(rng.integers(len(samples)))]
            key, arr = cache.key(ids)
            got = cache.get(key, arr)
            if got is None:
                cache.put(key, arr, states_of(ids))
            elif not torch.equal(got.view(torch.int16), states_of(ids).view(torch.int16)):
                wrong.append(str(ids))

    threads = [threading.Thread(target=worker, args=(caches[i % 2], i)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for cache in caches:
        cache.close()
    assert not wrong, wrong[:3]
    assert not list(tmp_path.rglob("*.tmp")), "a temporary file was left behind"
    check = disk_cache(tmp_path)
    assert check.disk is not None and check.disk.n_entries == len(entry_files(tmp_path)) <= 24
    for ids in samples:
        got = check.get(*check.key(ids))
        assert got is None or torch.equal(got.view(torch.int16), states_of(ids).view(torch.int16))
    assert check.disk.stats.corrupt == 0
    check.close()


def test_a_pass_computes_only_its_misses_once_each_and_bypass_is_never_cached() -> None:
    cache = FeatureCache(NAMESPACE, memory_bytes=1 << 20)
    calls: list[list[list[int]]] = []

    def compute(samples: list[Sample]) -> list[tuple[Any, dict[str, Any] | None]]:
        calls.append([s.input_ids for s in samples])
        return [(None, {"type": "backend_error"}) if s.input_ids == [9] else (states_of(s.input_ids), None)
                for s in samples]  # fmt: skip

    a, b, c, failing = [1, 2, 3], [4, 5], [6], [9]
    batch = [Sample(i, f"s{i}", ids, [0] * len(ids)) for i, ids in enumerate([a, b, a, failing, c])]
    outputs, computed = compute_with_cache(cache, batch, [True, True, True, True, False], compute)
    assert calls == [[a, b, failing, c]], "a repeated sample in one pass is computed once"
    assert [s.sample_id for s in computed] == ["s0", "s1", "s3", "s4"]
    assert outputs[0][0] is outputs[2][0] and outputs[3] == (None, {"type": "backend_error"})
    outputs, computed = compute_with_cache(cache, batch, [True, True, True, True, False], compute)
    assert calls[1] == [failing, c], "hits skip the backend; failures and bypassing samples are not cached"
    for (got, _), ids in zip(outputs, [a, b, a], strict=False):
        assert torch.equal(got.view(torch.int16), states_of(ids).view(torch.int16))
    assert cache.stats.memory_hits == 3 and cache.stats.misses == 3 + 1


def test_views_of_a_batch_tensor_are_copied_not_pinned() -> None:
    batch = torch.zeros((4, 10, LAYERS, HIDDEN), dtype=torch.bfloat16)
    cache = FeatureCache(NAMESPACE, memory_bytes=1 << 20)
    key, arr = cache.key([1] * 6)
    kept = cache.put(key, arr, batch[1, :6])
    assert kept.untyped_storage().nbytes() == 6 * LAYERS * HIDDEN * 2


def test_what_the_cache_cannot_store_passes_through_and_a_broken_tier_is_a_miss(tmp_path: Path) -> None:
    """The lookup runs on the scheduler thread: nothing the cache does may raise there."""
    cache = disk_cache(tmp_path, memory_bytes=1 << 20)
    sample = Sample(0, "a", [1, 2], [0, 0])
    outputs, _ = compute_with_cache(cache, [sample], [True], lambda s: [("not a tensor", None)])
    assert outputs == [("not a tensor", None)] and cache.memory_bytes == 0
    tier = cache.disk
    assert tier is not None
    tier.get = None  # type: ignore[assignment,method-assign]  # any fault inside the disk tier
    assert cache.get(*cache.key([7, 7])) is None and cache.stats.misses == 2
    tier.close()
