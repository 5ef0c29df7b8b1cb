"""A content-addressed cache of extracted samples (``--cache-memory-mb``, ``--feature-cache-dir``, ``--cache-gb``).

Key: xxh3-128 of the *namespace* (everything about the server that determines the bytes: the model
identity (``ModelIdentity``: checkpoint id, its revision by the weights' content, layer ids, sizes,
tokenizer), backend and its package versions, device, dtype and the engine settings that change
numerics, ``cache_namespace``) followed by the sample's token ids as
int32. The token ids are stored with the states and compared on every hit, so a hash collision is a
miss, never another sample's states.

Tiers: memory (LRU, bounded in bytes, the states tensors themselves, shared read-only by every
stream that hits them) then disk (``server/cache_disk.py``: atomic files, MACed, LRU by mtime,
survives restarts). A disk hit is promoted to memory. Stores go to both; the disk write happens on a
background thread.

Where it sits: the scheduler thread, per forward pass (``compute_with_cache``): the pass's samples
are looked up first, only the misses go to the backend (two samples with the same key in one pass
are computed once), and the backend's states are stored. Hits therefore travel the same path as
computed states: the same fairness clock (their tokens count as scheduled), the same per-request
output buffer, the same frames. A request with ``"cache": "bypass"`` is neither looked up nor stored.

What the cache returns is what the backend returned the first time. For backends whose output does
not depend on batching (synthetic; hf in float32) that is bitwise what a recomputation gives; for hf
in bfloat16 a recomputation in another batch may differ by bf16 rounding (docs/architecture.md), the
cache then returns one of those valid results, always the same one.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
import xxhash

from eagle3.server.backends.base import BackendInfo
from eagle3.server.cache_disk import DTYPE_NAMES, DiskTier

logger = logging.getLogger(__name__)
ENTRY_OVERHEAD_BYTES = 256  # bookkeeping per memory entry, counted against the limit
ENGINE_PACKAGES = {"hf": ("torch", "transformers"), "vllm": ("torch", "vllm"), "synthetic": ("torch",)}
Output = tuple[Any, dict[str, Any] | None]  # (states, None) or (None, error): the scheduler's per-sample result


class HasIds(Protocol):
    @property
    def input_ids(self) -> list[int]: ...


S = TypeVar("S", bound=HasIds)


def package_versions(backend: str) -> dict[str, str]:
    """Versions of the packages whose code computes ``backend``'s states."""
    out = {}
    for name in ENGINE_PACKAGES.get(backend, ("torch",)):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def cache_namespace(info: BackendInfo, engine: dict[str, Any]) -> bytes:
    """16 bytes naming everything but the token ids that determines a sample's states; ``engine``:
    the settings of this server that can change numerics (tensor parallel size, vLLM compile, ...)."""
    fields = {
        "format": 2,  # 2: the whole model identity, its revision by content (core/identity.py)
        **info.identity.as_fields(),
        "backend": info.backend,
        "versions": package_versions(info.backend),
        "device": info.device,
        "dtype": info.dtype,
        "engine": engine,
    }
    return xxhash.xxh3_128_digest(json.dumps(fields, sort_keys=True, default=str).encode())


def owned(states: torch.Tensor) -> torch.Tensor:
    """``states`` as a tensor that owns exactly its bytes: a view into a bigger batch tensor (the hf
    backend's rows) or pinned memory is copied, so the cache never pins a whole pass."""
    storage_bytes = states.untyped_storage().nbytes()
    if states.is_contiguous() and storage_bytes == states.numel() * states.element_size() and not states.is_pinned():
        return states
    return states.contiguous().clone()


@dataclass
class CacheStats:
    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    memory_evictions: int = 0
    collisions: int = 0  # same hash, other token ids (counted as misses)


class FeatureCache:
    def __init__(
        self, namespace: bytes, memory_bytes: int, disk: DiskTier | None = None, *, per_tenant: bool = False
    ) -> None:
        self.namespace = namespace
        self.per_tenant = per_tenant  # --cache-scope tenant: the tenant's name joins every key
        self.memory_max_bytes = memory_bytes
        self.disk = disk
        self.stats = CacheStats()
        self.memory_bytes = 0
        self._lock = threading.Lock()
        self._memory: OrderedDict[bytes, tuple[np.ndarray, torch.Tensor, int]] = OrderedDict()

    @classmethod
    def open(
        cls,
        info: BackendInfo,
        engine: dict[str, Any],
        memory_bytes: int,
        cache_dir: str | Path | None,
        disk_bytes: int,
        *,
        per_tenant: bool = False,
    ) -> FeatureCache:
        disk = DiskTier(cache_dir, disk_bytes) if cache_dir else None
        return cls(cache_namespace(info, engine), memory_bytes, disk, per_tenant=per_tenant)

    def key(self, input_ids: Sequence[int], tenant: str = "") -> tuple[bytes, np.ndarray]:
        """The entry's key and the ids as int32; ``tenant`` joins the key when the cache is per tenant."""
        ids = np.asarray(input_ids, dtype="<i4")
        digest = xxhash.xxh3_128()
        digest.update(self.namespace)
        if self.per_tenant:
            name = tenant.encode()
            digest.update(len(name).to_bytes(4, "little") + name)  # length first: no two tenants' keys meet
        digest.update(ids.data.cast("B"))
        return digest.digest(), ids

    def get(self, key: bytes, ids: np.ndarray) -> torch.Tensor | None:
        """The states of ``ids`` (memory, else disk, promoted to memory), or None. Never raises: a fault
        of the cache is a miss (it runs on the scheduler thread, which must not die)."""
        try:
            return self._get(key, ids)
        except Exception:
            logger.exception("feature cache: lookup failed; computing the sample")
            self.stats.misses += 1
            return None

    def _get(self, key: bytes, ids: np.ndarray) -> torch.Tensor | None:
        with self._lock:
            entry = self._memory.get(key)
            if entry is not None:
                if np.array_equal(entry[0], ids):
                    self._memory.move_to_end(key)
                    self.stats.memory_hits += 1
                    return entry[1]
                self.stats.collisions += 1
        states = self.disk.get(key.hex(), ids) if self.disk is not None else None
        if states is None:
            self.stats.misses += 1
            return None
        self.stats.disk_hits += 1
        self._remember(key, ids, states)
        return states

    def put(self, key: bytes, ids: np.ndarray, states: Any) -> Any:
        """Store the backend's ``states`` for ``ids``; returns what to send (the cache's own copy). Never
        raises: what is not a CPU tensor of a known dtype, or a fault of the cache, is just not stored."""
        if not isinstance(states, torch.Tensor) or states.device.type != "cpu" or states.dtype not in DTYPE_NAMES:
            return states
        try:
            kept = owned(states)
            self._remember(key, ids, kept)
            if self.disk is not None:
                self.disk.put(key.hex(), ids, kept)
        except Exception:
            logger.exception("feature cache: storing a sample failed; it is served uncached")
            return states
        return kept

    def _remember(self, key: bytes, ids: np.ndarray, states: torch.Tensor) -> None:
        size = states.numel() * states.element_size() + ids.nbytes + ENTRY_OVERHEAD_BYTES
        if size > self.memory_max_bytes:
            return
        with self._lock:
            old = self._memory.pop(key, None)
            if old is not None:
                self.memory_bytes -= old[2]
            self._memory[key] = (ids, states, size)
            self.memory_bytes += size
            while self.memory_bytes > self.memory_max_bytes:
                _, (_, _, evicted) = self._memory.popitem(last=False)
                self.memory_bytes -= evicted
                self.stats.memory_evictions += 1

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def describe(self) -> dict[str, int]:
        """``/v1/info``'s ``feature_cache`` limits."""
        return {"memory_bytes": self.memory_max_bytes, "disk_bytes": self.disk.max_bytes if self.disk else 0}

    def counters(self) -> Iterator[tuple[str, str, tuple[tuple[str, str], ...], float]]:
        """Scrape-time counters (``_total`` is appended): plain ints kept here, off the hot path's locks."""
        s, d = self.stats, self.disk
        hits = "Feature cache hits (samples served without a forward pass)"
        yield "eagle3_cache_hits", hits, (("tier", "memory"),), s.memory_hits
        yield "eagle3_cache_hits", hits, (("tier", "disk"),), s.disk_hits
        yield "eagle3_cache_misses", "Feature cache misses (samples looked up, then computed)", (), s.misses
        evictions = "Feature cache entries evicted (least recently used, over the tier's byte limit)"
        yield "eagle3_cache_evictions", evictions, (("tier", "memory"),), s.memory_evictions
        if d is not None:
            yield "eagle3_cache_evictions", evictions, (("tier", "disk"),), d.stats.evictions
            text = "Disk cache entries that failed a check on read (deleted, then recomputed)"
            yield "eagle3_cache_corrupt", text, (), d.stats.corrupt
            text = "Disk cache writes skipped because the writer's queue was full"
            yield "eagle3_cache_dropped_writes", text, (), d.stats.dropped_writes

    def gauges(self) -> Iterator[tuple[str, str, tuple[tuple[str, str], ...], float]]:
        text = "Bytes held by the feature cache"
        yield "eagle3_cache_bytes", text, (("tier", "memory"),), self.memory_bytes
        if self.disk is not None:
            yield "eagle3_cache_bytes", text, (("tier", "disk"),), self.disk.bytes
        text = "Samples held by the feature cache"
        yield "eagle3_cache_entries", text, (("tier", "memory"),), len(self._memory)
        if self.disk is not None:
            yield "eagle3_cache_entries", text, (("tier", "disk"),), self.disk.n_entries


def compute_with_cache(
    cache: FeatureCache | None,
    samples: list[S],
    use_cache: list[bool],
    compute: Callable[[list[S]], list[Output]],
    tenants: Sequence[str] | None = None,
) -> tuple[list[Output], list[S]]:
    """One forward pass's outputs, in order, and the samples the backend computed (the misses).

    Samples with ``use_cache`` are looked up (under their tenant's name when the cache is per tenant);
    the misses (each distinct key once) and the bypassing samples go to ``compute`` in one call;
    successful misses are stored."""
    outputs: list[Output | None] = [None] * len(samples)
    todo: list[int] = []  # indices computed by the backend
    keyed: dict[bytes, list[int]] = {}  # key -> indices of the samples it answers (misses only)
    keys: dict[int, tuple[bytes, np.ndarray]] = {}
    for i, (sample, use) in enumerate(zip(samples, use_cache, strict=True)):
        if cache is None or not use:
            todo.append(i)
            continue
        key, ids = cache.key(sample.input_ids, tenants[i] if tenants is not None else "")
        if key in keyed:
            if np.array_equal(keys[keyed[key][0]][1], ids):
                keyed[key].append(i)  # the same sample twice in one pass: computed once
            else:
                todo.append(i)  # a hash collision within the pass: computed, not cached
            continue
        states = cache.get(key, ids)
        if states is not None:
            outputs[i] = (states, None)
            continue
        keyed.setdefault(key, []).append(i)
        keys[i] = (key, ids)
        todo.append(i)
    computed = compute([samples[i] for i in todo]) if todo else []
    for i, (states, error) in zip(todo, computed, strict=True):
        if i in keys and error is None and cache is not None:
            key, ids = keys[i]
            states = cache.put(key, ids, states)
            for j in keyed[key]:
                outputs[j] = (states, None)
        elif i in keys:
            for j in keyed[keys[i][0]]:
                outputs[j] = (states, error)
        else:
            outputs[i] = (states, error)
    done = [out for out in outputs if out is not None]
    assert len(done) == len(samples)
    return done, [samples[i] for i in todo]
