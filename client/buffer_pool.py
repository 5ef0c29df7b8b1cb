"""Frame buffers recycled instead of freshly mapped: ``BufferPool`` is a ``FrameDecoder`` ``allocate``.

Every big frame body the client receives needs a buffer of its own (the sample's arrays are views of it).
A fresh ``numpy.empty`` of tens of MB is fresh memory from the kernel: page faults, the kernel zeroing
every page, and, when free huge pages run short because the page cache holds the shards just written,
compaction stalls. In ``extract_dataset`` those were most of the client's CPU (docs/performance.md,
"Serving path"). Once the shard writer has written a sample and dropped it, its buffer is garbage; the
pool hands it out again instead.

When a buffer is free is read from CPython's reference count of the buffer's base array, never guessed:
every numpy view, ``memoryview`` and ``numpy.frombuffer`` result made from it holds a reference to it, so
a buffer whose only references are the pool's own is referenced by nothing else and can be overwritten.
A buffer still in use (a notebook keeping its arrays, a shard write in flight) is simply not reused. The
pool keeps at most ``max_bytes`` of buffers; beyond that it forgets free ones, oldest first (their memory
goes back to the allocator). Thread-safe: several request threads share one pool.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from eagle3.core.sample import NDArray

ROUND_BYTES = 2 << 20  # buffers are whole huge pages: a buffer fits the next body of up to that much more


class BufferPool:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._buffers: list[NDArray] = []  # base arrays handed out, oldest first
        self._lock = threading.Lock()
        self.n_reused = 0
        self.n_allocated = 0
        # references to a base array that only the pool holds, as counted inside `_is_free`: the list's
        # slot and getrefcount's argument (measured here once, so the check does not assume an interpreter)
        probe: list[NDArray] = [np.empty(1, np.uint8)]
        self._free_refcount = self._refcount(probe, 0)

    @staticmethod
    def _refcount(buffers: list[NDArray], index: int) -> int:
        return sys.getrefcount(buffers[index])

    def _is_free(self, index: int) -> bool:
        return self._refcount(self._buffers, index) <= self._free_refcount

    def __call__(self, n_bytes: int) -> NDArray:
        """A writable uint8 array of exactly ``n_bytes`` (a view of a pooled buffer; contents undefined)."""
        with self._lock:
            best = -1
            for i in range(len(self._buffers)):  # by index: a loop variable (or enumerate's tuple) is a reference
                size = self._buffers[i].nbytes
                fits = n_bytes <= size < n_bytes + 4 * ROUND_BYTES and (best < 0 or size < self._buffers[best].nbytes)
                if fits and self._is_free(i):
                    best = i
            if best >= 0:
                base = self._buffers.pop(best)
                self._buffers.append(base)  # most recently used last
                self.n_reused += 1
                return base[:n_bytes]
            base = np.empty(-(-n_bytes // ROUND_BYTES) * ROUND_BYTES, np.uint8)
            self._buffers.append(base)
            self.n_allocated += 1
            self._trim()
            return base[:n_bytes]

    def _trim(self) -> None:
        """Forget free buffers, oldest first, while the pool holds more than ``max_bytes`` (in-use ones
        are forgotten too once nothing free is left to drop: the pool never blocks an allocation)."""
        total = sum(b.nbytes for b in self._buffers)
        i = 0
        while total > self.max_bytes and i < len(self._buffers):
            if self._is_free(i):
                total -= self._buffers.pop(i).nbytes
            else:
                i += 1
        while total > self.max_bytes and len(self._buffers) > 1:
            total -= self._buffers.pop(0).nbytes

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._buffers)
