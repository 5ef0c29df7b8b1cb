"""``BufferPool`` recycles a frame buffer only when nothing references it (client/buffer_pool.py).

Every way the client derives arrays from a frame body (numpy views, ``memoryview`` slices, ``numpy.frombuffer``
over a memoryview, as ``FrameDecoder`` and the safetensors parser do) must keep the buffer out of reuse while
it lives; once released, the next body of a fitting size gets the same memory back.
"""

from __future__ import annotations

import gc
import threading

import numpy as np

from eagle3.client.buffer_pool import ROUND_BYTES, BufferPool

MB = 1 << 20


def test_a_buffer_comes_back_only_when_every_derived_array_is_gone() -> None:
    pool = BufferPool(1 << 30)
    first = pool(10 * MB)
    body = memoryview(first.data).cast("B")  # what FrameDecoder does with it
    states = np.frombuffer(body[4096:], np.uint16)  # what the safetensors parser hands out
    del first, body
    states[:] = 7
    second = pool(10 * MB)
    assert not np.shares_memory(second, states), "a buffer still referenced by an array was handed out again"
    assert pool.n_reused == 0
    second[:] = 1
    assert (states == 7).all()
    del states
    gc.collect()
    third = pool(10 * MB)
    assert pool.n_reused == 1 and pool.n_allocated == 2
    assert third.nbytes == 10 * MB and third.dtype == np.uint8


def test_sizes_round_to_huge_pages_and_a_much_bigger_buffer_is_not_used_for_a_small_body() -> None:
    pool = BufferPool(1 << 30)
    big = pool(64 * MB)
    assert big.base is not None and big.base.nbytes == 64 * MB
    del big
    small = pool(3 * MB)  # the free 64 MB buffer would waste 61 MB: a new one is made
    assert pool.n_reused == 0 and small.base is not None and small.base.nbytes == 2 * ROUND_BYTES
    del small
    again = pool(3 * MB + 5)  # fits the free 4 MB buffer
    assert pool.n_reused == 1 and again.nbytes == 3 * MB + 5


def test_the_pool_forgets_free_buffers_beyond_its_limit_and_never_blocks() -> None:
    pool = BufferPool(8 * MB)
    kept = [pool(4 * MB) for _ in range(4)]  # all in use: allocation never waits, older ones are forgotten
    assert pool.held_bytes <= 8 * MB and len({id(k.base) for k in kept}) == 4
    del kept
    for _ in range(10):
        pool(4 * MB)
    assert pool.held_bytes <= 8 * MB


def test_threads_sharing_a_pool_never_get_the_same_live_buffer() -> None:
    pool = BufferPool(64 * MB)
    errors: list[str] = []

    def worker(tag: int) -> None:
        for i in range(200):
            buf = pool(2 * MB + 64 * (i % 5))
            buf[:] = tag
            if not (buf == tag).all():  # another thread wrote into the buffer this one holds
                errors.append(f"thread {tag}, round {i}")
            del buf

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert pool.n_reused > 0
